"""Blocking clients on ``grpc``: :class:`Router` (gateways), :class:`Producer` (sidecars) and
:class:`Observer` (dashboards, tools).

Each owns one channel (or borrows one passed in) and is a context manager. ``Router.lookup``
never raises: every failure becomes a ``NO_HINT`` :class:`LookupResult` and is counted in
``Router.fail_open``. Producer and observer calls do raise ``grpc.RpcError``: a producer must
know that its report did not land.
"""

from __future__ import annotations

import queue
import threading
from typing import Iterable, Iterator, List, Optional, Sequence

import grpc

from inferencecache._common import (
    DEFAULT_TARGET,
    DEFAULT_TIMEOUT_S,
    FailOpenCounters,
    LookupResult,
    bearer_metadata,
    build_lookup_request,
    fail_open_result,
    is_deadline,
    result_from_response,
)
from inferencecache.fingerprint import DEFAULT_BLOCK_SIZE, chain
from inferencecache.v1alpha1 import inferencecache_pb2 as pb
from inferencecache.v1alpha1 import inferencecache_pb2_grpc as pb_grpc


def open_channel(target: str, credentials: Optional[grpc.ChannelCredentials] = None) -> grpc.Channel:
    """A channel to ``target`` (``host:port``): TLS when ``credentials`` is given."""
    if credentials is not None:
        return grpc.secure_channel(target, credentials)
    return grpc.insecure_channel(target)


class _Client:
    def __init__(
        self,
        target: str = DEFAULT_TARGET,
        *,
        channel: Optional[grpc.Channel] = None,
        credentials: Optional[grpc.ChannelCredentials] = None,
    ) -> None:
        self._owns_channel = channel is None
        self.channel = channel if channel is not None else open_channel(target, credentials)
        self.stub = pb_grpc.InferenceCacheStub(self.channel)

    def close(self) -> None:
        """Closes the channel if this client opened it."""
        if self._owns_channel:
            self.channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Router(_Client):
    """The gateway side: ``LookupRoute`` with a deadline, fail-open by construction.

    ``timeout`` (seconds) is the default deadline of each lookup. The server answers in
    microseconds; a lookup that does not arrive in time is a ``NO_HINT`` with
    ``fail_open_cause == "timeout"``, and the request is routed as if there were no index.
    """

    def __init__(
        self,
        target: str = DEFAULT_TARGET,
        *,
        timeout: float = DEFAULT_TIMEOUT_S,
        channel: Optional[grpc.Channel] = None,
        credentials: Optional[grpc.ChannelCredentials] = None,
    ) -> None:
        super().__init__(target, channel=channel, credentials=credentials)
        self.timeout = timeout
        self.fail_open = FailOpenCounters()
        """Client-side fail-opens by cause: ``transport_error``, ``timeout``,
        ``unknown_reason_code``."""

    def lookup(
        self,
        model_id: str,
        *,
        tenant_id: str = "",
        token_ids: Optional[Sequence[int]] = None,
        block_hashes: Optional[Sequence[bytes]] = None,
        block_token_counts: Optional[Sequence[int]] = None,
        prefix_hash: bytes = b"",
        prefix_token_count: int = 0,
        prompt_text: str = "",
        hash_scheme: str = "vllm",
        adapter_id: str = "",
        ttft_ms: int = 0,
        timeout: Optional[float] = None,
    ) -> LookupResult:
        """Asks which replicas hold the longest prefix of this request. Never raises.

        ``tenant_id`` partitions the index (and names the policy namespace): a lookup with an
        empty tenant never matches, so producers and routers must agree on a non-empty one.
        Give the prompt one way: ``token_ids`` (the server fingerprints them with its
        ``--engine-block-size``), ``block_hashes`` + ``block_token_counts`` (see
        :func:`inferencecache.chain`), ``prefix_hash`` + ``prefix_token_count`` (legacy exact
        key) or ``prompt_text`` (the server tokenizes it).
        """
        try:
            request = build_lookup_request(
                model_id,
                tenant_id=tenant_id,
                token_ids=token_ids,
                block_hashes=block_hashes,
                block_token_counts=block_token_counts,
                prefix_hash=prefix_hash,
                prefix_token_count=prefix_token_count,
                prompt_text=prompt_text,
                hash_scheme=hash_scheme,
                adapter_id=adapter_id,
                ttft_ms=ttft_ms,
            )
            response = self.stub.LookupRoute(
                request, timeout=self.timeout if timeout is None else timeout
            )
        except grpc.RpcError as err:
            cause = "timeout" if is_deadline(err.code()) else "transport_error"
            return fail_open_result(cause, f"{err.code()}: {err.details()}", self.fail_open)
        except Exception as err:  # fail-open by construction: nothing escapes a lookup
            return fail_open_result("transport_error", repr(err), self.fail_open)
        return result_from_response(response, self.fail_open)


class StateStream:
    """One open ``ReportCacheState`` stream fed from a queue.

    :meth:`send` enqueues an update (it never blocks on the network); :meth:`close` half-closes
    the stream and returns the server's ``Ack`` (or raises the stream's ``grpc.RpcError``).
    What the server received before a broken stream stays applied.
    """

    _END = object()

    def __init__(self, stub: pb_grpc.InferenceCacheStub, metadata, timeout: Optional[float]) -> None:
        self._queue: "queue.Queue[object]" = queue.Queue()
        self._future = stub.ReportCacheState.future(
            self._updates(), metadata=metadata, timeout=timeout
        )
        self._closed = False

    def _updates(self) -> Iterator[pb.CacheStateUpdate]:
        while True:
            item = self._queue.get()
            if item is StateStream._END:
                return
            yield item  # type: ignore[misc]

    def send(self, update: pb.CacheStateUpdate) -> None:
        """Queues one update on the stream."""
        if self._closed:
            raise RuntimeError("the stream is closed")
        self._queue.put(update)

    def close(self, timeout: Optional[float] = None) -> pb.Ack:
        """Ends the stream and waits for the server's ``Ack``."""
        if not self._closed:
            self._closed = True
            self._queue.put(StateStream._END)
        return self._future.result(timeout=timeout)

    def __enter__(self) -> "StateStream":
        return self

    def __exit__(self, exc_type, *rest) -> None:
        if exc_type is None:
            self.close()
        else:
            self._closed = True
            self._future.cancel()


class Producer(_Client):
    """The sidecar side for one replica: streams ``CacheStateUpdate`` s and publishes events.

    ``token`` is the producer bearer token (``--producer-token-file`` on the server).
    """

    def __init__(
        self,
        target: str = DEFAULT_TARGET,
        *,
        replica_id: str,
        model_id: str,
        tenant_id: str = "",
        hash_scheme: str = "vllm",
        token: Optional[str] = None,
        channel: Optional[grpc.Channel] = None,
        credentials: Optional[grpc.ChannelCredentials] = None,
    ) -> None:
        super().__init__(target, channel=channel, credentials=credentials)
        self.replica_id = replica_id
        self.model_id = model_id
        self.tenant_id = tenant_id
        self.hash_scheme = hash_scheme
        self._metadata = bearer_metadata(token)

    def update(
        self,
        prefixes: Iterable[pb.PrefixEntry] = (),
        *,
        stats: Optional[pb.ReplicaStats] = None,
        adapter_id: str = "",
        timestamp_us: int = 0,
    ) -> pb.CacheStateUpdate:
        """An update of this replica (``timestamp_us`` 0 = the server's receive time)."""
        message = pb.CacheStateUpdate(
            replica_id=self.replica_id,
            model_id=self.model_id,
            tenant_id=self.tenant_id,
            hash_scheme=self.hash_scheme,
            timestamp_us=timestamp_us,
            prefixes=list(prefixes),
            adapter_id=adapter_id,
        )
        if stats is not None:
            message.stats.CopyFrom(stats)
        return message

    @staticmethod
    def chain_entry(
        token_ids: Sequence[int],
        block_size: int = DEFAULT_BLOCK_SIZE,
        *,
        tier: int = pb.CACHE_TIER_T1,
        adapter_id: str = "",
    ) -> pb.PrefixEntry:
        """A holding of the full blocks of ``token_ids``, fingerprinted as the server does."""
        hashes, counts = chain(token_ids, block_size)
        return pb.PrefixEntry(
            block_hashes=hashes, block_token_counts=counts, tier=tier, adapter_id=adapter_id
        )

    def report(self, updates: Iterable[pb.CacheStateUpdate], *, timeout: Optional[float] = None) -> pb.Ack:
        """Sends ``updates`` on one ``ReportCacheState`` stream and returns the ``Ack``."""
        return self.stub.ReportCacheState(iter(updates), metadata=self._metadata, timeout=timeout)

    def report_token_chains(
        self,
        chains: Iterable[Sequence[int]],
        block_size: int = DEFAULT_BLOCK_SIZE,
        *,
        tier: int = pb.CACHE_TIER_T1,
        timeout: Optional[float] = None,
    ) -> pb.Ack:
        """Reports one update holding each token sequence's chain."""
        entries = [self.chain_entry(tokens, block_size, tier=tier) for tokens in chains]
        return self.report([self.update(entries)], timeout=timeout)

    def stream(self, *, timeout: Optional[float] = None) -> StateStream:
        """Opens a long-lived ``ReportCacheState`` stream (close it to get the ``Ack``)."""
        return StateStream(self.stub, self._metadata, timeout)

    def publish(self, event: pb.CacheEvent, *, timeout: Optional[float] = None) -> pb.Ack:
        """Publishes one event as is."""
        return self.stub.PublishEvent(event, metadata=self._metadata, timeout=timeout)

    def _event(self, kind: int, prefix_hash: bytes = b"", adapter_id: str = "") -> pb.CacheEvent:
        return pb.CacheEvent(
            type=kind,
            replica_id=self.replica_id,
            model_id=self.model_id,
            tenant_id=self.tenant_id,
            prefix_hash=prefix_hash,
            adapter_id=adapter_id,
        )

    def evict(self, prefix_hash: bytes, *, adapter_id: str = "", timeout: Optional[float] = None) -> pb.Ack:
        """``PREFIX_EVICTED``: this replica no longer holds ``prefix_hash`` (and what follows it)."""
        return self.publish(self._event(pb.CacheEvent.PREFIX_EVICTED, prefix_hash, adapter_id), timeout=timeout)

    def clear(self, *, timeout: Optional[float] = None) -> pb.Ack:
        """``ALL_CLEARED``: this replica holds nothing any more."""
        return self.publish(self._event(pb.CacheEvent.ALL_CLEARED), timeout=timeout)

    def heartbeat(self, *, timeout: Optional[float] = None) -> pb.Ack:
        """``REPLICA_UPDATED``: refreshes this replica's liveness."""
        return self.publish(self._event(pb.CacheEvent.REPLICA_UPDATED), timeout=timeout)


class Observer(_Client):
    """Read-only views: aggregated cache state and the change stream."""

    def state(self, model_id: str, tenant_id: str = "", *, timeout: Optional[float] = 5.0) -> pb.GetCacheStateResponse:
        """``GetCacheState`` of one ``(tenant, model)``."""
        return self.stub.GetCacheState(
            pb.GetCacheStateRequest(model_id=model_id, tenant_id=tenant_id), timeout=timeout
        )

    def events(
        self, model_id: str = "", tenant_id: str = "", types: Sequence[int] = ()
    ) -> Iterator[pb.CacheEvent]:
        """``StreamCacheEvents``: an iterator of applied changes (``cancel()`` it to stop)."""
        return self.stub.StreamCacheEvents(
            pb.StreamEventsRequest(model_id=model_id, tenant_id=tenant_id, types=list(types))
        )

    def metrics(self, names: Sequence[str] = ()) -> Iterator[pb.Metric]:
        """``StreamMetrics``: metric samples about once a second."""
        return self.stub.StreamMetrics(pb.StreamMetricsRequest(names=list(names)))


__all__: List[str] = ["Router", "Producer", "Observer", "StateStream", "open_channel"]
