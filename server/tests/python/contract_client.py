"""Cross-language contract check: a Python grpcio client generated from the project's own proto.

Usage: contract_client.py --target HOST:PORT --proto-root DIR

Generates the Python stubs from proto/inferencecache/v1alpha1/inferencecache.proto with
grpc_tools.protoc into a temporary directory, then exercises the real server: health, the
ReportCacheState client stream, PublishEvent, LookupRoute, GetCacheState and StreamCacheEvents.
Exits non-zero with a message on the first mismatch.
"""

import argparse
import importlib
import sys
import tempfile
import threading
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_tools import protoc

PROTO = "inferencecache/v1alpha1/inferencecache.proto"


def generate(proto_root: str, out_dir: str):
    status = protoc.main(["protoc", f"-I{proto_root}", f"--python_out={out_dir}", f"--grpc_python_out={out_dir}", PROTO])
    if status != 0:
        sys.exit(f"protoc failed with status {status}")
    sys.path.insert(0, out_dir)
    pb = importlib.import_module("inferencecache.v1alpha1.inferencecache_pb2")
    rpc = importlib.import_module("inferencecache.v1alpha1.inferencecache_pb2_grpc")
    return pb, rpc


def check(cond, what):
    if not cond:
        sys.exit(f"contract mismatch: {what}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", required=True)
    ap.add_argument("--proto-root", required=True)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as out:
        pb, rpc = generate(args.proto_root, out)
        channel = grpc.insecure_channel(args.target)
        grpc.channel_ready_future(channel).result(timeout=10)

        health = health_pb2_grpc.HealthStub(channel)
        reply = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
        check(reply.status == health_pb2.HealthCheckResponse.SERVING, "health SERVING")

        stub = rpc.InferenceCacheStub(channel)
        events = []
        stream = stub.StreamCacheEvents(pb.StreamEventsRequest(model_id="py-model"))

        def consume():
            try:
                for ev in stream:
                    events.append(ev)
            except grpc.RpcError:
                pass

        reader = threading.Thread(target=consume, daemon=True)
        reader.start()
        time.sleep(0.3)  # the subscription is live once the call is established

        chain = [b"py-b1", b"py-b2", b"py-b3"]

        def updates():
            yield pb.CacheStateUpdate(
                replica_id="py-r1",
                model_id="py-model",
                tenant_id="py-tenant",
                hash_scheme="vllm",
                prefixes=[pb.PrefixEntry(block_hashes=chain, block_token_counts=[64, 64, 64], tier=pb.CACHE_TIER_T2)],
                stats=pb.ReplicaStats(hit_rate=0.75, cache_memory_bytes=4096),
            )
            yield pb.CacheStateUpdate(
                replica_id="py-r2",
                model_id="py-model",
                tenant_id="py-tenant",
                hash_scheme="vllm",
                prefixes=[pb.PrefixEntry(prefix_hash=b"py-legacy", token_count=10)],
            )

        ack = stub.ReportCacheState(updates(), timeout=5)
        check(ack.accepted and ack.reason_code == "", "ReportCacheState ack")

        req = pb.LookupRouteRequest(
            tenant_id="py-tenant",
            model_id="py-model",
            hash_scheme="vllm",
            block_hashes=chain + [b"py-x4"],
            block_token_counts=[64, 64, 64, 64],
        )
        resp = stub.LookupRoute(req, timeout=5)
        check(resp.reason_code == "PREFIX_MATCH", f"reason {resp.reason_code}")
        check(len(resp.replica_scores) == 1, "one replica")
        top = resp.replica_scores[0]
        check(top.replica_id == "py-r1" and top.matched_tokens == 192, f"top {top}")
        check(top.tier == pb.CACHE_TIER_T2, "tier T2")
        check(resp.lookup_latency_us >= 0, "latency set")

        bad = stub.LookupRoute(pb.LookupRouteRequest(block_hashes=[b"a", b"b"], block_token_counts=[1]), timeout=5)
        check(bad.reason_code == "NO_HINT" and len(bad.replica_scores) == 0, "malformed chain fails open")

        ack = stub.PublishEvent(
            pb.CacheEvent(type=pb.CacheEvent.PREFIX_EVICTED, replica_id="py-r2", model_id="py-model", tenant_id="py-tenant", prefix_hash=b"py-legacy"),
            timeout=5,
        )
        check(ack.accepted, "PublishEvent ack")

        state = stub.GetCacheState(pb.GetCacheStateRequest(model_id="py-model", tenant_id="py-tenant"), timeout=5)
        check(state.summary.total_prefixes == 3, f"total_prefixes {state.summary.total_prefixes}")
        check([r.replica_id for r in state.replicas] == ["py-r1"], "stats replicas")
        check(abs(state.replicas[0].hit_rate - 0.75) < 1e-6 and state.replicas[0].cache_memory_bytes == 4096, "stats values")

        deadline = time.time() + 5
        while time.time() < deadline and not any(e.type == pb.CacheEvent.PREFIX_EVICTED for e in events):
            time.sleep(0.05)
        types = [e.type for e in events]
        check(types.count(pb.CacheEvent.PREFIX_ADDED) == 4, f"4 PREFIX_ADDED events, got {types}")
        check(pb.CacheEvent.REPLICA_UPDATED in types, "REPLICA_UPDATED streamed")
        check(pb.CacheEvent.PREFIX_EVICTED in types, "PREFIX_EVICTED streamed")
        stream.cancel()
        channel.close()
    print("python contract: ok")


if __name__ == "__main__":
    main()
