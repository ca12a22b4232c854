"""The asyncio clients on ``grpc.aio``: the same behaviour and methods as
:mod:`inferencecache.client` (``tests/test_aio.py`` holds the two to the same public names).

``await Router.lookup(...)`` never raises (cancellation of the awaiting task excepted, which
is the caller's own decision); producer and observer calls raise ``grpc.RpcError``.
"""

from __future__ import annotations

import asyncio
from typing import AsyncIterator, Dict, Iterable, Optional, Sequence, Tuple, Union

import grpc
import grpc.aio

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
from inferencecache.client import Producer as _BlockingProducer
from inferencecache.client import build_pd_request, build_render_request
from inferencecache.fingerprint import DEFAULT_BLOCK_SIZE
from inferencecache.v1alpha1 import inferencecache_pb2 as pb
from inferencecache.v1alpha1 import inferencecache_pb2_grpc as pb_grpc


def open_channel(
    target: str,
    credentials: Optional[grpc.ChannelCredentials] = None,
    options: Optional[Sequence[Tuple[str, object]]] = None,
) -> grpc.aio.Channel:
    """An asyncio channel to ``target`` with the same options as
    :func:`inferencecache.open_channel` (bounded reconnect backoff, keepalive, ``round_robin``)."""
    merged = channel_options(options)
    if credentials is not None:
        return grpc.aio.secure_channel(target, credentials, options=merged)
    return grpc.aio.insecure_channel(target, options=merged)


class _Client:
    def __init__(
        self,
        target: str = DEFAULT_TARGET,
        *,
        channel: Optional[grpc.aio.Channel] = None,
        credentials: Optional[grpc.ChannelCredentials] = None,
        options: Optional[Sequence[Tuple[str, object]]] = None,
    ) -> None:
        self._owns_channel = channel is None
        self.channel = channel if channel is not None else open_channel(target, credentials, options)
        self.stub = pb_grpc.InferenceCacheStub(self.channel)

    async def close(self) -> None:
        """Closes the channel if this client opened it."""
        if self._owns_channel:
            await self.channel.close()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()


def _status_cause(err: Exception) -> Tuple[str, str]:
    code = err.code() if hasattr(err, "code") else None
    details = err.details() if hasattr(err, "details") else ""
    return cause_of_status(code), f"{code}: {details}"


class Router(_Client):
    """Asyncio ``LookupRoute`` with a deadline, fail-open by construction (see
    :class:`inferencecache.Router`)."""

    def __init__(
        self,
        target: str = DEFAULT_TARGET,
        *,
        timeout: float = DEFAULT_TIMEOUT_S,
        channel: Optional[grpc.aio.Channel] = None,
        credentials: Optional[grpc.ChannelCredentials] = None,
        options: Optional[Sequence[Tuple[str, object]]] = None,
    ) -> None:
        super().__init__(target, channel=channel, credentials=credentials, options=options)
        self.timeout = timeout
        self.fail_open = FailOpenCounters()

    async def lookup(
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
        """Asks which replicas hold the longest prefix of this request. Never raises."""
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
            response = await self.stub.LookupRoute(
                request, timeout=self.timeout if timeout is None else timeout
            )
        except grpc.RpcError as err:
            cause, detail = _status_cause(err)
            return fail_open_result(cause, detail, self.fail_open)
        except (ValueError, TypeError) as err:  # a value the wire cannot carry: the caller's bug
            return fail_open_result("invalid_request", repr(err), self.fail_open)
        except asyncio.CancelledError:
            raise
        except Exception as err:  # fail-open by construction: nothing escapes a lookup
            return fail_open_result("transport_error", repr(err), self.fail_open)
        return result_from_response(response, self.fail_open)

    async def lookup_pd_route(
        self,
        model_id: str,
        *,
        tenant_id: str,
        prefix_hash: bytes = b"",
        prefix_token_count: int = 0,
        pd_topology_ref: str = "",
        timeout: Optional[float] = None,
    ) -> pb.LookupPDRouteResponse:
        """``LookupPDRoute``; never raises (see :meth:`inferencecache.Router.lookup_pd_route`)."""
        try:
            request = build_pd_request(model_id, tenant_id, prefix_hash, prefix_token_count, pd_topology_ref)
            return await self.stub.LookupPDRoute(request, timeout=self.timeout if timeout is None else timeout)
        except grpc.RpcError as err:
            self.fail_open.add(_status_cause(err)[0])
        except (ValueError, TypeError):
            self.fail_open.add("invalid_request")
        except asyncio.CancelledError:
            raise
        except Exception:
            self.fail_open.add("transport_error")
        return pb.LookupPDRouteResponse(reason_code=NO_HINT)

    async def render_template(
        self,
        template_ref: str,
        *,
        tenant_id: str,
        variables: Optional[Dict[str, str]] = None,
        timeout: Optional[float] = None,
    ) -> pb.RenderTemplateResponse:
        """``RenderTemplate``; never raises (see :meth:`inferencecache.Router.render_template`)."""
        try:
            request = build_render_request(template_ref, tenant_id, variables)
            return await self.stub.RenderTemplate(request, timeout=self.timeout if timeout is None else timeout)
        except grpc.RpcError as err:
            self.fail_open.add(_status_cause(err)[0])
        except (ValueError, TypeError):
            self.fail_open.add("invalid_request")
        except asyncio.CancelledError:
            raise
        except Exception:
            self.fail_open.add("transport_error")
        return pb.RenderTemplateResponse(reason_code="OK")


class StateStream:
    """One open asyncio ``ReportCacheState`` stream (see :class:`inferencecache.StateStream`):
    ``await send(update)``, then ``await close()`` for the ``Ack``."""

    def __init__(self, stub: pb_grpc.InferenceCacheStub, metadata, timeout: Optional[float]) -> None:
        self._call = stub.ReportCacheState(metadata=metadata, timeout=timeout)
        self._closed = False

    async def send(self, update: pb.CacheStateUpdate) -> None:
        """Writes one update on the stream."""
        if self._closed:
            raise RuntimeError("the stream is closed")
        await self._call.write(update)

    async def close(self) -> pb.Ack:
        """Ends the stream and waits for the server's ``Ack``."""
        if not self._closed:
            self._closed = True
            await self._call.done_writing()
        return await self._call

    async def __aenter__(self) -> "StateStream":
        return self

    async def __aexit__(self, exc_type, *rest) -> None:
        if exc_type is None:
            await self.close()
        else:
            self._closed = True
            self._call.cancel()


class Producer(_Client):
    """Asyncio producer for one replica (see :class:`inferencecache.Producer`)."""

    def __init__(
        self,
        target: str = DEFAULT_TARGET,
        *,
        replica_id: str,
        model_id: str,
        tenant_id: str,
        hash_scheme: str = "vllm",
        token: Optional[str] = None,
        channel: Optional[grpc.aio.Channel] = None,
        credentials: Optional[grpc.ChannelCredentials] = None,
        options: Optional[Sequence[Tuple[str, object]]] = None,
    ) -> None:
        self.tenant_id = require_tenant(tenant_id)
        super().__init__(target, channel=channel, credentials=credentials, options=options)
        self.replica_id = replica_id
        self.model_id = model_id
        self.hash_scheme = hash_scheme
        self._metadata = bearer_metadata(token)

    chain_entry = staticmethod(_BlockingProducer.chain_entry)
    update = _BlockingProducer.update
    _event = _BlockingProducer._event

    async def report(
        self,
        updates: Union[Iterable[pb.CacheStateUpdate], AsyncIterator[pb.CacheStateUpdate]],
        *,
        timeout: Optional[float] = None,
    ) -> pb.Ack:
        """Streams ``updates`` (a plain or an async iterable) on one ``ReportCacheState``
        call and returns the ``Ack``."""
        return await self.stub.ReportCacheState(
            iter(updates) if not hasattr(updates, "__aiter__") else updates,  # type: ignore[arg-type]
            metadata=self._metadata,
            timeout=timeout,
        )

    async def report_token_chains(
        self,
        chains: Iterable[Sequence[int]],
        block_size: int = DEFAULT_BLOCK_SIZE,
        *,
        tier: int = pb.CACHE_TIER_T1,
        timeout: Optional[float] = None,
    ) -> pb.Ack:
        """Reports one update holding each token sequence's chain."""
        entries = [self.chain_entry(tokens, block_size, tier=tier) for tokens in chains]
        return await self.report([self.update(entries)], timeout=timeout)

    def stream(self, *, timeout: Optional[float] = None) -> StateStream:
        """Opens a long-lived ``ReportCacheState`` stream (``await close()`` for the ``Ack``)."""
        return StateStream(self.stub, self._metadata, timeout)

    async def publish(self, event: pb.CacheEvent, *, timeout: Optional[float] = None) -> pb.Ack:
        """Publishes one event as is."""
        return await self.stub.PublishEvent(event, metadata=self._metadata, timeout=timeout)

    async def evict(self, prefix_hash: bytes, *, adapter_id: str = "", timeout: Optional[float] = None) -> pb.Ack:
        """``PREFIX_EVICTED`` for ``prefix_hash`` on this replica."""
        return await self.publish(self._event(pb.CacheEvent.PREFIX_EVICTED, prefix_hash, adapter_id), timeout=timeout)

    async def clear(self, *, timeout: Optional[float] = None) -> pb.Ack:
        """``ALL_CLEARED`` for this replica."""
        return await self.publish(self._event(pb.CacheEvent.ALL_CLEARED), timeout=timeout)

    async def heartbeat(self, *, timeout: Optional[float] = None) -> pb.Ack:
        """``REPLICA_UPDATED``: refreshes this replica's liveness."""
        return await self.publish(self._event(pb.CacheEvent.REPLICA_UPDATED), timeout=timeout)


class Observer(_Client):
    """Asyncio read-only views."""

    async def state(self, model_id: str, tenant_id: str = "", *, timeout: Optional[float] = 5.0) -> pb.GetCacheStateResponse:
        """``GetCacheState`` of one ``(tenant, model)``."""
        return await self.stub.GetCacheState(
            pb.GetCacheStateRequest(model_id=model_id, tenant_id=tenant_id), timeout=timeout
        )

    def events(self, model_id: str = "", tenant_id: str = "", types: Sequence[int] = ()):
        """``StreamCacheEvents`` as an async iterator of events."""
        return self.stub.StreamCacheEvents(
            pb.StreamEventsRequest(model_id=model_id, tenant_id=tenant_id, types=list(types))
        )

    def metrics(self, names: Sequence[str] = ()):
        """``StreamMetrics`` as an async iterator of metric samples (about once a second)."""
        return self.stub.StreamMetrics(pb.StreamMetricsRequest(names=list(names)))


__all__ = ["Router", "Producer", "Observer", "StateStream", "open_channel"]
