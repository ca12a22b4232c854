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
