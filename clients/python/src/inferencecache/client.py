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
from typing import Dict, Iterable, Iterator, List, Optional, Sequence, Tuple

import grpc

from inferencecache._common import (
    DEFAULT_TARGET,
    DEFAULT_TIMEOUT_S,
    NO_HINT,
    FailOpenCounters,
    LookupResult,
    bearer_metadata,
    build_lookup_request,
    cause_of_status,
    channel_options,
    fail_open_result,
    require_tenant,
    result_from_response,
)
from inferencecache.fingerprint import DEFAULT_BLOCK_SIZE, chain
from inferencecache.v1alpha1 import inferencecache_pb2 as pb
from inferencecache.v1alpha1 import inferencecache_pb2_grpc as pb_grpc


def open_channel(
    target: str,
    credentials: Optional[grpc.ChannelCredentials] = None,
    options: Optional[Sequence[Tuple[str, object]]] = None,
) -> grpc.Channel:
    """A channel to ``target``: TLS when ``credentials`` is given, with
    :func:`inferencecache._common.channel_options` (bounded reconnect backoff, keepalive,
    ``round_robin``; ``options`` override them). ``target`` is ``host:port`` or a gRPC URI;
    behind a Kubernetes Service use ``dns:///<headless-service>.<namespace>.svc:9090`` so that
    ``round_robin`` reaches every pod."""
    merged = channel_options(options)
    if credentials is not None:
        return grpc.secure_channel(target, credentials, options=merged)
    return grpc.insecure_channel(target, options=merged)


class _Client:
    def __init__(
        self,
        target: str = DEFAULT_TARGET,
        *,
        channel: Optional[grpc.Channel] = None,
        credentials: Optional[grpc.ChannelCredentials] = None,
        options: Optional[Sequence[Tuple[str, object]]] = None,
    ) -> None:
        self._owns_channel = channel is None
        self.channel = channel if channel is not None else open_channel(target, credentials, options)
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
        options: Optional[Sequence[Tuple[str, object]]] = None,
    ) -> None:
        super().__init__(target, channel=channel, credentials=credentials, options=options)
        self.timeout = timeout
        self.fail_open = FailOpenCounters()
        """Client-side fail-opens by cause: ``transport_error``, ``timeout``,
        ``unknown_reason_code``, ``invalid_request``."""

    def lookup(
        self,
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
        timeout: Optional[float] = None,
    ) -> LookupResult:
        """Asks which replicas hold the longest prefix of this request. Never raises.

        ``tenant_id`` partitions the index (and names the policy namespace): it is required, and
        an empty one is an ``invalid_request`` (it could never match).
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
            return fail_open_result(cause_of_status(err.code()), f"{err.code()}: {err.details()}", self.fail_open)
        except (ValueError, TypeError) as err:  # a value the wire cannot carry: the caller's bug
            return fail_open_result("invalid_request", repr(err), self.fail_open)
        except Exception as err:  # fail-open by construction: nothing escapes a lookup
            return fail_open_result("transport_error", repr(err), self.fail_open)
        return result_from_response(response, self.fail_open)

    def lookup_pd_route(
        self,
        model_id: str,
        *,
        tenant_id: str,
        prefix_hash: bytes = b"",
        prefix_token_count: int = 0,
        pd_topology_ref: str = "",
        timeout: Optional[float] = None,
    ) -> pb.LookupPDRouteResponse:
        """``LookupPDRoute`` (prefill/decode pair). Never raises: a failure is a response with
        ``reason_code`` ``NO_HINT`` and no replicas (counted in :attr:`fail_open`). The server
        answers ``NO_HINT`` today (a stub, ``docs/grpc-contract.md``)."""
        try:
            request = build_pd_request(model_id, tenant_id, prefix_hash, prefix_token_count, pd_topology_ref)
            return self.stub.LookupPDRoute(request, timeout=self.timeout if timeout is None else timeout)
        except grpc.RpcError as err:
            self.fail_open.add(cause_of_status(err.code()))
        except (ValueError, TypeError):
            self.fail_open.add("invalid_request")
        except Exception:
            self.fail_open.add("transport_error")
        return pb.LookupPDRouteResponse(reason_code=NO_HINT)

    def render_template(
        self,
        template_ref: str,
        *,
        tenant_id: str,
        variables: Optional[Dict[str, str]] = None,
        timeout: Optional[float] = None,
    ) -> pb.RenderTemplateResponse:
        """``RenderTemplate``. Never raises: a failure is an empty ``OK`` response (an empty
        ``stable_prefix_hash`` means "hash the raw prompt yourself"), counted in
        :attr:`fail_open`. The server answers that empty response today (a stub)."""
        try:
            request = build_render_request(template_ref, tenant_id, variables)
            return self.stub.RenderTemplate(request, timeout=self.timeout if timeout is None else timeout)
        except grpc.RpcError as err:
            self.fail_open.add(cause_of_status(err.code()))
        except (ValueError, TypeError):
            self.fail_open.add("invalid_request")
        except Exception:
            self.fail_open.add("transport_error")
        return pb.RenderTemplateResponse(reason_code="OK")


def build_pd_request(
    model_id: str, tenant_id: str, prefix_hash: bytes, prefix_token_count: int, pd_topology_ref: str
) -> pb.LookupPDRouteRequest:
    """A ``LookupPDRouteRequest`` (raises ``ValueError``/``TypeError`` for an invalid one)."""
    return pb.LookupPDRouteRequest(
        model_id=model_id,
        tenant_id=require_tenant(tenant_id),
        prefix_hash=prefix_hash,
        prefix_token_count=prefix_token_count,
        pd_topology_ref=pd_topology_ref,
    )


def build_render_request(
    template_ref: str, tenant_id: str, variables: Optional[Dict[str, str]]
) -> pb.RenderTemplateRequest:
    """A ``RenderTemplateRequest`` (raises ``ValueError``/``TypeError`` for an invalid one)."""
    return pb.RenderTemplateRequest(
        template_ref=template_ref, tenant_id=require_tenant(tenant_id), variables=dict(variables or {})
    )


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
    ``tenant_id`` is required and non-empty (:class:`inferencecache.InvalidRequest`
    otherwise): what a producer reports under the empty tenant no lookup can ever find.
    """

    def __init__(
        self,
        target: str = DEFAULT_TARGET,
        *,
        replica_id: str,
        model_id: str,
        tenant_id: str,
        hash_scheme: str = "vllm",
        token: Optional[str] = None,
        channel: Optional[grpc.Channel] = None,
        credentials: Optional[grpc.ChannelCredentials] = None,
        options: Optional[Sequence[Tuple[str, object]]] = None,
    ) -> None:
        # Before the channel opens: a refused configuration leaves nothing to close.
        self.tenant_id = require_tenant(tenant_id)
        super().__init__(target, channel=channel, credentials=credentials, options=options)
        self.replica_id = replica_id
        self.model_id = model_id
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
