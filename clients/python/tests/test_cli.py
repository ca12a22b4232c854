"""``python -m inferencecache`` against the real server: the README quick start's calls."""

import json
import subprocess
import sys


def cli(*args):
    done = subprocess.run([sys.executable, "-m", "inferencecache", *args], capture_output=True, text=True, timeout=60)
    return done.returncode, done.stdout, done.stderr


def test_report_lookup_state_snapshot(server):
    code, out, err = cli("lookup", "--target", server.target, "--model", "demo", "--tenant", "demo", "--tokens", "0-255")
    assert code == 0, err
    assert json.loads(out)["reason_code"] == "NO_HINT"
    code, out, err = cli("report", "--target", server.target, "--model", "demo", "--tenant", "demo", "--replica", "r0", "--tokens", "0-255")
    assert code == 0, err
    ack = json.loads(out)
    # The Ack names the answering server instance (a new one at every start).
    assert ack["accepted"] is True and len(ack["server_instance_id"]) == 32, ack
    assert set(ack) == {"accepted", "server_instance_id"}, ack
    code, out, err = cli("lookup", "--target", server.target, "--model", "demo", "--tenant", "demo", "--tokens", "0-255")
    result = json.loads(out)
    assert result["reason_code"] == "PREFIX_MATCH"
    assert [(s["replica_id"], s["matched_tokens"]) for s in result["replica_scores"]] == [("r0", 256)]
    code, out, err = cli("state", "--target", server.target, "--model", "demo", "--tenant", "demo")
    assert code == 0, err
    assert json.loads(out)["summary"]["total_prefixes"] == "16"  # int64 is a JSON string in proto3
    code, out, err = cli("snapshot", "--url", server.control_url)
    assert code == 0, err
    assert "r0" in out


def test_usage_errors_exit_2_and_failures_exit_1(server):
    code, _, err = cli("lookup", "--model", "demo", "--tenant", "demo", "--tokens", "9-1")
    assert code == 2 and "empty token range" in err
    code, _, err = cli("snapshot", "--url", "http://127.0.0.1:1")
    assert code == 1 and "GET /snapshot failed" in err
