"""Python client for application backends: sync and asyncio, streaming or not.

    from tandem.client import TandemClient
    with TandemClient("127.0.0.1:50051") as client:
        for chunk in client.stream("Hello", max_tokens=32, temperature=0.7):
            print(chunk.text, end="", flush=True)
        result = client.generate(messages=[{"role": "user", "content": "Hi"}], max_tokens=16)

Sampling keyword arguments are the fields of `tandem.engine.sampling.SamplingParams`.
Failures raise `TandemError` carrying the gRPC status code, the server's message and its
pushback hint (`retry_after_s`). Retrying is opt-in:

    TandemClient(address, retry=Retry(max_attempts=4))

retries a call that failed with UNAVAILABLE or RESOURCE_EXHAUSTED, waiting with exponential
backoff (or as long as the server asked, when that is longer). A stream is retried only while
none of its chunks has reached the caller, so a caller never sees a token twice: a stream that
fails after its first chunk raises, however it is configured.

A router with API keys wants one: `TandemClient(address, api_key=...)` (default: the
TANDEM_API_KEY environment variable) sends it as `authorization: Bearer <key>`; `tls=True`
(the system's CAs) or `tls="ca.pem"` connects over TLS.

Here are the channels and the two retry loops; what they share and no I/O lives beside:
the retry policy in tandem.client_retry, request building and response conversion in
tandem.client_convert (their public names are importable from here too).
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

import grpc

from tandem.client_convert import (
    CONSTRAINT_KINDS,
    RETRY_AFTER_KEY,
    Chunk,
    Result,
    apply_response,
    build_request,
    chat_message,
    retry_after,
    status_error,
)
from tandem.client_retry import Attempts, Retry, TandemError
from tandem.v1 import router_pb2 as rpb
from tandem.v1 import router_pb2_grpc as rgrpc

__all__ = [
    "CONSTRAINT_KINDS",
    "RETRY_AFTER_KEY",
    "AsyncTandemClient",
    "Chunk",
    "Result",
    "Retry",
    "TandemClient",
    "TandemError",
    "build_request",
    "chat_message",
    "retry_after",
]

T = TypeVar("T")


def _channel_credentials(tls: bool | str) -> grpc.ChannelCredentials | None:
    """None: plaintext. True: TLS against the system's CAs; a path: against that CA file."""
    if tls is False:
        return None
    roots = Path(tls).read_bytes() if isinstance(tls, str) else None
    return grpc.ssl_channel_credentials(root_certificates=roots)


def _auth_metadata(api_key: str | None) -> tuple[tuple[str, str], ...] | None:
    key = api_key if api_key is not None else os.environ.get("TANDEM_API_KEY", "")
    return (("authorization", f"Bearer {key}"),) if key else None


class _Attempt:
    """One attempt of a call, as a context manager: a failure inside (a gRPC error, or an
    in-stream error the call ends with) is kept in `error` rather than raised; `delivered`
    says whether a chunk reached the caller; the call, if given, is cancelled on exit however
    the attempt ends (a no-op once the call ended; frees it when the caller stops
    iterating)."""

    def __init__(self, call: Any = None) -> None:
        self.call = call
        self.error: TandemError | None = None
        self.delivered = False

    def __enter__(self) -> _Attempt:
        return self

    def __exit__(self, kind: object, exc: BaseException | None, tb: object) -> bool:
        if self.call is not None:
            self.call.cancel()
        if isinstance(exc, grpc.RpcError):
            self.error = status_error(exc)
        elif isinstance(exc, TandemError):
            self.error = exc
        return self.error is not None

    def deliver(self, chunk: Chunk | None) -> tuple[Chunk, ...]:
        """What of a response reaches the caller: its chunk, if it has one."""
        if chunk is None:
            return ()
        self.delivered = True
        return (chunk,)


def _wait_s(attempts: Attempts, attempt: _Attempt) -> float:
    """How long to wait before the next attempt after `attempt` failed; raises its error
    when there is none (`Retry.next_delay_s`)."""
    assert attempt.error is not None
    delay = attempts.next_delay_s(attempt.error, delivered=attempt.delivered)
    if delay is None:
        raise attempt.error
    return delay


def _not_found(attempt: _Attempt) -> bool:
    """An Abort that failed: False when the router has no such request (not running, or
    not this key's tenant's); raises any other error."""
    assert attempt.error is not None
    if attempt.error.code == grpc.StatusCode.NOT_FOUND:
        return False
    raise attempt.error


class _Client:
    """What both clients hold: a channel to the router (`_open`: sync or grpc.aio), its stub,
    the timeout, the retry policy and the API key's metadata."""

    def __init__(
        self,
        address: str,
        timeout_s: float | None = None,
        retry: Retry | None = None,
        *,
        api_key: str | None = None,
        tls: bool | str = False,
    ) -> None:
        self.channel = self._open(address, _channel_credentials(tls))
        self.stub = rgrpc.RouterStub(self.channel)
        self.timeout_s = timeout_s
        self.retry = retry
        self.metadata = _auth_metadata(api_key)

    @staticmethod
    def _open(address: str, creds: grpc.ChannelCredentials | None) -> Any:
        raise NotImplementedError


class TandemClient(_Client):
    """Blocking client. One channel; safe to share between threads.

    `timeout_s` bounds each call (with `retry`, all its attempts together); `retry` (default
    None: no retry) retries failed calls as the module docstring describes."""

    @staticmethod
    def _open(address: str, creds: grpc.ChannelCredentials | None) -> grpc.Channel:
        return grpc.secure_channel(address, creds) if creds else grpc.insecure_channel(address)

    def __enter__(self) -> TandemClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.channel.close()

    def stream(self, prompt: str | Sequence[int] | None = None, **kwargs: Any) -> Iterator[Chunk]:
        """Yield chunks as they arrive; raises TandemError on failure."""
        yield from self._stream(build_request(prompt, **kwargs), Result())

    def _stream(self, req: rpb.GenerateRequest, result: Result) -> Iterator[Chunk]:
        attempts = Attempts(self.retry, self.timeout_s)
        while True:
            call = self.stub.Generate(req, timeout=attempts.timeout_s(), metadata=self.metadata)
            with _Attempt(call) as attempt:
                for msg in call:
                    yield from attempt.deliver(apply_response(result, msg))
                return
            time.sleep(_wait_s(attempts, attempt))

    def _unary(self, method: Callable[..., T], request: Any) -> T:
        attempts = Attempts(self.retry, self.timeout_s)
        while True:
            with _Attempt() as attempt:
                return method(request, timeout=attempts.timeout_s(), metadata=self.metadata)
            time.sleep(_wait_s(attempts, attempt))

    def generate(self, prompt: str | Sequence[int] | None = None, **kwargs: Any) -> Result:
        result = Result()
        for _ in self._stream(build_request(prompt, **kwargs), result):
            pass
        return result

    def tokenize(self, text: str, model: str = "") -> list[int]:
        resp = self._unary(self.stub.Tokenize, rpb.TokenizeRequest(text=text, model=model))
        return list(resp.token_ids)

    def list_models(self) -> list[str]:
        return [m.id for m in self._unary(self.stub.ListModels, rpb.ListModelsRequest()).models]

    def abort(self, request_id: str) -> bool:
        """Abort a running request of this key's tenant; False when none has this id. Not
        retried."""
        request = rpb.AbortRequest(request_id=request_id)
        with _Attempt() as attempt:
            resp = self.stub.Abort(request, timeout=self.timeout_s, metadata=self.metadata)
            return bool(resp.found)
        return _not_found(attempt)


class AsyncTandemClient(_Client):
    """asyncio client (grpc.aio). Create and use it inside a running event loop.

    `timeout_s` and `retry` as for `TandemClient`."""

    @staticmethod
    def _open(address: str, creds: grpc.ChannelCredentials | None) -> grpc.aio.Channel:
        if creds is None:
            return grpc.aio.insecure_channel(address)
        return grpc.aio.secure_channel(address, creds)

    async def __aenter__(self) -> AsyncTandemClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self.channel.close()

    async def stream(
        self,
        prompt: str | Sequence[int] | None = None,
        *,
        result: Result | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[Chunk]:
        """Yield chunks as they arrive; pass `result` to also collect usage and timings."""
        result = result if result is not None else Result()
        req = build_request(prompt, **kwargs)
        attempts = Attempts(self.retry, self.timeout_s)
        while True:
            call = self.stub.Generate(req, timeout=attempts.timeout_s(), metadata=self.metadata)
            with _Attempt(call) as attempt:
                async for msg in call:
                    for chunk in attempt.deliver(apply_response(result, msg)):
                        yield chunk
                return
            await asyncio.sleep(_wait_s(attempts, attempt))

    async def _unary(self, method: Callable[..., Awaitable[T]], request: Any) -> T:
        attempts = Attempts(self.retry, self.timeout_s)
        while True:
            with _Attempt() as attempt:
                return await method(request, timeout=attempts.timeout_s(), metadata=self.metadata)
            await asyncio.sleep(_wait_s(attempts, attempt))

    async def generate(self, prompt: str | Sequence[int] | None = None, **kwargs: Any) -> Result:
        result = Result()
        async for _ in self.stream(prompt, result=result, **kwargs):
            pass
        return result

    async def tokenize(self, text: str, model: str = "") -> list[int]:
        resp = await self._unary(self.stub.Tokenize, rpb.TokenizeRequest(text=text, model=model))
        return list(resp.token_ids)

    async def abort(self, request_id: str) -> bool:
        """Abort a running request of this key's tenant; False when none has this id. Not
        retried."""
        request = rpb.AbortRequest(request_id=request_id)
        with _Attempt() as attempt:
            resp = await self.stub.Abort(request, timeout=self.timeout_s, metadata=self.metadata)
            return bool(resp.found)
        return _not_found(attempt)
