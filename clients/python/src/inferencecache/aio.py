"""The asyncio clients on ``grpc.aio``: same behaviour as :mod:`inferencecache.client`.

``await Router.lookup(...)`` never raises (cancellation of the awaiting task excepted, which
is the caller's own decision); producer and observer calls raise ``grpc.RpcError``.
"""

from __future__ import annotations

from typing import AsyncIterator, Iterable, Optional, Sequence, Union

import grpc
import grpc.aio

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
from inferencecache.client import Producer as _BlockingProducer
from inferencecache.v1alpha1 import inferencecache_pb2 as pb
from inferencecache.v1alpha1 import inferencecache_pb2_grpc as pb_grpc


def open_channel(target: str, credentials: Optional[grpc.ChannelCredentials] = None) -> grpc.aio.Channel:
    """An asyncio channel to ``target``: TLS when ``credentials`` is given."""
    if credentials is not None:
        return grpc.aio.secure_channel(target, credentials)
    return grpc.aio.insecure_channel(target)


class _Client:
    def __init__(
        self,
        target: str = DEFAULT_TARGET,
        *,
        channel: Optional[grpc.aio.Channel] = None,
        credentials: Optional[grpc.ChannelCredentials] = None,
    ) -> None:
        self._owns_channel = channel is None
        self.channel = channel if channel is not None else open_channel(target, credentials)
        self.stub = pb_grpc.InferenceCacheStub(self.channel)

    async def close(self) -> None:
        """Closes the channel if this client opened it."""
        if self._owns_channel:
            await self.channel.close()

    async def __aenter__(self):
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()


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
    ) -> None:
        super().__init__(target, channel=channel, credentials=credentials)
        self.timeout = timeout
        self.fail_open = FailOpenCounters()

    async def lookup(
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
            code = err.code() if hasattr(err, "code") else None
            cause = "timeout" if is_deadline(code) else "transport_error"
            details = err.details() if hasattr(err, "details") else ""
            return fail_open_result(cause, f"{code}: {details}", self.fail_open)
        except Exception as err:  # fail-open by construction: nothing escapes a lookup
            return fail_open_result("transport_error", repr(err), self.fail_open)
        return result_from_response(response, self.fail_open)


class Producer(_Client):
    """Asyncio producer for one replica (see :class:`inferencecache.Producer`)."""

    def __init__(
        self,
        target: str = DEFAULT_TARGET,
        *,
        replica_id: str,
        model_id: str,
        tenant_id: str = "",
        hash_scheme: str = "vllm",
        token: Optional[str] = None,
        channel: Optional[grpc.aio.Channel] = None,
        credentials: Optional[grpc.ChannelCredentials] = None,
    ) -> None:
        super().__init__(target, channel=channel, credentials=credentials)
        self.replica_id = replica_id
        self.model_id = model_id
        self.tenant_id = tenant_id
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

    async def publish(self, event: pb.CacheEvent, *, timeout: Optional[float] = None) -> pb.Ack:
        """Publishes one event as is."""
        return await self.stub.PublishEvent(event, metadata=self._metadata, timeout=timeout)

    async def evict(self, prefix_hash: bytes, *, adapter_id: str = "", timeout: Optional[float] = None) -> pb.Ack:
        """``PREFIX_EVICTED`` for ``prefix_hash`` on this replica."""
        return await self.publish(self._event(pb.CacheEvent.PREFIX_EVICTED, prefix_hash, adapter_id), timeout=timeout)

    async def clear(self, *, timeout: Optional[float] = None) -> pb.Ack:
        """``ALL_CLEARED`` for this replica."""
        return await self.publish(self._event(pb.CacheEvent.ALL_CLEARED), timeout=timeout)


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


__all__ = ["Router", "Producer", "Observer", "open_channel"]
