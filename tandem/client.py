"""Python client for application backends: sync and asyncio, streaming or not.

    from tandem.client import TandemClient
    with TandemClient("127.0.0.1:50051") as client:
        for chunk in client.stream("Hello", max_tokens=32, temperature=0.7):
            print(chunk.text, end="", flush=True)
        result = client.generate(messages=[{"role": "user", "content": "Hi"}], max_tokens=16)

Sampling keyword arguments are the fields of `tandem.engine.sampling.SamplingParams`.
Failures raise `TandemError` carrying the gRPC status code and the server's message.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc

from tandem.v1 import router_pb2 as rpb
from tandem.v1 import router_pb2_grpc as rgrpc

_FINISH = {
    rpb.FINISH_REASON_STOP: "stop",
    rpb.FINISH_REASON_LENGTH: "length",
    rpb.FINISH_REASON_ABORT: "abort",
}


class TandemError(RuntimeError):
    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message


@dataclass(frozen=True, slots=True)
class Chunk:
    token_ids: list[int]
    text: str


@dataclass(slots=True)
class Result:
    """A finished generation (also filled in by `stream` as it goes)."""

    request_id: str = ""
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    stop_reason: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_prompt_tokens: int = 0
    first_token_ms: float = 0.0
    total_ms: float = 0.0
    disaggregated: bool = False
    prefill_worker: str = ""
    decode_worker: str = ""
    route_reason: str = ""
    route_cached_tokens: int = 0
    index_degraded: bool = False
    logprobs: list[tuple[int, float, list[tuple[int, float]]]] = field(default_factory=list)


def build_request(
    prompt: str | Sequence[int] | None = None,
    *,
    messages: Sequence[Mapping[str, str]] | None = None,
    model: str = "",
    request_id: str = "",
    **sampling: Any,
) -> rpb.GenerateRequest:
    """A GenerateRequest from a text, token ids or chat messages plus sampling fields."""
    req = rpb.GenerateRequest(request_id=request_id, model=model)
    if messages is not None:
        req.chat.messages.extend(
            rpb.ChatMessage(role=m["role"], content=m["content"]) for m in messages
        )
    elif isinstance(prompt, str):
        req.text = prompt
    elif prompt is not None:
        req.token_ids.ids.extend(prompt)
    else:
        raise ValueError("give a prompt (text or token ids) or messages")
    for name, value in sampling.items():
        if value is None:
            continue
        if name in ("stop", "stop_token_ids"):
            getattr(req.sampling, name).extend([value] if isinstance(value, str) else value)
        elif name in rpb.SamplingParams.DESCRIPTOR.fields_by_name:
            setattr(req.sampling, name, value)
        else:
            raise ValueError(f"unknown sampling parameter {name!r}")
    return req


def _apply(result: Result, msg: rpb.GenerateResponse) -> Chunk | None:
    """Fold one response into `result`; return the chunk, if it is one. Raises on error."""
    result.request_id = msg.request_id
    kind = msg.WhichOneof("kind")
    if kind == "chunk":
        c = msg.chunk
        result.token_ids.extend(c.token_ids)
        result.text += c.text
        for lp in c.logprobs:
            result.logprobs.append(
                (lp.token_id, lp.logprob, [(t.token_id, t.logprob) for t in lp.top])
            )
        return Chunk(list(c.token_ids), c.text)
    if kind == "complete":
        d = msg.complete
        result.finish_reason = _FINISH.get(d.finish_reason)
        result.stop_reason = d.stop_reason
        result.prompt_tokens = d.usage.prompt_tokens
        result.completion_tokens = d.usage.completion_tokens
        result.cached_prompt_tokens = d.usage.cached_prompt_tokens
        result.first_token_ms = d.timings.first_token_ms
        result.total_ms = d.timings.total_ms
        result.disaggregated = d.timings.disaggregated
        result.prefill_worker = d.timings.prefill_worker
        result.decode_worker = d.timings.decode_worker
        result.route_reason = d.timings.route_reason
        result.route_cached_tokens = d.timings.route_cached_tokens
        result.index_degraded = d.timings.index_degraded
        return None
    if kind == "error":
        raise TandemError(
            _STATUS_BY_VALUE.get(msg.error.code, grpc.StatusCode.UNKNOWN), msg.error.message
        )
    return None


# An in-stream error carries the numeric gRPC status the call ends with.
_STATUS_BY_VALUE = {code.value[0]: code for code in grpc.StatusCode}


def _error(exc: grpc.RpcError) -> TandemError:
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    details = exc.details() if hasattr(exc, "details") else str(exc)
    return TandemError(code, details or "")


class TandemClient:
    """Blocking client. One channel; safe to share between threads."""

    def __init__(self, address: str, timeout_s: float | None = None) -> None:
        self.channel = grpc.insecure_channel(address)
        self.stub = rgrpc.RouterStub(self.channel)
        self.timeout_s = timeout_s

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
        try:
            for msg in self.stub.Generate(req, timeout=self.timeout_s):
                chunk = _apply(result, msg)
                if chunk is not None:
                    yield chunk
        except grpc.RpcError as exc:
            raise _error(exc) from None

    def generate(self, prompt: str | Sequence[int] | None = None, **kwargs: Any) -> Result:
        result = Result()
        for _ in self._stream(build_request(prompt, **kwargs), result):
            pass
        return result

    def tokenize(self, text: str, model: str = "") -> list[int]:
        try:
            return list(self.stub.Tokenize(rpb.TokenizeRequest(text=text, model=model)).token_ids)
        except grpc.RpcError as exc:
            raise _error(exc) from None

    def list_models(self) -> list[str]:
        return [m.id for m in self.stub.ListModels(rpb.ListModelsRequest()).models]

    def abort(self, request_id: str) -> bool:
        return bool(self.stub.Abort(rpb.AbortRequest(request_id=request_id)).found)


class AsyncTandemClient:
    """asyncio client (grpc.aio). Create and use it inside a running event loop."""

    def __init__(self, address: str, timeout_s: float | None = None) -> None:
        self.channel = grpc.aio.insecure_channel(address)
        self.stub = rgrpc.RouterStub(self.channel)
        self.timeout_s = timeout_s

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
        try:
            async for msg in self.stub.Generate(
                build_request(prompt, **kwargs), timeout=self.timeout_s
            ):
                chunk = _apply(result, msg)
                if chunk is not None:
                    yield chunk
        except grpc.RpcError as exc:
            raise _error(exc) from None

    async def generate(self, prompt: str | Sequence[int] | None = None, **kwargs: Any) -> Result:
        result = Result()
        async for _ in self.stream(prompt, result=result, **kwargs):
            pass
        return result

    async def tokenize(self, text: str, model: str = "") -> list[int]:
        try:
            resp = await self.stub.Tokenize(rpb.TokenizeRequest(text=text, model=model))
        except grpc.RpcError as exc:
            raise _error(exc) from None
        return list(resp.token_ids)

    async def abort(self, request_id: str) -> bool:
        return bool((await self.stub.Abort(rpb.AbortRequest(request_id=request_id))).found)
