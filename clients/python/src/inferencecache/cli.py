"""``python -m inferencecache``: lookups, cache state and the control-plane snapshot from a shell.

Every command prints JSON on stdout. ``lookup`` is fail-open like :class:`Router`: it exits 0
with a ``NO_HINT`` result when the server is unreachable (the ``fail_open_cause`` field says
why). ``state``, ``report`` and ``snapshot`` exit 1 with a message on stderr when the call fails.
"""

from __future__ import annotations

import argparse
import json
import sys
import urllib.error
import urllib.request
from typing import List, Optional

import grpc
from google.protobuf import json_format

from inferencecache._common import DEFAULT_TARGET
from inferencecache.client import Observer, Producer, Router
from inferencecache.fingerprint import DEFAULT_BLOCK_SIZE, parse_token_list

DEFAULT_CONTROL_URL = "http://127.0.0.1:8081"


def _token_list(text: str) -> List[int]:
    try:
        return parse_token_list(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m inferencecache",
        description="Call an InferenceCache server (gRPC) or its control plane (HTTP).",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    lookup = commands.add_parser("lookup", help="LookupRoute: which replicas hold this prompt's prefix")
    lookup.add_argument("--target", default=DEFAULT_TARGET, help="server gRPC address (default %(default)s)")
    lookup.add_argument("--model", required=True, help="model_id")
    lookup.add_argument("--tenant", required=True, help="tenant_id (also the policy namespace; an empty one never matches)")
    prompt = lookup.add_mutually_exclusive_group(required=True)
    prompt.add_argument("--tokens", type=_token_list, help='token ids: "1,2,3", "0-255" (inclusive) or a mix')
    prompt.add_argument("--prompt-text", help="raw prompt (the server tokenizes it)")
    lookup.add_argument("--hash-scheme", default="vllm", help="hash domain (default %(default)s)")
    lookup.add_argument("--adapter", default="", help="adapter_id (e.g. a LoRA name)")
    lookup.add_argument("--timeout-ms", type=float, default=1000.0, help="deadline (default %(default)s ms)")

    state = commands.add_parser("state", help="GetCacheState of a (tenant, model)")
    state.add_argument("--target", default=DEFAULT_TARGET, help="server gRPC address (default %(default)s)")
    state.add_argument("--model", required=True, help="model_id")
    state.add_argument("--tenant", default="", help="tenant_id")

    report = commands.add_parser("report", help="ReportCacheState: report that a replica holds a token sequence")
    report.add_argument("--target", default=DEFAULT_TARGET, help="server gRPC address (default %(default)s)")
    report.add_argument("--model", required=True, help="model_id")
    report.add_argument("--replica", required=True, help="replica_id")
    report.add_argument("--tenant", required=True, help="tenant_id (what lookups must send)")
    report.add_argument("--tokens", type=_token_list, required=True, help="token ids, as for lookup")
    report.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE, help="tokens per block (default %(default)s)")
    report.add_argument("--hash-scheme", default="vllm", help="hash domain (default %(default)s)")
    report.add_argument("--token-file", help="file holding the producer bearer token")

    snapshot = commands.add_parser("snapshot", help="GET /snapshot from the control listener")
    snapshot.add_argument("--url", default=DEFAULT_CONTROL_URL, help="control-plane base URL (default %(default)s)")
    snapshot.add_argument("--token-file", help="file holding a controller bearer token")
    return parser


def _read_token(path: Optional[str]) -> Optional[str]:
    if not path:
        return None
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            line = line.strip()
            if line and not line.startswith("#"):
                return line
    raise SystemExit(f"inferencecache: no token in {path}")


def _print(value: object) -> None:
    json.dump(value, sys.stdout, indent=2, sort_keys=False)
    sys.stdout.write("\n")


def _fail(what: str, err: Exception) -> int:
    if isinstance(err, grpc.RpcError):
        print(f"inferencecache: {what} failed: {err.code()}: {err.details()}", file=sys.stderr)
    else:
        print(f"inferencecache: {what} failed: {err}", file=sys.stderr)
    return 1


def main(argv: Optional[List[str]] = None) -> int:
    """Entry point of ``python -m inferencecache`` and the ``inferencecache`` script."""
    args = _parser().parse_args(argv)
    if args.command == "lookup":
        with Router(args.target, timeout=args.timeout_ms / 1000.0) as router:
            result = router.lookup(
                args.model,
                tenant_id=args.tenant,
                token_ids=args.tokens,
                prompt_text=args.prompt_text or "",
                hash_scheme=args.hash_scheme,
                adapter_id=args.adapter,
            )
        _print(result.to_dict())
        return 0
    if args.command == "state":
        try:
            with Observer(args.target) as observer:
                reply = observer.state(args.model, args.tenant)
        except grpc.RpcError as err:
            return _fail("GetCacheState", err)
        _print(json_format.MessageToDict(reply, preserving_proto_field_name=True))
        return 0
    if args.command == "report":
        try:
            with Producer(
                args.target,
                replica_id=args.replica,
                model_id=args.model,
                tenant_id=args.tenant,
                hash_scheme=args.hash_scheme,
                token=_read_token(args.token_file),
            ) as producer:
                ack = producer.report_token_chains([args.tokens], args.block_size, timeout=10.0)
        except grpc.RpcError as err:
            return _fail("ReportCacheState", err)
        _print(json_format.MessageToDict(ack, preserving_proto_field_name=True))
        return 0
    # snapshot
    request = urllib.request.Request(args.url.rstrip("/") + "/snapshot")
    token = _read_token(args.token_file)
    if token:
        request.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            body = response.read().decode("utf-8")
    except (urllib.error.URLError, OSError) as err:
        return _fail("GET /snapshot", err)
    try:
        _print(json.loads(body))
    except ValueError:
        sys.stdout.write(body)
    return 0
