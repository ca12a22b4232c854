"""Pieces shared by the blocking and the asyncio clients: results, request building, counting.

Fail-open is decided here, once: :func:`result_from_response` turns any reason code this
client does not know into ``NO_HINT`` (the contract's open vocabulary), and
:func:`fail_open_result` is the only way an error becomes a result. Neither can raise.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Dict, List, Optional, Sequence, Tuple

from inferencecache.v1alpha1 import inferencecache_pb2 as pb

KNOWN_REASON_CODES = frozenset(
    {
        "PREFIX_MATCH",
        "TENANT_HOT",
        "AFFINITY_HINT",
        "NO_HINT",
        "POLICY_REQUIRES_CHAIN",
        "TIMEOUT",
        "UNKNOWN_TENANT",
        "UNKNOWN_MODEL",
        "UNKNOWN_HASH_SCHEME",
    }
)
"""Reason codes ``LookupRoute`` emits today (``docs/grpc-contract.md``)."""

NO_HINT = "NO_HINT"

DEFAULT_TARGET = "127.0.0.1:9090"
DEFAULT_TIMEOUT_S = 0.05
"""Default lookup deadline: 50 ms, far above the server's microsecond answers and far below a
request's routing budget."""

FAIL_OPEN_CAUSES = ("transport_error", "timeout", "unknown_reason_code", "invalid_request")
"""Why a client-side ``NO_HINT``: the server was unreachable or failed (``transport_error``),
the deadline passed (``timeout``), the server sent a code this client does not know
(``unknown_reason_code``), or the request itself was wrong (``invalid_request``: a value the
wire cannot carry, such as a negative token id, or the server's ``INVALID_ARGUMENT``) — a
caller's bug, never a network fault."""

RECONNECT_BACKOFF_INITIAL_MS = 100
RECONNECT_BACKOFF_MAX_MS = 1000
"""Reconnect backoff bounds. gRPC's default grows to 120 s, so after an outage lookups kept
failing open long after the server was back; capped at 1 s a channel reconnects within about
a second of the server's return (``tests/test_client.py`` measures it)."""

KEEPALIVE_TIME_MS = 20_000
KEEPALIVE_TIMEOUT_MS = 5_000
"""HTTP/2 keepalive on active connections: a peer that vanished without a FIN (a node lost,
a NAT entry expired) is detected in about 25 s instead of at the next TCP timeout."""

SERVICE_CONFIG_ROUND_ROBIN = '{"loadBalancingConfig": [{"round_robin": {}}]}'
"""Spreads calls over every address the name resolves to. With a ``dns:///`` target naming a
headless Kubernetes Service (one A record per pod) every server pod gets lookups; through a
ClusterIP Service one channel holds one connection to one pod, whatever the policy."""


def channel_options(extra: Optional[Sequence[Tuple[str, object]]] = None) -> List[Tuple[str, object]]:
    """The channel options every client opens its channel with (``extra`` wins)."""
    options: Dict[str, object] = {
        "grpc.initial_reconnect_backoff_ms": RECONNECT_BACKOFF_INITIAL_MS,
        "grpc.min_reconnect_backoff_ms": RECONNECT_BACKOFF_INITIAL_MS,
        "grpc.max_reconnect_backoff_ms": RECONNECT_BACKOFF_MAX_MS,
        "grpc.keepalive_time_ms": KEEPALIVE_TIME_MS,
        "grpc.keepalive_timeout_ms": KEEPALIVE_TIMEOUT_MS,
        # Pings only while calls are active (servers may refuse idle pings as abuse).
        "grpc.keepalive_permit_without_calls": 0,
        "grpc.service_config": SERVICE_CONFIG_ROUND_ROBIN,
    }
    for key, value in extra or ():
        options[key] = value
    return list(options.items())


class InvalidRequest(ValueError):
    """A request this client refuses to send (e.g. an empty ``tenant_id`` for a producer)."""


@dataclasses.dataclass(frozen=True)
class ReplicaScore:
    """One ranked replica of a lookup answer (best first)."""

    replica_id: str
    score: float
    matched_tokens: int
    estimated_cache_hit_prob: float
    tier: int
    """``CacheTier`` value: 1 = engine KV cache, 2 = host offload, 3 = remote; 0 = unknown."""


@dataclasses.dataclass(frozen=True)
class LookupResult:
    """A routing hint. ``replica_scores`` may be empty; that is always a valid answer."""

    reason_code: str
    replica_scores: Tuple[ReplicaScore, ...] = ()
    lookup_latency_us: int = 0
    token_ids: Tuple[int, ...] = ()
    adapter_id: str = ""
    fail_open_cause: Optional[str] = None
    """Why this client made the answer ``NO_HINT`` itself (one of :data:`FAIL_OPEN_CAUSES`),
    or ``None`` when it is the server's own answer."""
    server_reason_code: str = ""
    """The code the server sent (differs from ``reason_code`` for an unknown code)."""
    detail: str = ""
    """The error text behind a client-side fail-open."""

    @property
    def best_replica(self) -> Optional[str]:
        """The first-ranked replica, or ``None`` to route as if there were no index."""
        return self.replica_scores[0].replica_id if self.replica_scores else None

    @property
    def hit(self) -> bool:
        """True for a ``PREFIX_MATCH`` with at least one replica."""
        return self.reason_code == "PREFIX_MATCH" and bool(self.replica_scores)

    def to_dict(self) -> Dict[str, object]:
        """A JSON-friendly view (used by the command line)."""
        return dataclasses.asdict(self)


class FailOpenCounters:
    """Thread-safe counts of client-side fail-opens, by cause."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts = {cause: 0 for cause in FAIL_OPEN_CAUSES}

    def add(self, cause: str) -> None:
        with self._lock:
            self._counts[cause] = self._counts.get(cause, 0) + 1

    def snapshot(self) -> Dict[str, int]:
        """A copy of the counts (every cause present, zero included)."""
        with self._lock:
            return dict(self._counts)

    @property
    def total(self) -> int:
        with self._lock:
            return sum(self._counts.values())


def require_tenant(tenant_id: str) -> str:
    """``tenant_id`` if non-empty: an empty tenant is never matched by any lookup."""
    if not isinstance(tenant_id, str) or not tenant_id:
        raise InvalidRequest("tenant_id must be a non-empty string: the index never matches an empty tenant")
    return tenant_id


def build_lookup_request(
    model_id: str,
    *,
    tenant_id: str,
    token_ids: Optional[Sequence[int]] = None,
    block_hashes: Optional[Sequence[bytes]] = None,
    block_token_counts: Optional[Sequence[int]] = None,
    prefix_hash: bytes = b"",
    prefix_token_count: int = 0,
    prompt_text: str = "",
    hash_scheme: str = "vllm",
    adapter_id: str = "",
    ttft_ms: int = 0,
) -> pb.LookupRouteRequest:
    """Builds a ``LookupRouteRequest``; raises ``ValueError`` (or ``TypeError``) for values
    protobuf cannot hold and :class:`InvalidRequest` for an empty tenant (callers turn both
    into an ``invalid_request`` fail-open result)."""
    require_tenant(tenant_id)
    request = pb.LookupRouteRequest(
        model_id=model_id,
        tenant_id=tenant_id,
        prefix_hash=prefix_hash,
        prefix_token_count=prefix_token_count,
        hash_scheme=hash_scheme,
        prompt_text=prompt_text,
        adapter_id=adapter_id,
    )
    if token_ids is not None:
        request.token_ids.extend(token_ids)
    if block_hashes is not None:
        request.block_hashes.extend(block_hashes)
    if block_token_counts is not None:
        request.block_token_counts.extend(block_token_counts)
    if ttft_ms:
        request.slo.ttft_ms = ttft_ms
    return request


def result_from_response(response: pb.LookupRouteResponse, counters: FailOpenCounters) -> LookupResult:
    """The server's answer as a result; an unknown reason code becomes ``NO_HINT`` (counted)."""
    code = response.reason_code
    if code not in KNOWN_REASON_CODES:
        counters.add("unknown_reason_code")
        return LookupResult(
            reason_code=NO_HINT,
            lookup_latency_us=response.lookup_latency_us,
            fail_open_cause="unknown_reason_code",
            server_reason_code=code,
            detail=f"unknown reason code {code!r}",
        )
    return LookupResult(
        reason_code=code,
        replica_scores=tuple(
            ReplicaScore(
                replica_id=s.replica_id,
                score=s.score,
                matched_tokens=s.matched_tokens,
                estimated_cache_hit_prob=s.estimated_cache_hit_prob,
                tier=int(s.tier),
            )
            for s in response.replica_scores
        ),
        lookup_latency_us=response.lookup_latency_us,
        token_ids=tuple(response.token_ids),
        adapter_id=response.adapter_id,
        server_reason_code=code,
    )


def fail_open_result(cause: str, detail: str, counters: FailOpenCounters) -> LookupResult:
    """A ``NO_HINT`` result standing for an error this client absorbed (counted)."""
    counters.add(cause)
    return LookupResult(reason_code=NO_HINT, fail_open_cause=cause, detail=detail)


def cause_of_status(code: object) -> str:
    """The fail-open cause of a failed call's gRPC status."""
    import grpc

    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return "timeout"
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return "invalid_request"
    return "transport_error"


def is_deadline(code: object) -> bool:
    """True for the gRPC status of an expired deadline."""
    import grpc

    return code == grpc.StatusCode.DEADLINE_EXCEEDED


def bearer_metadata(token: Optional[str]) -> List[Tuple[str, str]]:
    """Call metadata carrying a producer token, if any."""
    return [("authorization", f"Bearer {token}")] if token else []
