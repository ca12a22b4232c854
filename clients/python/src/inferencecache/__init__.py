"""Python client for InferenceCache, the cache-aware routing index for LLM serving fleets.

- :class:`Router` — ``LookupRoute`` (and ``LookupPDRoute``, ``RenderTemplate``) for gateways,
  with a deadline, fail-open by construction.
- :class:`Producer` — ``ReportCacheState`` streams and ``PublishEvent`` for engine sidecars.
- :class:`Observer` — ``GetCacheState``, ``StreamCacheEvents``, ``StreamMetrics``.
- :func:`fingerprint` / :func:`chain` — the server's block hashes, computed locally.
- :mod:`inferencecache.aio` — the same clients on ``grpc.aio``.
- :mod:`inferencecache.v1alpha1` — the stubs generated from the wire contract at build time.

Command line: ``python -m inferencecache lookup|state|snapshot --help``.
"""

from inferencecache._common import (
    FAIL_OPEN_CAUSES,
    KNOWN_REASON_CODES,
    InvalidRequest,
    LookupResult,
    ReplicaScore,
    channel_options,
)
from inferencecache.client import Observer, Producer, Router, StateStream, open_channel
from inferencecache.fingerprint import (
    DEFAULT_BLOCK_SIZE,
    SEED,
    chain,
    content_hash,
    fingerprint,
    next_prefix,
    prefix_hashes,
)
from inferencecache.v1alpha1 import inferencecache_pb2 as pb

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_BLOCK_SIZE",
    "FAIL_OPEN_CAUSES",
    "InvalidRequest",
    "KNOWN_REASON_CODES",
    "LookupResult",
    "Observer",
    "Producer",
    "ReplicaScore",
    "Router",
    "SEED",
    "StateStream",
    "chain",
    "channel_options",
    "content_hash",
    "fingerprint",
    "next_prefix",
    "open_channel",
    "pb",
    "prefix_hashes",
]
