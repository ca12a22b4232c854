"""``Router``, ``Producer`` and ``Observer`` against the real server binary, and the fail-open
paths (an unreachable server, an expired deadline, a reason code this client does not know, an
invalid request), the channel options (round robin, reconnecting within 2 s of a server's
return), ``LookupPDRoute`` and ``RenderTemplate``."""

from __future__ import annotations

import concurrent.futures
import json
import time
import urllib.request

import grpc
import pytest

from conftest import free_port, start_server, start_server_on, stop
from inferencecache import InvalidRequest, Observer, Producer, Router, chain, channel_options, pb
from inferencecache.v1alpha1 import inferencecache_pb2_grpc as pb_grpc

TOKENS = list(range(0, 256))  # 16 blocks of the server's default block size 16


def producer(server, replica="r1", model="m", tenant="t"):
    return Producer(server.target, replica_id=replica, model_id=model, tenant_id=tenant)


def test_lookup_misses_then_hits_after_a_report(server):
    with Router(server.target, timeout=5) as router:
        miss = router.lookup("m", tenant_id="t", token_ids=TOKENS)
        assert miss.reason_code == "NO_HINT"
        assert miss.replica_scores == () and miss.fail_open_cause is None
        with producer(server) as p:
            ack = p.report_token_chains([TOKENS])
        assert ack.accepted
        hit = router.lookup("m", tenant_id="t", token_ids=TOKENS)
        assert hit.reason_code == "PREFIX_MATCH" and hit.hit
        assert [s.replica_id for s in hit.replica_scores] == ["r1"]
        assert hit.replica_scores[0].matched_tokens == 256
        assert hit.replica_scores[0].tier == pb.CACHE_TIER_T1
        assert hit.best_replica == "r1"
        assert router.fail_open.total == 0


def test_local_fingerprint_matches_the_servers(server):
    """The server fingerprints token_ids itself; block_hashes computed here must hit the same
    entries, block for block (a half-length prompt matches exactly its 8 blocks)."""
    with producer(server) as p:
        assert p.report_token_chains([TOKENS]).accepted
    with Router(server.target, timeout=5) as router:
        hashes, counts = chain(TOKENS[:128])
        by_hash = router.lookup("m", tenant_id="t", block_hashes=hashes, block_token_counts=counts)
        by_tokens = router.lookup("m", tenant_id="t", token_ids=TOKENS[:128])
        assert by_hash.reason_code == by_tokens.reason_code == "PREFIX_MATCH"
        assert by_hash.replica_scores[0].matched_tokens == 128
        assert by_tokens.replica_scores[0].matched_tokens == 128


def test_longest_holder_ranks_first(server):
    with producer(server, "short") as p:
        p.report_token_chains([TOKENS[:128]])
    with producer(server, "long") as p:
        p.report_token_chains([TOKENS])
    with Router(server.target, timeout=5) as router:
        result = router.lookup("m", tenant_id="t", token_ids=TOKENS)
    assert [(s.replica_id, s.matched_tokens) for s in result.replica_scores] == [("long", 256), ("short", 128)]


def test_streaming_updates_and_events(server):
    other = list(range(5000, 5064))
    with producer(server) as p, Router(server.target, timeout=5) as router:
        with p.stream(timeout=10) as stream:
            stream.send(p.update([p.chain_entry(TOKENS)]))
            stream.send(p.update([p.chain_entry(other)], stats=pb.ReplicaStats(hit_rate=0.5)))
        assert stream.close().accepted
        assert router.lookup("m", tenant_id="t", token_ids=other).replica_scores[0].matched_tokens == 64
        # PREFIX_EVICTED of the first block: no leading run matches any more. The replica still
        # serves the scope, so the answer falls back to an affinity hint with nothing matched.
        assert p.evict(chain(TOKENS)[0][0]).accepted
        evicted = router.lookup("m", tenant_id="t", token_ids=TOKENS)
        assert evicted.reason_code == "AFFINITY_HINT"
        assert [(s.replica_id, s.matched_tokens) for s in evicted.replica_scores] == [("r1", 0)]
        assert router.lookup("m", tenant_id="t", token_ids=other).hit
        # ALL_CLEARED: the replica holds nothing and serves nothing in the scope.
        assert p.clear().accepted
        cleared = router.lookup("m", tenant_id="t", token_ids=other)
        assert cleared.reason_code == "NO_HINT" and cleared.replica_scores == ()


def test_observer_state_and_event_stream(server):
    with Observer(server.target) as observer:
        events = observer.events(model_id="m")
        time.sleep(0.3)  # the subscription is live once the call is established
        with producer(server) as p:
            stats = pb.ReplicaStats(hit_rate=0.25, cache_memory_bytes=4096)
            p.report([p.update([p.chain_entry(TOKENS[:64])], stats=stats)])
        first = next(events)
        events.cancel()
        assert first.type == pb.CacheEvent.PREFIX_ADDED and first.replica_id == "r1"
        state = observer.state("m", "t")
        assert [(r.replica_id, r.cache_memory_bytes) for r in state.replicas] == [("r1", 4096)]
        assert state.summary.total_prefixes == 4


def test_unreachable_server_is_a_counted_no_hint():
    with Router(f"127.0.0.1:{free_port()}", timeout=0.5) as router:
        result = router.lookup("m", tenant_id="t", token_ids=TOKENS)
    assert result.reason_code == "NO_HINT" and result.replica_scores == ()
    assert result.fail_open_cause == "transport_error"
    assert router.fail_open.snapshot() == {"transport_error": 1, "timeout": 0, "unknown_reason_code": 0, "invalid_request": 0}


class _Scripted(pb_grpc.InferenceCacheServicer):
    """A stand-in server for answers the real one never gives: slow, or a future reason code."""

    def __init__(self, delay_s: float, reason: str) -> None:
        self.delay_s, self.reason = delay_s, reason

    def LookupRoute(self, request, context):
        time.sleep(self.delay_s)
        return pb.LookupRouteResponse(
            reason_code=self.reason, replica_scores=[pb.ReplicaScore(replica_id="x", score=1.0)]
        )


@pytest.fixture()
def scripted():
    servers = []

    def start(delay_s=0.0, reason="PREFIX_MATCH"):
        srv = grpc.server(concurrent.futures.ThreadPoolExecutor(max_workers=2))
        pb_grpc.add_InferenceCacheServicer_to_server(_Scripted(delay_s, reason), srv)
        port = srv.add_insecure_port("127.0.0.1:0")
        srv.start()
        servers.append(srv)
        return f"127.0.0.1:{port}"

    yield start
    for srv in servers:
        srv.stop(0)


def test_expired_deadline_is_a_counted_no_hint(scripted):
    target = scripted(delay_s=1.0)
    with Router(target, timeout=0.05) as router:
        started = time.monotonic()
        result = router.lookup("m", tenant_id="t", token_ids=TOKENS)
        elapsed = time.monotonic() - started
    assert result.reason_code == "NO_HINT" and result.fail_open_cause == "timeout"
    assert elapsed < 0.9, "the deadline, not the server, ended the call"
    assert router.fail_open.snapshot()["timeout"] == 1


def test_unknown_reason_code_is_a_counted_no_hint(scripted):
    with Router(scripted(reason="SOMETHING_NEW"), timeout=5) as router:
        result = router.lookup("m", tenant_id="t", token_ids=TOKENS)
        known = Router(scripted(reason="PREFIX_MATCH"), timeout=5)
        assert known.lookup("m", tenant_id="t", token_ids=TOKENS).best_replica == "x"
        known.close()
    assert result.reason_code == "NO_HINT" and result.replica_scores == ()
    assert result.server_reason_code == "SOMETHING_NEW"
    assert router.fail_open.snapshot() == {"transport_error": 0, "timeout": 0, "unknown_reason_code": 1, "invalid_request": 0}


def test_an_invalid_request_is_its_own_cause_not_a_network_fault(server):
    """A caller's bug (a value the wire cannot carry, an empty tenant) is ``invalid_request``,
    never ``transport_error``; the server stays reachable and answers the next valid lookup."""
    with Router(server.target, timeout=5) as router:
        negative = router.lookup("m", tenant_id="t", token_ids=[-1, 2])
        not_an_int = router.lookup("m", tenant_id="t", token_ids=["a"])  # type: ignore[list-item]
        empty_tenant = router.lookup("m", tenant_id="", token_ids=TOKENS)
        valid = router.lookup("m", tenant_id="t", token_ids=TOKENS)
        counts = router.fail_open.snapshot()
    for result in (negative, not_an_int, empty_tenant):
        assert result.reason_code == "NO_HINT" and result.replica_scores == ()
        assert result.fail_open_cause == "invalid_request", result
    assert "tenant_id" in empty_tenant.detail
    assert valid.fail_open_cause is None and valid.reason_code == "NO_HINT"
    assert counts == {"transport_error": 0, "timeout": 0, "unknown_reason_code": 0, "invalid_request": 3}


def test_tenant_is_required_where_an_empty_one_never_matches(server):
    with pytest.raises(TypeError):
        Router(server.target).lookup("m", token_ids=TOKENS)  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        Producer(server.target, replica_id="r", model_id="m")  # type: ignore[call-arg]
    with pytest.raises(InvalidRequest):
        Producer(server.target, replica_id="r", model_id="m", tenant_id="")


def test_pd_route_and_render_template_reach_the_server(server, scripted):
    """Both RPCs answer from the real server (its stubs: NO_HINT, and an empty OK render), and a
    failure is the same fail-open answer, counted by cause."""
    with Router(server.target, timeout=5) as router:
        pd = router.lookup_pd_route("m", tenant_id="t", prefix_hash=b"\x01" * 8, prefix_token_count=16)
        rendered = router.render_template("ns/chat", tenant_id="t", variables={"user": "x"})
        assert router.fail_open.total == 0
        invalid = router.lookup_pd_route("m", tenant_id="")
        assert router.fail_open.snapshot()["invalid_request"] == 1
    assert pd.reason_code == "NO_HINT" and pd.prefill_replica_id == pd.decode_replica_id == ""
    assert rendered.reason_code == "OK" and rendered.rendered_prompt == b""
    assert invalid.reason_code == "NO_HINT"
    with Router(f"127.0.0.1:{free_port()}", timeout=0.5) as router:
        assert router.lookup_pd_route("m", tenant_id="t").reason_code == "NO_HINT"
        assert router.render_template("ns/chat", tenant_id="t").reason_code == "OK"
        assert router.fail_open.snapshot()["transport_error"] == 2


def test_channel_options_bound_the_backoff_and_balance_round_robin():
    options = dict(channel_options())
    assert options["grpc.max_reconnect_backoff_ms"] <= 1000
    assert options["grpc.keepalive_time_ms"] > 0 and options["grpc.keepalive_timeout_ms"] > 0
    assert json.loads(options["grpc.service_config"]) == {"loadBalancingConfig": [{"round_robin": {}}]}
    assert dict(channel_options([("grpc.max_reconnect_backoff_ms", 5000)]))["grpc.max_reconnect_backoff_ms"] == 5000


def test_round_robin_over_dns_reaches_every_address(tmp_path):
    """Two servers behind one target that resolves to both addresses (an ``ipv4:`` list, what
    a ``dns:///`` name of a headless Service resolves to, one address per pod): the default
    channel spreads lookups over both (gRPC's default, pick_first, would send all to one)."""
    servers = [start_server(tmp_path / str(i)) for i in range(2)]
    try:
        target = "ipv4:" + ",".join(f"127.0.0.1:{s.grpc_port}" for s in servers)
        # An address list has no host name for :authority (a dns:/// target has one).
        with Router(target, timeout=5, options=[("grpc.default_authority", "inferencecache")]) as router:
            for _ in range(20):
                assert router.lookup("m", tenant_id="t", token_ids=TOKENS).fail_open_cause is None
        for s in servers:
            with urllib.request.urlopen(s.metrics_url, timeout=5) as reply:
                page = reply.read().decode()
            calls = sum(
                float(line.rsplit(" ", 1)[1])
                for line in page.splitlines()
                if line.startswith("inferencecache_lookup_route_calls_total{")
            )
            assert calls >= 5, f"server {s.grpc_port} got {calls} of 20 lookups"
    finally:
        for s in servers:
            stop(s.process)


def test_lookups_answer_again_within_2_s_of_the_servers_return(tmp_path):
    """A 10 s outage (long enough for gRPC's default backoff to grow past 10 s), then the server
    returns on the same port: the same Router's lookups are answered by it within 2 s."""
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    first = start_server(tmp_path / "a")
    ports = (first.grpc_port, first.http_port, first.control_port)
    with Router(first.target, timeout=0.2) as router:
        assert router.lookup("m", tenant_id="t", token_ids=TOKENS).fail_open_cause is None
        stop(first.process)
        outage_end = time.monotonic() + 10
        while time.monotonic() < outage_end:
            assert router.lookup("m", tenant_id="t", token_ids=TOKENS).fail_open_cause in ("transport_error", "timeout")
            time.sleep(0.1)
        second = start_server_on(tmp_path / "b", ports)
        back = time.monotonic()  # /readyz answers 200: the server has returned
        try:
            while True:
                result = router.lookup("m", tenant_id="t", token_ids=TOKENS)
                if result.fail_open_cause is None:
                    break
                assert time.monotonic() - back < 2.0, f"still failing open: {result}"
                time.sleep(0.02)
            recovered = time.monotonic() - back
        finally:
            stop(second.process)
    print(f"lookups answered again {recovered * 1000:.0f} ms after the server's return")
    assert recovered < 2.0



