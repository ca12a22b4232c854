#!/usr/bin/env python3
"""Runs the engines' own KV-event publisher code for the sidecar's end-to-end tests.

The publisher modules come unmodified from the published wheels (see prepare.sh):
  vLLM    vllm/distributed/kv_events.py
  SGLang  sglang/srt/disaggregation/kv_events.py and sglang/srt/mem_cache/events.py
Only imports unrelated to publishing are stubbed: loggers, config dataclasses, network helpers
and SGLang's native page-hash helpers (whose values only need to be stable and chained).

Protocol: one JSON command per stdin line, one JSON answer per stdout line
(`{"ok": true, ...}` or `{"ok": false, "error": "..."}`). Commands:
  start    engine=vllm|sglang endpoint replay buffer_steps page_size
  publish  (vLLM) events=[{kind: stored|removed|cleared, chain, first, tokens, ...}]; vLLM 0.33's
           per-group and offload fields pass through (group_idx, kv_cache_spec_kind,
           kv_cache_spec_sliding_window, locality, ownership, session_id, lookahead_token_ids);
           a stored event's `blocks` names its block indices when vLLM left null blocks out of
           block_hashes (token_ids still cover them); `override` sets fields after construction
           (a malformed event, as msgspec encodes whatever the fields hold)
  store / remove / clear   (SGLang radix nodes, through KVCacheEventRecorder), then one batch
  restart  a new publisher process state on the same endpoints (sequence back to 0)
  proxy    upstream listen drop=[seq...]: forwards the PUB stream, dropping those sequences
  scrape   url: GET and parse with prometheus_client's text parser
  fetch    url: GET, the body as text
  post     url body: POST a JSON body
  dropped  the sequences the proxies dropped so far
  stop
"""

import argparse
import dataclasses
import hashlib
import importlib.util
import json
import logging
import sys
import threading
import time
import types
import urllib.request

import zmq
from prometheus_client.parser import text_string_to_metric_families


def _module(name, **attrs):
    mod = types.ModuleType(name)
    mod.__path__ = []  # importable as a package too
    mod.__dict__.update(attrs)
    sys.modules[name] = mod
    return mod


def _load(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[name] = mod
    spec.loader.exec_module(mod)
    return mod


def load_vllm(sources):
    @dataclasses.dataclass
    class KVEventsConfig:
        enable_kv_cache_events: bool = False
        publisher: str = "null"
        endpoint: str = "tcp://*:5557"
        replay_endpoint: str | None = None
        buffer_steps: int = 10_000
        hwm: int = 100_000
        max_queue_size: int = 100_000
        topic: str = ""

    def split_zmq_path(path):
        scheme, rest = path.split("://", 1)
        host, _, port = rest.rpartition(":")
        return scheme, host, port

    for name in ("vllm", "vllm.config", "vllm.utils", "vllm.v1", "vllm.v1.core", "vllm.distributed"):
        _module(name)
    _module("vllm.config.kv_events", KVEventsConfig=KVEventsConfig)
    _module("vllm.logger", init_logger=logging.getLogger)
    _module(
        "vllm.utils.network_utils",
        get_ip=lambda: "127.0.0.1",
        get_tcp_uri=lambda ip, port: f"tcp://{ip}:{port}",
        is_valid_ipv6_address=lambda ip: ":" in ip,
        split_zmq_path=split_zmq_path,
    )
    _module("vllm.v1.core.kv_cache_utils", ExternalBlockHash=bytes | int)
    return _load("vllm.distributed.kv_events", f"{sources}/vllm/distributed/kv_events.py")


def _page_hash(parent, tokens, seed=""):
    text = f"{seed}|{parent or ''}|{','.join(map(str, tokens))}"
    return hashlib.sha256(text.encode()).hexdigest()


def compute_node_hash_values(node, page_size):
    parent = None
    if node.parent is not None and node.parent.hash_value:
        parent = node.parent.hash_value[-1]
    out = []
    tokens = node.key.token_ids
    for start in range(0, len(tokens), page_size):
        parent = _page_hash(parent, tokens[start : start + page_size])
        out.append(parent)
    return out


def compute_node_event_hash_values(node, page_size):
    if node.key.extra_key is None and node.key.cache_salt is None:
        return compute_node_hash_values(node, page_size)
    if node.event_hash_value is not None:
        return node.event_hash_value
    parent = None
    if node.parent is not None and node.parent.event_hash_value:
        parent = node.parent.event_hash_value[-1]
    seed = f"{node.key.extra_key}/{node.key.cache_salt}"
    out = []
    tokens = node.key.token_ids
    for start in range(0, len(tokens), page_size):
        parent = _page_hash(parent, tokens[start : start + page_size], seed)
        out.append(parent)
    node.event_hash_value = out
    return out


def hash_str_to_int64(hex_digest):
    value = int(hex_digest[:16], 16)
    return value - 2**64 if value >= 2**63 else value


def load_sglang(sources):
    class BaseModel:
        pass

    class NetworkAddress:
        @staticmethod
        def parse(_text):
            raise ValueError("not needed by the publisher")

    _module("pydantic", BaseModel=BaseModel)
    for name in ("sglang", "sglang.srt", "sglang.srt.utils", "sglang.srt.disaggregation", "sglang.srt.mem_cache"):
        _module(name)
    _module("sglang.srt.runtime_context", get_parallel=lambda: None)
    _module("sglang.srt.utils.network", NetworkAddress=NetworkAddress)
    _module(
        "sglang.srt.mem_cache.utils",
        compute_node_hash_values=compute_node_hash_values,
        compute_node_event_hash_values=compute_node_event_hash_values,
        hash_str_to_int64=hash_str_to_int64,
    )
    kv = _load("sglang.srt.disaggregation.kv_events", f"{sources}/sglang/srt/disaggregation/kv_events.py")
    events = _load("sglang.srt.mem_cache.events", f"{sources}/sglang/srt/mem_cache/events.py")
    return kv, events


class RadixKey:
    """The fields of SGLang's RadixKey the event recorder reads."""

    def __init__(self, token_ids, extra_key=None, cache_salt=None):
        self.token_ids = list(token_ids)
        self.extra_key = extra_key
        self.cache_salt = cache_salt
        self.is_bigram = False

    def __len__(self):
        return len(self.token_ids)


class TreeNode:
    """The fields of SGLang's radix TreeNode the event recorder reads."""

    def __init__(self, key, parent):
        self.key = key
        self.parent = parent
        self.hash_value = None
        self.event_hash_value = None


def vllm_hash(chain, index):
    return hashlib.sha256(f"{chain}:{index}".encode()).digest()


class Host:
    def __init__(self, sources):
        self.sources = sources
        self.engine = None
        self.args = None
        self.publisher = None
        self.recorder = None
        self.nodes = {}
        self.published = 0
        self.proxies = []

    # --- engine lifecycle -------------------------------------------------------------
    def start(self, cmd):
        self.engine = cmd["engine"]
        self.args = cmd
        if self.engine == "vllm":
            self.kv = load_vllm(self.sources)
        else:
            self.kv, self.events = load_sglang(self.sources)
        self._new_publisher()
        return {}

    def _new_publisher(self):
        args = self.args
        common = dict(
            endpoint=args["endpoint"],
            replay_endpoint=args.get("replay"),
            buffer_steps=args.get("buffer_steps", 10_000),
            topic=args.get("topic", ""),
        )
        if self.engine == "vllm":
            kv = self.kv

            class LoopbackPublisher(kv.ZmqEventPublisher):
                # vLLM binds only wildcard or ipc endpoints; the tests stay on loopback TCP.
                @staticmethod
                def _is_bind_endpoint(endpoint):
                    return True

            self.publisher = LoopbackPublisher(data_parallel_rank=args.get("rank", 0), **common)
        else:
            self.publisher = self.kv.ZmqEventPublisher(attn_dp_rank=args.get("rank", 0), bind=True, **common)
            self.recorder = self.events.KVCacheEventRecorder(enabled=True, page_size=args.get("page_size", 16))
            self.root = TreeNode(RadixKey([]), None)
            self.nodes = {"root": self.root}
        self.published = 0

    def restart(self, _cmd):
        self.publisher.shutdown()
        time.sleep(0.2)
        self._new_publisher()
        return {}

    def _publish(self, events):
        batch = self.kv.KVEventBatch(ts=time.time(), events=events)
        self.publisher.publish(batch)
        seq = self.published
        self.published += 1
        return {"seq": seq}

    # --- vLLM events ------------------------------------------------------------------
    STORED_GROUP_FIELDS = (
        "group_idx",
        "kv_cache_spec_kind",
        "kv_cache_spec_sliding_window",
        "locality",
        "ownership",
        "session_id",
        "lookahead_token_ids",
    )
    REMOVED_GROUP_FIELDS = ("group_idx", "locality", "ownership")

    def publish(self, cmd):
        kv = self.kv
        out = []
        for ev in cmd["events"]:
            kind = ev["kind"]
            if kind == "stored":
                size = ev.get("block_size", 16)
                tokens = ev["tokens"]
                first = ev.get("first", 0)
                blocks = ev.get("blocks", [first + i for i in range(len(tokens) // size)])
                extra = {k: ev[k] for k in self.STORED_GROUP_FIELDS if k in ev}
                event = kv.BlockStored(
                    block_hashes=[vllm_hash(ev["chain"], b) for b in blocks],
                    parent_block_hash=vllm_hash(ev["chain"], first - 1) if first > 0 else None,
                    token_ids=tokens,
                    block_size=size,
                    lora_id=ev.get("lora_id"),
                    medium=ev.get("medium", kv.MEDIUM_GPU),
                    lora_name=ev.get("lora_name"),
                    extra_keys=[tuple(k) if k is not None else None for k in ev["extra_keys"]]
                    if ev.get("extra_keys") is not None
                    else None,
                    **extra,
                )
            elif kind == "removed":
                extra = {k: ev[k] for k in self.REMOVED_GROUP_FIELDS if k in ev}
                event = kv.BlockRemoved(
                    block_hashes=[vllm_hash(ev["chain"], i) for i in ev["blocks"]],
                    medium=ev.get("medium", kv.MEDIUM_GPU),
                    **extra,
                )
            elif kind == "cleared":
                event = kv.AllBlocksCleared()
            else:
                raise ValueError(f"unknown event kind {kind!r}")
            for field, value in ev.get("override", {}).items():
                setattr(event, field, value)
            out.append(event)
        return self._publish(out)

    # --- SGLang radix nodes -----------------------------------------------------------
    def _medium(self, name):
        return self.kv.StorageMedium(name) if name else None

    def store(self, cmd):
        node = self.nodes.get(cmd["node"])
        if node is None:
            parent = self.nodes[cmd.get("parent", "root")]
            key = RadixKey(cmd["tokens"], cache_salt=cmd.get("cache_salt"))
            node = TreeNode(key, parent)
            self.nodes[cmd["node"]] = node
        self.recorder.record_store(node, medium=self._medium(cmd.get("medium")))
        return self._flush(cmd)

    def remove(self, cmd):
        node = self.nodes[cmd["node"]]
        self.recorder.record_remove(node, medium=self._medium(cmd.get("medium")))
        return self._flush(cmd)

    def clear(self, cmd):
        self.recorder.record_all_cleared()
        self.nodes = {"root": self.root}
        return self._flush(cmd)

    def _flush(self, cmd):
        if not cmd.get("flush", True):
            return {}
        return self._publish(self.recorder.take())

    # --- helpers ----------------------------------------------------------------------
    def proxy(self, cmd):
        ctx = zmq.Context.instance()
        upstream = ctx.socket(zmq.SUB)
        upstream.setsockopt(zmq.SUBSCRIBE, b"")
        upstream.connect(cmd["upstream"])
        downstream = ctx.socket(zmq.PUB)
        downstream.bind(cmd["listen"])
        drop = set(cmd.get("drop", []))
        dropped = []

        def forward():
            while True:
                frames = upstream.recv_multipart()
                seq = int.from_bytes(frames[1], "big") if len(frames) == 3 else None
                if seq in drop:
                    dropped.append(seq)
                    continue
                downstream.send_multipart(frames)

        threading.Thread(target=forward, daemon=True).start()
        self.proxies.append(dropped)
        time.sleep(0.3)  # the SUB side's subscription reaches the publisher
        return {}

    def dropped(self, _cmd):
        return {"dropped": [d for p in self.proxies for d in p]}

    def fetch(self, cmd):
        with urllib.request.urlopen(cmd["url"], timeout=5) as response:
            return {"text": response.read().decode()}

    def post(self, cmd):
        request = urllib.request.Request(
            cmd["url"], data=cmd["body"].encode(), method="POST", headers={"Content-Type": "application/json"}
        )
        with urllib.request.urlopen(request, timeout=5) as response:
            return {"status": response.status}

    def scrape(self, cmd):
        with urllib.request.urlopen(cmd["url"], timeout=5) as response:
            text = response.read().decode()
        samples = []
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                samples.append([s.name, s.labels, s.value])
        return {"samples": samples}

    def stop(self, _cmd):
        if self.publisher is not None:
            self.publisher.shutdown()
        return {}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--sources", required=True, help="directory holding the extracted engine files")
    args = parser.parse_args()
    host = Host(args.sources)
    print(json.dumps({"ok": True, "ready": True}), flush=True)
    for line in sys.stdin:
        line = line.strip()
        if not line:
            continue
        cmd = json.loads(line)
        try:
            answer = getattr(host, cmd["op"])(cmd)
            answer["ok"] = True
        except Exception as exc:  # reported to the test, which fails with it
            answer = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        print(json.dumps(answer), flush=True)
        if cmd["op"] == "stop":
            break


if __name__ == "__main__":
    main()
