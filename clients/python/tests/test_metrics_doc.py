"""``docs/metrics.md`` lists exactly what a real server exports.

The server runs with a producer token (so the producer-auth family exists), takes a report, a
lookup and an event (so the labeled series exist), then its ``/metrics`` page is parsed with
``prometheus_client``'s text-format parser. Fails on a metric exported but not documented,
documented but not exported, of another type, or with an undocumented label.
"""

from __future__ import annotations

import os
import re
import time
import urllib.request
from typing import Dict, Set, Tuple

from prometheus_client.parser import text_string_to_metric_families

from conftest import REPO, start_server, stop
from inferencecache import Producer, Router, pb

ROW = re.compile(r"^\|\s*`([a-z_:][a-z0-9_:]*)`\s*\|\s*(counter|gauge|histogram|summary)\s*\|\s*([^|]*)\|")


def documented() -> Dict[str, Tuple[str, Set[str]]]:
    """name → (type, labels) from the table rows of docs/metrics.md."""
    rows: Dict[str, Tuple[str, Set[str]]] = {}
    for line in (REPO / "docs" / "metrics.md").read_text().splitlines():
        match = ROW.match(line)
        if match:
            name, kind, labels = match.groups()
            assert name not in rows, f"{name} documented twice"
            rows[name] = (kind, set(re.findall(r"`([a-z_]+)`", labels)))
    assert len(rows) > 20, "the metrics table was not found"
    return rows


def exported(text: str) -> Dict[str, Tuple[str, Set[str]]]:
    """name → (type, label names) as the Prometheus parser sees the page."""
    out: Dict[str, Tuple[str, Set[str]]] = {}
    for family in text_string_to_metric_families(text):
        # The parser strips a counter's `_total`; the docs name the series as exported.
        name = family.name + "_total" if family.type == "counter" else family.name
        labels: Set[str] = set()
        for sample in family.samples:
            labels |= set(sample.labels)
        out[name] = (family.type, labels)
    return out


def scrape(tmp_path) -> str:
    token = tmp_path / "producer-tokens"
    token.write_text("secret-producer-token\n")
    server = start_server(tmp_path, ["--producer-token-file", str(token)])
    try:
        with Producer(server.target, replica_id="r1", model_id="m", tenant_id="t", token="secret-producer-token") as producer:
            assert producer.report_token_chains([list(range(128))]).accepted
            assert producer.heartbeat().accepted
        with Router(server.target, timeout=5) as router:
            assert router.lookup("m", tenant_id="t", token_ids=list(range(128))).hit
        with urllib.request.urlopen(server.metrics_url, timeout=5) as reply:
            assert reply.headers["Content-Type"].startswith("text/plain; version=0.0.4")
            return reply.read().decode()
    finally:
        stop(server.process)


def test_every_metric_is_documented_and_every_documented_metric_exported(tmp_path):
    text = scrape(tmp_path)
    docs, live = documented(), exported(text)
    undocumented = sorted(set(live) - set(docs))
    missing = sorted(set(docs) - set(live))
    assert not undocumented, f"exported but not in docs/metrics.md: {undocumented}"
    assert not missing, f"in docs/metrics.md but not exported: {missing}"
    for name, (kind, labels) in live.items():
        doc_kind, doc_labels = docs[name]
        assert kind == doc_kind, f"{name}: exported as {kind}, documented as {doc_kind}"
        assert labels <= doc_labels, f"{name}: labels {sorted(labels - doc_labels)} are not documented"


def test_every_help_text_opens_its_documented_meaning(tmp_path):
    """A ``# HELP`` line and the table's Meaning cell say the same thing: the cell starts with
    the HELP text verbatim (and may go on with detail), so neither can drift alone."""
    text = scrape(tmp_path)
    meanings: Dict[str, str] = {}
    for line in (REPO / "docs" / "metrics.md").read_text().splitlines():
        if ROW.match(line):
            cells = [c.strip() for c in line.strip().strip("|").split("|")]
            meanings[cells[0].strip("`")] = "|".join(cells[3:])
    helps = {}
    for line in text.splitlines():
        if line.startswith("# HELP "):
            name, _, help_text = line[len("# HELP "):].partition(" ")
            helps[name] = help_text
    assert len(helps) > 40
    disagree = [f"{n}: HELP {h!r}, docs {meanings.get(n, '')[:80]!r}" for n, h in helps.items() if not meanings.get(n, "").startswith(h)]
    assert not disagree, "\n".join(disagree)


def test_latency_buckets_resolve_microseconds_and_keep_the_reference_ones(tmp_path):
    text = scrape(tmp_path)
    bounds = [
        float(s.labels["le"])
        for f in text_string_to_metric_families(text)
        if f.name == "inferencecache_lookup_route_latency_seconds"
        for s in f.samples
        if s.name.endswith("_bucket")
    ]
    assert bounds[:6] == [1e-06, 2.5e-06, 5e-06, 1e-05, 2.5e-05, 5e-05]
    assert bounds[6:] == [0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, float("inf")]


def test_build_info_and_process_metrics_hold_real_values(tmp_path):
    families = {f.name: f for f in text_string_to_metric_families(scrape(tmp_path))}
    (info,) = families["inferencecache_build_info"].samples
    assert info.value == 1 and re.fullmatch(r"\d+\.\d+\.\d+.*", info.labels["version"])
    value = lambda name: families[name].samples[0].value  # noqa: E731
    assert 1 << 20 < value("process_resident_memory_bytes") < 4 << 30
    assert value("process_virtual_memory_bytes") >= value("process_resident_memory_bytes")
    assert value("process_threads") >= 2  # the async runtime's workers
    assert 3 <= value("process_open_fds") <= value("process_max_fds")
    # CPU time is counted in clock ticks (10 ms): a fresh server may still be at 0. It can never
    # exceed wall time since the start on every core.
    started = value("process_start_time_seconds")
    assert time.time() - 600 < started <= time.time() + 1
    cpu = value("process_cpu_seconds")  # the parser drops a counter's `_total`
    assert 0 <= cpu <= (time.time() - started + 1) * (os.cpu_count() or 1)
