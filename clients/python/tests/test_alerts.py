"""The ``PrometheusRule`` of ``deploy/kubernetes/monitoring.yaml``: ``promtool check rules`` and
``promtool test rules`` (Debian's ``prometheus`` package, extracted by
``deploy/prometheus/prepare-promtool.sh``) pass, every alert has a unit test that fires it and one
that keeps it quiet, and every metric an alert names is one the server or the sidecar exports
(``docs/metrics.md`` and ``sidecar/README.md``, both held to the live binaries)."""

from __future__ import annotations

import os
import pathlib
import re
import shutil
import subprocess
from typing import Dict, Set

import pytest
import yaml

from conftest import REPO
from test_dashboard import metric_names

MONITORING = REPO / "deploy" / "kubernetes" / "monitoring.yaml"
UNIT_TESTS = REPO / "deploy" / "prometheus" / "alerts-test.yaml"
# Series an alert may join against that neither binary exports (kube-state-metrics).
EXTERNAL_METRICS = {"kube_pod_container_resource_limits"}


def promtool() -> pathlib.Path:
    candidates = [
        os.environ.get("PROMTOOL", ""),
        str(pathlib.Path.home() / ".cache" / "inferencecache-ci" / "promtool" / "usr" / "bin" / "promtool"),
        shutil.which("promtool") or "",
    ]
    for candidate in candidates:
        if candidate and pathlib.Path(candidate).is_file():
            return pathlib.Path(candidate)
    message = "promtool not found: run deploy/prometheus/prepare-promtool.sh"
    if os.environ.get("CI"):
        pytest.fail(message)
    pytest.skip(message)


def rule_spec() -> dict:
    (rule,) = [d for d in yaml.safe_load_all(MONITORING.read_text()) if d and d["kind"] == "PrometheusRule"]
    return rule["spec"]


def alerts() -> Dict[str, str]:
    return {r["alert"]: r["expr"] for g in rule_spec()["groups"] for r in g["rules"] if "alert" in r}


@pytest.fixture
def rules_dir(tmp_path) -> pathlib.Path:
    (tmp_path / "alerts.yaml").write_text(yaml.safe_dump(rule_spec(), sort_keys=False))
    shutil.copy(UNIT_TESTS, tmp_path / "alerts-test.yaml")
    return tmp_path


def run(args, cwd) -> subprocess.CompletedProcess:
    return subprocess.run([str(promtool()), *args], cwd=cwd, capture_output=True, text=True, timeout=120)


def test_promtool_check_rules(rules_dir):
    result = run(["check", "rules", "alerts.yaml"], rules_dir)
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(alerts())} rules found" in result.stdout


def test_promtool_unit_tests_pass(rules_dir):
    result = run(["test", "rules", "alerts-test.yaml"], rules_dir)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_promtool_unit_tests_can_fail(rules_dir):
    """A threshold moved in the rules file must break the unit tests (they assert, not just run)."""
    text = (rules_dir / "alerts.yaml").read_text()
    assert "inferencecache_replication_lag_seconds > 30" in text
    (rules_dir / "alerts.yaml").write_text(text.replace("inferencecache_replication_lag_seconds > 30", "inferencecache_replication_lag_seconds > 60"))
    result = run(["test", "rules", "alerts-test.yaml"], rules_dir)
    assert result.returncode != 0
    assert "InferenceCacheReplicationLagging" in result.stdout + result.stderr


def test_every_alert_has_a_firing_and_a_quiet_case():
    fired: Set[str] = set()
    quiet: Set[str] = set()
    for case in yaml.safe_load(UNIT_TESTS.read_text())["tests"]:
        for check in case.get("alert_rule_test", []):
            (fired if check.get("exp_alerts") else quiet).add(check["alertname"])
    names = set(alerts())
    assert names - fired == set(), "alerts without a test that fires them"
    assert names - quiet == set(), "alerts without a test that keeps them quiet"
    assert (fired | quiet) - names == set(), "tests of alerts that do not exist"


def test_the_issue_s_alerts_exist():
    names = set(alerts())
    for needed in [
        "InferenceCacheIndexNotReady",
        "InferenceCacheLookupsFailingOpen",
        "InferenceCacheReplicationLagging",
        "InferenceCacheSidecarResyncing",
        "InferenceCacheSidecarUnfilledGaps",
        "InferenceCacheCheckpointFailing",
        "InferenceCacheMemoryNearLimit",
    ]:
        assert needed in names


def documented_metrics() -> Set[str]:
    names: Set[str] = set()
    for doc in (REPO / "docs" / "metrics.md", REPO / "sidecar" / "README.md"):
        for line in doc.read_text().splitlines():
            match = re.match(r"\|\s*`([a-z_:][a-z0-9_:]*)`\s*\|", line)
            if match:
                names.add(match.group(1))
    return names


def test_alerts_name_only_exported_metrics():
    known = documented_metrics() | EXTERNAL_METRICS
    assert "inferencecache_sidecar_resyncs_total" in known and "inferencecache_server_up" in known
    for name, expr in alerts().items():
        unknown = metric_names(expr) - known
        assert not unknown, f"{name} names {sorted(unknown)}"
