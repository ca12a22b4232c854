"""Every PromQL expression of ``deploy/grafana/inferencecache.json`` names only metrics a real
server exports, and the dashboard covers what operators need."""

from __future__ import annotations

import json
import re
import urllib.request
from typing import Iterator, Set

from conftest import REPO
from inferencecache import Producer, Router

DASHBOARD = REPO / "deploy" / "grafana" / "inferencecache.json"

# PromQL words that are not metric names.
KEYWORDS = {
    "by", "without", "on", "ignoring", "group_left", "group_right", "offset", "bool",
    "and", "or", "unless", "inf", "nan",
}


def expressions(node) -> Iterator[str]:
    """Every ``expr`` and templating ``query`` string in the dashboard."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key in ("expr", "definition") and isinstance(value, str):
                yield value
            elif key == "query" and isinstance(value, dict) and isinstance(value.get("query"), str):
                yield value["query"]
            else:
                yield from expressions(value)
    elif isinstance(node, list):
        for item in node:
            yield from expressions(item)


def metric_names(expr: str) -> Set[str]:
    """Metric names an expression selects (label matchers, groupings, ranges and strings
    removed; an identifier followed by ``(`` is a function)."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)
    text = re.sub(r"\{[^}]*\}", "", text)
    text = re.sub(r"\[[^\]]*\]", "", text)
    text = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", text)
    text = re.sub(r"label_values\(\s*([a-zA-Z_:][a-zA-Z0-9_:]*)\s*,[^)]*\)", r"\1", text)
    names = set()
    for match in re.finditer(r"(?<![\w.$:])([a-zA-Z_:][a-zA-Z0-9_:]*)(?![\w:])(?!\s*\()", text):
        word = match.group(1)
        if word.lower() not in KEYWORDS:
            names.add(word)
    return names


def test_metric_name_extraction():
    assert metric_names('histogram_quantile(0.99, sum by (le) (rate(a_bucket{x="y(z)"}[5m])))') == {"a_bucket"}
    assert metric_names("sum(rate(b_total[1m])) / sum(c) and on (i) d offset 5m") == {"b_total", "c", "d"}
    assert metric_names("label_values(up, instance)") == {"up"}
    assert metric_names("1e-06 * e") == {"e"}


def exported_sample_names(text: str) -> Set[str]:
    """Every sample name a page can hold, from its ``# TYPE`` lines (a family without
    observations yet has no sample lines)."""
    names: Set[str] = set()
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 4 and parts[:2] == ["#", "TYPE"]:
            name, kind = parts[2], parts[3]
            names.add(name)
            if kind == "histogram":
                names |= {f"{name}_bucket", f"{name}_sum", f"{name}_count"}
            elif kind == "summary":
                names |= {f"{name}_sum", f"{name}_count"}
    return names


def test_every_expression_names_only_exported_metrics(server):
    with Producer(server.target, replica_id="r", model_id="m", tenant_id="t") as producer:
        producer.report_token_chains([list(range(64))])
    with Router(server.target, timeout=5) as router:
        router.lookup("m", tenant_id="t", token_ids=list(range(64)))
    with urllib.request.urlopen(server.metrics_url, timeout=5) as reply:
        exported = exported_sample_names(reply.read().decode())
    # The sidecar panels: the sidecar's families (its README table, held to a live sidecar by
    # test_texts.py).
    exported |= sidecar_metrics()
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = list(expressions(dashboard))
    assert len(exprs) >= 20
    used: Set[str] = set()
    for expr in exprs:
        names = metric_names(expr)
        assert names, f"no metric in {expr!r}"
        unknown = names - exported
        assert not unknown, f"{expr!r} names {sorted(unknown)}, which the server does not export"
        used |= names
    for needed in [
        "inferencecache_lookup_route_calls_total",
        "inferencecache_lookup_route_latency_seconds_bucket",
        "inferencecache_index_lookup_latency_seconds",
        "inferencecache_ingest_blocks_total",
        "inferencecache_index_storage_entries",
        "inferencecache_index_entries",
        "inferencecache_index_memory_bytes",
        "inferencecache_index_evictions_total",
        "inferencecache_stream_events_dropped_total",
        "inferencecache_replication_lag_seconds",
        "inferencecache_replication_gaps_total",
        "inferencecache_replication_leader",
        "inferencecache_grpc_connections_open",
        "inferencecache_grpc_connections_refused_total",
        "inferencecache_sidecar_resyncs_total",
        "inferencecache_sidecar_sequence_gaps_total",
        "inferencecache_sidecar_send_errors_total",
        "inferencecache_sidecar_server_reachable",
    ]:
        assert needed in used, f"the dashboard has no panel on {needed}"


def sidecar_metrics() -> Set[str]:
    section = (REPO / "sidecar" / "README.md").read_text().split("## The sidecar's own metrics", 1)[1]
    return set(re.findall(r"^\| `(inferencecache_sidecar_[a-z_]+)` \|", section, re.M))


def expected_units(expr: str) -> Set[str]:
    """The units a panel may show ``expr`` in, from what it computes."""
    names = metric_names(expr)
    rated = "rate(" in expr
    if "histogram_quantile" in expr:
        return {"s"}
    if any(n.endswith("_bytes") for n in names):
        return {"bytes", "decbytes"}
    if names == {"process_cpu_seconds_total"}:
        return {"none", "short"}  # CPU seconds per second: cores
    if rated and "/" in expr:
        if all(n.endswith(("_seconds_sum", "_seconds_count")) for n in names):
            return {"s"}  # mean duration
        return {"percentunit"}  # a share
    if "increase(" in expr:
        return {"short", "none"}  # a count over the window
    if rated:
        return {"ops", "reqps", "short"}  # per second
    if "time()" in expr or any(n.endswith("_seconds") or "_seconds_since_" in n for n in names):
        return {"s"}
    return {"short", "none"}


def test_every_series_is_shown_in_its_unit():
    dashboard = json.loads(DASHBOARD.read_text())
    wrong = []
    for panel in dashboard["panels"]:
        config = panel.get("fieldConfig", {})
        default = config.get("defaults", {}).get("unit", "short")
        by_ref = {
            o["matcher"]["options"]: next(p["value"] for p in o["properties"] if p["id"] == "unit")
            for o in config.get("overrides", [])
            if o.get("matcher", {}).get("id") == "byFrameRefID"
        }
        for target in panel["targets"]:
            unit = by_ref.get(target["refId"], default)
            if unit not in expected_units(target["expr"]):
                wrong.append(f'{panel["title"]} {target["refId"]}: {unit} for {target["expr"]}')
    assert not wrong, "\n".join(wrong)


def test_dashboard_shape():
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] == "inferencecache"
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids)), "panel ids are unique"
    for panel in dashboard["panels"]:
        assert panel["targets"], panel["title"]
        refs = [t["refId"] for t in panel["targets"]]
        assert len(refs) == len(set(refs)), panel["title"]
