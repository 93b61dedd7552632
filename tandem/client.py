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
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import grpc

from tandem.tools import ChoiceMode, tool_choice_from_json, tools_from_json
from tandem.v1 import router_pb2 as rpb
from tandem.v1 import router_pb2_grpc as rgrpc
from tandem.wire import finish_reason_from_proto

# Trailing metadata key of the server's pushback hint in milliseconds (the services send it
# through services.common.rpc.errors, which takes it from here).
RETRY_AFTER_KEY = "tandem-retry-after-ms"

T = TypeVar("T")


class TandemError(RuntimeError):
    """A failed call: its gRPC status `code`, the server's `message`, and `retry_after_s`,
    how long the server asked the client to wait before trying again (None: no hint)."""

    def __init__(
        self, code: grpc.StatusCode, message: str, retry_after_s: float | None = None
    ) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message
        self.retry_after_s = retry_after_s


@dataclass(frozen=True, slots=True)
class Retry:
    """When and how long to wait before trying a failed call again.

    Attempt 1 is the first call; before attempt n >= 2 the client waits
    `delay_s(n, hint, rng())`, `hint` being the failed attempt's `retry_after_s`. A stream is
    retried only until its first chunk has been yielded to the caller, never after, so no
    token reaches the caller twice. With a client `timeout_s`, the timeout covers all
    attempts and the waits between them: a retry that could not start before it runs out is
    not made. Abort is never retried.

    Args:
        max_attempts: attempts in all, the first included (1: never retry).
        initial_backoff_s: the wait before attempt 2, before jitter.
        max_backoff_s: no wait is longer, not even one a server asks for.
        multiplier: each further wait is this much longer than the one before.
        codes: the statuses worth a retry.
        jitter: each wait is the backoff times a factor drawn from
            [1 - jitter, 1 + jitter), so clients that failed together do not retry together.
        rng: the jitter's random source, uniform in [0, 1) (a test passes a fixed one).
    """

    max_attempts: int = 3
    initial_backoff_s: float = 0.1
    max_backoff_s: float = 5.0
    multiplier: float = 2.0
    codes: tuple[grpc.StatusCode, ...] = (
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.RESOURCE_EXHAUSTED,
    )
    jitter: float = 0.2
    rng: Callable[[], float] = field(default=random.random, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {self.max_attempts}")
        if not 0 <= self.initial_backoff_s <= self.max_backoff_s:
            raise ValueError(
                f"need 0 <= initial_backoff_s <= max_backoff_s, got {self.initial_backoff_s} "
                f"and {self.max_backoff_s}"
            )
        if self.multiplier < 1:
            raise ValueError(f"multiplier must be >= 1, got {self.multiplier}")
        if not 0 <= self.jitter <= 1:
            raise ValueError(f"jitter must be in [0, 1], got {self.jitter}")

    def delay_s(self, attempt: int, retry_after_s: float | None = None, u: float = 0.5) -> float:
        """Seconds to wait before attempt `attempt` (>= 2) after the previous one failed.

        The backoff is initial_backoff_s * multiplier ** (attempt - 2), at most max_backoff_s,
        times the jitter factor 1 + jitter * (2u - 1) (u = 0.5: none). A server's hint
        `retry_after_s` wins when it is longer. The result is at most max_backoff_s.

        Raises ValueError for attempt < 2 or u outside [0, 1]."""
        if attempt < 2:
            raise ValueError(f"attempt must be >= 2 (1 is the first call), got {attempt}")
        if not 0 <= u <= 1:
            raise ValueError(f"u must be in [0, 1], got {u}")
        backoff = min(self.max_backoff_s, self.initial_backoff_s * self.multiplier ** (attempt - 2))
        delay = backoff * (1 + self.jitter * (2 * u - 1))
        if retry_after_s is not None:
            delay = max(delay, retry_after_s)
        return min(self.max_backoff_s, delay)

    def retries(self, error: TandemError, attempt: int) -> bool:
        """Whether attempt `attempt` failing with `error` is worth another attempt."""
        return attempt < self.max_attempts and error.code in self.codes


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
    migrations: int = 0  # moved to another decode worker mid-stream
    reprefills: int = 0  # prompt prefilled again after a failed hand-off
    recoveries: list[str] = field(default_factory=list)  # one line per recovery step
    logprobs: list[tuple[int, float, list[tuple[int, float]]]] = field(default_factory=list)
    # A chat with tools: the calls the answer made, as {"id", "name", "arguments"}.
    tool_calls: list[dict[str, str]] = field(default_factory=list)


def build_request(
    prompt: str | Sequence[int] | None = None,
    *,
    messages: Sequence[Mapping[str, Any]] | None = None,
    model: str = "",
    request_id: str = "",
    tools: Sequence[Mapping[str, Any]] | None = None,
    tool_choice: str | Mapping[str, Any] | None = None,
    parallel_tool_calls: bool | None = None,
    **sampling: Any,
) -> rpb.GenerateRequest:
    """A GenerateRequest from a text, token ids or chat messages plus sampling fields. A chat
    may carry `tools`, `tool_choice` and `parallel_tool_calls` in OpenAI's JSON shapes."""
    req = rpb.GenerateRequest(request_id=request_id, model=model)
    if messages is not None:
        req.chat.messages.extend(chat_message(m) for m in messages)
        _set_tools(req.chat, tools, tool_choice, parallel_tool_calls)
    elif tools is not None or tool_choice is not None:
        raise ValueError("tools need messages (a chat)")
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
        elif name == "logit_bias":  # {token id: bias}
            req.sampling.logit_bias.update(value)
        elif name in CONSTRAINT_KINDS:  # structured output: one of them
            _set_constraint(req.sampling.constraint, name, value)
        elif name in rpb.SamplingParams.DESCRIPTOR.fields_by_name:
            setattr(req.sampling, name, value)
        else:
            raise ValueError(f"unknown sampling parameter {name!r}")
    return req


# Structured output keywords: json_schema (a dict or JSON text), json_object=True, regex (a
# str), choice (strings), grammar (GBNF or Lark text). The router checks them.
CONSTRAINT_KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")


def _set_constraint(msg: rpb.Constraint, kind: str, value: Any) -> None:
    if msg.WhichOneof("kind") is not None:
        raise ValueError(f"{kind}: set one constraint at a time, got {msg.WhichOneof('kind')} too")
    if kind == "json_schema" and not isinstance(value, str):
        value = json.dumps(value, separators=(",", ":"), sort_keys=True)
    if kind == "choice":
        msg.choice.choices.extend(value)
    else:
        setattr(msg, kind, value)


_TOOL_CHOICE_MODES = {
    ChoiceMode.NONE: rpb.TOOL_CHOICE_MODE_NONE,
    ChoiceMode.AUTO: rpb.TOOL_CHOICE_MODE_AUTO,
    ChoiceMode.REQUIRED: rpb.TOOL_CHOICE_MODE_REQUIRED,
}


def _set_tools(
    chat: rpb.ChatMessages,
    tools: Sequence[Mapping[str, Any]] | None,
    tool_choice: str | Mapping[str, Any] | None,
    parallel: bool | None,
) -> None:
    """OpenAI's tools JSON on the wire (the router checks the rule). Raises ToolError."""
    for tool in tools_from_json(list(tools) if tools is not None else None):
        function = rpb.FunctionDefinition(
            name=tool.name, description=tool.description, parameters=tool.parameters
        )
        chat.tools.append(rpb.Tool(function=function))
    if tool_choice is not None:
        choice = tool_choice_from_json(tool_choice, bool(tools))
        if choice.mode == ChoiceMode.FUNCTION:
            chat.tool_choice.function = choice.name
        else:
            chat.tool_choice.mode = _TOOL_CHOICE_MODES[choice.mode]
    if parallel is not None:
        chat.parallel_tool_calls = parallel


def chat_message(message: Mapping[str, Any]) -> rpb.ChatMessage:
    """A message in OpenAI's shape (role, content, and optionally name, tool_call_id and
    tool_calls [{"id", "function": {"name", "arguments"}}]) as the wire carries it; the
    router checks it."""
    calls = [
        rpb.ToolCall(
            id=call["id"],
            function=rpb.FunctionCall(
                name=call["function"]["name"], arguments=call["function"].get("arguments", "")
            ),
        )
        for call in message.get("tool_calls") or ()
    ]
    return rpb.ChatMessage(
        role=message["role"],
        content=message.get("content") or "",
        name=message.get("name") or "",
        tool_call_id=message.get("tool_call_id") or "",
        tool_calls=calls,
    )


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
        result.finish_reason = finish_reason_from_proto(d.finish_reason)
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
        result.migrations = d.timings.migrations
        result.reprefills = d.timings.reprefills
        result.recoveries = list(d.timings.recoveries)
        result.tool_calls = [
            {"id": c.id, "name": c.function.name, "arguments": c.function.arguments}
            for c in d.tool_calls
        ]
        return None
    if kind == "error":
        e = msg.error
        raise TandemError(
            _STATUS_BY_VALUE.get(e.code, grpc.StatusCode.UNKNOWN),
            e.message,
            e.retry_after_ms / 1e3 if e.retry_after_ms else None,
        )
    return None


# An in-stream error carries the numeric gRPC status the call ends with.
_STATUS_BY_VALUE = {code.value[0]: code for code in grpc.StatusCode}


def _error(exc: grpc.RpcError) -> TandemError:
    code = exc.code() if hasattr(exc, "code") else grpc.StatusCode.UNKNOWN
    details = exc.details() if hasattr(exc, "details") else ""
    return TandemError(code, details or "", retry_after(exc))


def retry_after(exc: grpc.RpcError) -> float | None:
    """The pushback hint (seconds) in a failed call's trailers, if any."""
    trailers = exc.trailing_metadata() if hasattr(exc, "trailing_metadata") else None
    for key, value in trailers or ():
        if key == RETRY_AFTER_KEY:
            try:
                return max(0.0, int(value) / 1e3)
            except (TypeError, ValueError):
                return None
    return None


class _Attempts:
    """The retry bookkeeping of one call: which attempt this is, the deadline over all of
    them, and the wait before the next one (shared by the sync and asyncio clients)."""

    def __init__(self, retry: Retry | None, timeout_s: float | None) -> None:
        self.retry = retry
        self.number = 1
        self.deadline = None if timeout_s is None else time.monotonic() + timeout_s

    def timeout_s(self) -> float | None:
        """This attempt's gRPC timeout: what is left of the call's."""
        return None if self.deadline is None else max(0.0, self.deadline - time.monotonic())

    def next_delay_s(self, error: TandemError) -> float | None:
        """The wait before the next attempt, or None when `error` should be raised."""
        if self.retry is None or not self.retry.retries(error, self.number):
            return None
        self.number += 1
        delay = self.retry.delay_s(self.number, error.retry_after_s, self.retry.rng())
        if self.deadline is not None and time.monotonic() + delay >= self.deadline:
            return None
        return delay


def _channel_credentials(tls: bool | str) -> grpc.ChannelCredentials | None:
    """None: plaintext. True: TLS against the system's CAs; a path: against that CA file."""
    if tls is False:
        return None
    roots = Path(tls).read_bytes() if isinstance(tls, str) else None
    return grpc.ssl_channel_credentials(root_certificates=roots)


def _auth_metadata(api_key: str | None) -> tuple[tuple[str, str], ...] | None:
    key = api_key if api_key is not None else os.environ.get("TANDEM_API_KEY", "")
    return (("authorization", f"Bearer {key}"),) if key else None


class TandemClient:
    """Blocking client. One channel; safe to share between threads.

    `timeout_s` bounds each call (with `retry`, all its attempts together); `retry` (default
    None: no retry) retries failed calls as the module docstring describes."""

    def __init__(
        self,
        address: str,
        timeout_s: float | None = None,
        retry: Retry | None = None,
        *,
        api_key: str | None = None,
        tls: bool | str = False,
    ) -> None:
        creds = _channel_credentials(tls)
        self.channel = (
            grpc.secure_channel(address, creds) if creds else grpc.insecure_channel(address)
        )
        self.stub = rgrpc.RouterStub(self.channel)
        self.timeout_s = timeout_s
        self.retry = retry
        self.metadata = _auth_metadata(api_key)

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
        attempts = _Attempts(self.retry, self.timeout_s)
        while True:
            yielded = False
            call = self.stub.Generate(req, timeout=attempts.timeout_s(), metadata=self.metadata)
            try:
                for msg in call:
                    chunk = _apply(result, msg)
                    if chunk is not None:
                        yielded = True
                        yield chunk
                return
            except grpc.RpcError as exc:
                error = _error(exc)
            except TandemError as exc:  # an in-stream error; the call ends with it
                error = exc
            finally:
                call.cancel()  # no-op once the call ended; frees it when the caller stops
            delay = None if yielded else attempts.next_delay_s(error)
            if delay is None:
                raise error
            time.sleep(delay)

    def _unary(self, method: Callable[..., T], request: Any) -> T:
        attempts = _Attempts(self.retry, self.timeout_s)
        while True:
            try:
                return method(request, timeout=attempts.timeout_s(), metadata=self.metadata)
            except grpc.RpcError as exc:
                error = _error(exc)
            delay = attempts.next_delay_s(error)
            if delay is None:
                raise error
            time.sleep(delay)

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
        try:
            resp = self.stub.Abort(
                rpb.AbortRequest(request_id=request_id),
                timeout=self.timeout_s,
                metadata=self.metadata,
            )
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.NOT_FOUND:  # not running (or not ours)
                return False
            raise _error(exc) from None
        return bool(resp.found)


class AsyncTandemClient:
    """asyncio client (grpc.aio). Create and use it inside a running event loop.

    `timeout_s` and `retry` as for `TandemClient`."""

    def __init__(
        self,
        address: str,
        timeout_s: float | None = None,
        retry: Retry | None = None,
        *,
        api_key: str | None = None,
        tls: bool | str = False,
    ) -> None:
        creds = _channel_credentials(tls)
        self.channel = (
            grpc.aio.secure_channel(address, creds) if creds else grpc.aio.insecure_channel(address)
        )
        self.stub = rgrpc.RouterStub(self.channel)
        self.timeout_s = timeout_s
        self.retry = retry
        self.metadata = _auth_metadata(api_key)

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
        attempts = _Attempts(self.retry, self.timeout_s)
        while True:
            yielded = False
            call = self.stub.Generate(req, timeout=attempts.timeout_s(), metadata=self.metadata)
            try:
                async for msg in call:
                    chunk = _apply(result, msg)
                    if chunk is not None:
                        yielded = True
                        yield chunk
                return
            except grpc.RpcError as exc:
                error = _error(exc)
            except TandemError as exc:  # an in-stream error; the call ends with it
                error = exc
            finally:
                call.cancel()  # no-op once the call ended; frees it when the caller stops
            delay = None if yielded else attempts.next_delay_s(error)
            if delay is None:
                raise error
            await asyncio.sleep(delay)

    async def _unary(self, method: Callable[..., Awaitable[T]], request: Any) -> T:
        attempts = _Attempts(self.retry, self.timeout_s)
        while True:
            try:
                return await method(request, timeout=attempts.timeout_s(), metadata=self.metadata)
            except grpc.RpcError as exc:
                error = _error(exc)
            delay = attempts.next_delay_s(error)
            if delay is None:
                raise error
            await asyncio.sleep(delay)

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
        try:
            resp = await self.stub.Abort(
                rpb.AbortRequest(request_id=request_id),
                timeout=self.timeout_s,
                metadata=self.metadata,
            )
        except grpc.RpcError as exc:
            if exc.code() == grpc.StatusCode.NOT_FOUND:  # not running (or not ours)
                return False
            raise _error(exc) from None
        return bool(resp.found)
