"""``--help`` of the real binaries, ``docs/configuration.md`` and ``sidecar/README.md`` agree:
the same flags, the same defaults, the same ratios between flags; and the sidecar's live
``/metrics`` exports exactly the families its README lists. (The server's metric names, types,
labels and HELP texts are held to ``docs/metrics.md`` by ``test_metrics_doc.py``.)"""

from __future__ import annotations

import re
import subprocess
import time
import urllib.request
from typing import Dict, Optional

import pytest

from conftest import REPO, free_port, server_bin, sidecar_bin, stop

# Columns of the flag tables: docs/configuration.md has Flag | TOML key | Default | Meaning,
# sidecar/README.md Flag | Default | Meaning. A flag cell may name several flags sharing the row
# (`--a`, `--b`) and an alias in parentheses (not listed by --help).
SERVER_ROW = {"default": 2, "meaning": 3}
SIDECAR_ROW = {"default": 1, "meaning": 2}
HELP_FLAG = re.compile(r"^\s+(?:-[a-zA-Z], )?(--[a-z0-9-]+)")
DEFAULT = re.compile(r"\[default: ([^\]]*)\]")
RATIO = re.compile(r"(\d+) × `?(--[a-z0-9-]+)`?")


def help_flags(binary) -> Dict[str, dict]:
    """flag → {"default": str or None, "text": the help paragraph} from ``BINARY --help``."""
    text = subprocess.run([str(binary), "--help"], check=True, capture_output=True, text=True, timeout=30).stdout
    flags: Dict[str, dict] = {}
    current: Optional[str] = None
    for line in text.splitlines():
        match = HELP_FLAG.match(line)
        if match:
            current = match.group(1)
            flags[current] = {"text": line}
        elif current:
            flags[current]["text"] += " " + line.strip()
    for entry in flags.values():
        found = DEFAULT.search(entry["text"])
        entry["default"] = found.group(1) if found else None
    return flags


def doc_flags(path, row) -> Dict[str, dict]:
    flags = {}
    for line in path.read_text().splitlines():
        if not line.startswith("| `--"):
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        names = re.findall(r"`(--[a-z0-9-]+)`", cells[0].split("(alias", 1)[0])
        for flag in names:
            flags[flag] = {"default": cells[row["default"]], "text": cells[row["meaning"]]}
    assert len(flags) > 10, f"no flag table in {path}"
    return flags


def normalized(default: str) -> str:
    """A documented default as clap prints it: `16` → 16, `""` (none) → "", none → None."""
    value = default.strip()
    if value in ("none", "none (off)", "–", "-", "—", "random", "required"):
        return "<none>"
    value = re.sub(r"\s*\(.*\)$", "", value)  # `""` (none)
    match = re.fullmatch(r"`([^`]*)`", value)
    return match.group(1) if match else value


def compare(binary, doc_path, row, ignore=()):
    helped, documented = help_flags(binary), doc_flags(doc_path, row)
    helped = {f: e for f, e in helped.items() if f not in ("--help", "--version") and f not in ignore}
    documented = {f: e for f, e in documented.items() if f not in ("--help", "--version")}
    assert sorted(set(helped) - set(documented)) == [], f"in --help but not in {doc_path.name}"
    assert sorted(set(documented) - set(helped)) == [], f"in {doc_path.name} but not in --help"
    problems = []
    for flag, entry in helped.items():
        doc_default = normalized(documented[flag]["default"])
        help_default = entry["default"] if entry["default"] is not None else "<none>"
        if help_default in ('""', "<none>") and doc_default in ('""', "<none>"):
            continue
        if doc_default != help_default:
            problems.append(f"{flag}: --help default {help_default!r}, documented {documented[flag]['default']!r}")
        for factor, other in RATIO.findall(entry["text"]):
            if f"{factor} × `{other}`" not in documented[flag]["text"]:
                problems.append(f"{flag}: --help says {factor} × {other}, the docs do not")
    assert not problems, "\n".join(problems)


def test_server_help_agrees_with_docs_configuration():
    compare(server_bin(), REPO / "docs" / "configuration.md", SERVER_ROW)


def test_sidecar_help_agrees_with_its_readme():
    compare(sidecar_bin(), REPO / "sidecar" / "README.md", SIDECAR_ROW)


def test_the_nats_max_age_ratio_is_the_code_s():
    """The code refuses a max age under 2 × the checkpoint interval; both texts say 2."""
    entry = help_flags(server_bin())["--nats-max-age"]
    assert "2 × --checkpoint-interval" in entry["text"], entry


def test_sidecar_metrics_are_the_readme_s(tmp_path):
    documented = set()
    section = (REPO / "sidecar" / "README.md").read_text().split("## The sidecar's own metrics", 1)[1]
    for line in section.split("\n## ", 1)[0].splitlines():
        match = re.match(r"^\| `([a-z_]+)` \|", line)
        if match:
            documented.add(match.group(1))
    port = free_port()
    log = tmp_path / "sidecar.log"
    process = subprocess.Popen(
        [str(sidecar_bin()), "--replica-id=r", "--model-id=m", "--tenant-id=t",
         f"--server=127.0.0.1:{free_port()}", f"--engine-endpoint=tcp://127.0.0.1:{free_port()}",
         f"--metrics-bind-address=127.0.0.1:{port}", f"--engine-metrics-url=http://127.0.0.1:{free_port()}/metrics"],
        stdout=subprocess.DEVNULL, stderr=log.open("wb"),
    )
    try:
        deadline = time.monotonic() + 15
        while True:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as reply:
                    page = reply.read().decode()
                break
            except OSError:
                assert process.poll() is None and time.monotonic() < deadline, log.read_text()
                time.sleep(0.1)
    finally:
        stop(process)
    exported = {line.split()[2] for line in page.splitlines() if line.startswith("# TYPE ")}
    # OpenMetrics-style counters: `# TYPE x counter` with samples x_total; the README names x_total.
    exported = {name if name.endswith("_total") or f"{name}_total" not in page else f"{name}_total" for name in exported}
    assert sorted(exported - documented) == [], "exported but not in sidecar/README.md"
    # Absent before the first batch (the README says so).
    assert sorted(documented - exported) in ([], ["inferencecache_sidecar_seconds_since_last_event"])
