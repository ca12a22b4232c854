"""The ``grpc.aio`` variant against the real server: the same miss, report, hit and fail-open."""

import asyncio

from conftest import free_port
from inferencecache import aio

TOKENS = list(range(0, 256))


def test_async_router_and_producer(server):
    async def scenario():
        async with aio.Router(server.target, timeout=5) as router, aio.Producer(
            server.target, replica_id="r-async", model_id="m", tenant_id="t"
        ) as producer:
            miss = await router.lookup("m", tenant_id="t", token_ids=TOKENS)
            ack = await producer.report([producer.update([producer.chain_entry(TOKENS)])])
            hit = await router.lookup("m", tenant_id="t", token_ids=TOKENS)
            results = await asyncio.gather(*(router.lookup("m", tenant_id="t", token_ids=TOKENS[:64]) for _ in range(20)))
            cleared = await producer.clear()
            after = await router.lookup("m", tenant_id="t", token_ids=TOKENS)
            return miss, ack, hit, results, cleared, after, router.fail_open.total

    miss, ack, hit, results, cleared, after, failed = asyncio.run(scenario())
    assert miss.reason_code == "NO_HINT"
    assert ack.accepted and cleared.accepted
    assert hit.reason_code == "PREFIX_MATCH" and hit.replica_scores[0].replica_id == "r-async"
    assert hit.replica_scores[0].matched_tokens == 256
    assert all(r.replica_scores[0].matched_tokens == 64 for r in results)
    assert after.replica_scores == ()
    assert failed == 0


def test_async_unreachable_server_fails_open():
    async def scenario():
        async with aio.Router(f"127.0.0.1:{free_port()}", timeout=0.5) as router:
            return await router.lookup("m", tenant_id="t", token_ids=TOKENS), router.fail_open.snapshot()

    result, counts = asyncio.run(scenario())
    assert result.reason_code == "NO_HINT" and result.fail_open_cause == "transport_error"
    assert counts["transport_error"] == 1


def public(cls) -> set:
    return {name for name in dir(cls) if not name.startswith("_")}


def test_sync_and_aio_expose_the_same_methods():
    import inferencecache

    for name in ("Router", "Producer", "Observer", "StateStream"):
        assert public(getattr(inferencecache, name)) == public(getattr(aio, name)), name


def test_async_stream_heartbeat_chains_metrics_pd_and_render(server):
    other = list(range(7000, 7064))

    async def scenario():
        async with aio.Router(server.target, timeout=5) as router, aio.Producer(
            server.target, replica_id="r-async", model_id="m", tenant_id="t"
        ) as producer, aio.Observer(server.target) as observer:
            async with producer.stream(timeout=10) as stream:
                await stream.send(producer.update([producer.chain_entry(TOKENS)]))
                await stream.send(producer.update([producer.chain_entry(other)]))
            streamed = await stream.close()
            chains = await producer.report_token_chains([list(range(9000, 9064))])
            heartbeat = await producer.heartbeat()
            hit = await router.lookup("m", tenant_id="t", token_ids=other)
            chained = await router.lookup("m", tenant_id="t", token_ids=list(range(9000, 9064)))
            metrics = observer.metrics()
            names = set()
            async for sample in metrics:
                names.add(sample.name)
                if "inferencecache_ingest_blocks_total" in names:
                    break
            metrics.cancel()
            pd = await router.lookup_pd_route("m", tenant_id="t")
            rendered = await router.render_template("ns/chat", tenant_id="t")
            invalid = await router.lookup("m", tenant_id="t", token_ids=[-1])
            return streamed, chains, heartbeat, hit, chained, names, pd, rendered, invalid, router.fail_open.snapshot()

    streamed, chains, heartbeat, hit, chained, names, pd, rendered, invalid, counts = asyncio.run(scenario())
    assert streamed.accepted and chains.accepted and heartbeat.accepted
    assert [(s.replica_id, s.matched_tokens) for s in hit.replica_scores] == [("r-async", 64)]
    assert [(s.replica_id, s.matched_tokens) for s in chained.replica_scores] == [("r-async", 64)]
    assert "inferencecache_ingest_blocks_total" in names
    assert pd.reason_code == "NO_HINT" and rendered.reason_code == "OK"
    assert invalid.fail_open_cause == "invalid_request"
    assert counts == {"transport_error": 0, "timeout": 0, "unknown_reason_code": 0, "invalid_request": 1}
