"""The router's OpenAI-compatible HTTP API (FastAPI on uvicorn, in the router's event loop).

POST /v1/chat/completions, POST /v1/completions, GET /v1/models, GET /health. A request goes
through RouterServer.generate exactly as a gRPC Generate does: the same admission, limits,
placement, recovery, metrics and tenants (API keys from the same KeyRing, in
`Authorization: Bearer`). The rules (bodies, error objects) are pure code in
tandem.services.router.openai.protocol, the answers in tandem.services.router.openai.answers; this
module
does the I/O:

- errors before the first token are HTTP statuses (400/401/403/404/409/429/503) with
  OpenAI's error object and Retry-After on pushback; a failure mid-stream is an SSE `error`
  event (the status line has gone);
- a client that disconnects, streaming or not, cancels the request, which aborts it on both
  workers;
- `X-Request-Id` is the request's label (Abort, duplicate detection), echoed back.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import socket
import time
import uuid
from collections.abc import AsyncGenerator, Callable, Sequence
from typing import Any, Protocol

import grpc
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from tandem.chat import Message
from tandem.engine.grammar import Constraint
from tandem.services.common import security
from tandem.services.common.observe import tracing
from tandem.services.common.rpc.convert_tools import ChatTools
from tandem.services.common.rpc.errors import ServiceError
from tandem.services.router.call import CallContext
from tandem.services.router.inputs import GenerateInput, Source, http_input
from tandem.services.router.openai import answers
from tandem.services.router.openai import choices as openai_choices
from tandem.services.router.openai import fanout as openai_fanout
from tandem.services.router.openai import protocol as oai
from tandem.services.router.openai import responses as openai_responses
from tandem.services.router.openai import responses_http as openai_responses_http
from tandem.services.router.openai import structured as structured
from tandem.services.router.openai import tools as openai_tools
from tandem.services.router.openai.responses_tools import ToolReply
from tandem.services.router.openai.sse import EventStream as _EventStream
from tandem.services.router.openai.sse import error_response as _error_response
from tandem.services.router.openai.sse import unless_disconnected as _unless_disconnected
from tandem.tokenizer.tokenizer import Tokenizer
from tandem.tools import ToolFormat
from tandem.v1 import router_pb2 as rpb

log = logging.getLogger(__name__)
# A request body larger than this is refused (413) before it is read into memory; the router
# then refuses prompts that cannot fit the model by their length.
MAX_BODY_BYTES = 32 << 20
RULE = security.Bearer("generate")  # the API key scope the HTTP API needs, as gRPC Generate


class Router(Protocol):
    """What the HTTP API needs of the router (tandem.services.router.server.RouterServer)."""

    model_id: str
    max_model_len: int
    tokenizer: Tokenizer
    tool_format: ToolFormat  # how the model writes tool calls (tandem.tools)

    def generate(
        self, source: Source, context: CallContext, tenant: str
    ) -> AsyncGenerator[rpb.GenerateResponse, None]: ...


def listen_socket(host: str, port: int) -> socket.socket:
    """A TCP listener whose connections send each SSE chunk at once: made with IPPROTO_TCP,
    asyncio sets TCP_NODELAY on every accepted socket (with proto 0, as socket.create_server
    makes it, Nagle holds a stream's first chunk until the client's delayed ACK, ~40 ms)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # Linux: inherited too
        sock.bind((host, port))
        sock.listen(socket.SOMAXCONN)
    except OSError:
        sock.close()
        raise
    return sock


# Idle keep-alive connections stay open this long. Longer than clients keep theirs (httpx, so
# the openai client: 5 s), so the client always closes first: with equal timeouts a client
# waiting out a 5 s Retry-After reuses the connection just as the server closes it, and the
# request fails with a connection error instead of being sent.
KEEP_ALIVE_S = 75


class HttpCallContext:
    """RouterServer.generate's view of an HTTP call (hops.CallContext): no deadline, and the
    W3C trace headers a caller sent."""

    def __init__(self, headers: Any) -> None:
        self._metadata = [(k, headers[k]) for k in tracing.TRACE_HEADERS if k in headers]

    def time_remaining(self) -> float | None:
        return None

    def invocation_metadata(self) -> Sequence[tuple[str, str | bytes]]:
        return self._metadata


class _Uvicorn(uvicorn.Server):
    """uvicorn inside a process that handles its own signals (run_until_signal)."""

    @contextlib.contextmanager
    def capture_signals(self) -> Any:
        yield


class OpenAIServer:
    """The HTTP API of one RouterServer."""

    def __init__(self, router: Router, keyring: security.KeyRing | None) -> None:
        self.router = router
        self.keyring = keyring
        self.address = ""
        self.scheme = "http"
        self._server: _Uvicorn | None = None
        self._task: asyncio.Task[None] | None = None
        self._created = int(time.time())
        self.app = self._build_app()

    # -- lifecycle -------------------------------------------------------------------------

    async def start(self, host: str, port: int, cert_file: str = "", key_file: str = "") -> None:
        """Listen on host:port (0: any free port; `address` says which)."""
        sock = listen_socket(host, port)
        config = uvicorn.Config(
            self.app,
            lifespan="off",
            access_log=False,
            log_level="warning",
            timeout_graceful_shutdown=2,
            timeout_keep_alive=KEEP_ALIVE_S,
            ssl_certfile=cert_file or None,
            ssl_keyfile=key_file or None,
        )
        self._server = _Uvicorn(config)
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]))
        while not self._server.started:
            if self._task.done():
                self._task.result()  # raises what stopped it
                raise RuntimeError("the HTTP server stopped during start-up")
            await asyncio.sleep(0.01)
        self.scheme = "https" if cert_file else "http"
        self.address = f"{host}:{sock.getsockname()[1]}"

    async def stop(self) -> None:
        if self._server is not None and self._task is not None:
            self._server.should_exit = True
            await self._task
        self._server = self._task = None

    # -- the app ---------------------------------------------------------------------------

    def _build_app(self) -> FastAPI:
        app = FastAPI(title="Tandem", docs_url=None, redoc_url=None, openapi_url=None)
        app.add_api_route("/health", self._health, methods=["GET"])
        app.add_api_route("/v1/models", self._models, methods=["GET"])
        app.add_api_route("/v1/chat/completions", self._chat, methods=["POST"])
        app.add_api_route("/v1/completions", self._completions, methods=["POST"])
        app.add_api_route("/v1/responses", self._responses, methods=["POST"])
        app.add_exception_handler(StarletteHTTPException, _http_exception)
        app.add_exception_handler(Exception, _unexpected)
        return app

    async def _health(self) -> Response:
        return JSONResponse({"status": "ok"})

    async def _models(self, request: Request) -> Response:
        try:
            self._principal(request)
        except oai.ApiError as error:
            return _error_response(error)
        router = self.router
        return JSONResponse(answers.models(router.model_id, router.max_model_len, self._created))

    async def _chat(self, request: Request) -> Response:
        return await self._generate(request, chat=True)

    async def _completions(self, request: Request) -> Response:
        return await self._generate(request, chat=False)

    async def _responses(self, request: Request) -> Response:
        """POST /v1/responses (responses.py): one chat request through the router."""
        router = self.router
        try:
            principal = self._principal(request)
            body = await _read_json(request)
            parsed = openai_responses.parse(body, router.model_id, router.max_model_len)
            constraint = await _compile_constraint(parsed.constraint)
            await _check_tool_schemas(parsed.chat_tools, flat=True)
        except oai.ApiError as error:
            return _error_response(error)
        label = request.headers.get("x-request-id", "")
        parsed.request.request_id = label
        tenant = principal.tenant if principal is not None else ""
        context = HttpCallContext(request.headers)
        source = _sources(parsed.messages, parsed.chat_tools, constraint)

        def start(one: rpb.GenerateRequest) -> Messages:
            return router.generate(source(one), context, tenant)

        reply = openai_responses.Reply(parsed, router.model_id)
        if parsed.tool_names:  # the answer may be calls
            reply = ToolReply(parsed, router.model_id, format=router.tool_format)
        return await openai_responses_http.respond(request.receive, reply, start, label)

    async def _generate(self, request: Request, chat: bool) -> Response:
        """Validate, then answer whole or as a stream; a client gone cancels the request."""
        try:
            principal = self._principal(request)
            body = await _read_json(request)
            parse = oai.parse_chat if chat else oai.parse_completion
            router = self.router
            parsed = parse(body, router.model_id, router.max_model_len)
            constraint = await _compile_constraint(parsed.constraint)
            if chat:
                parsed = await _check_tools(parsed, router.tool_format)
        except oai.ApiError as error:
            return _error_response(error)
        source = _sources(parsed.messages, parsed.tools, constraint)
        label = request.headers.get("x-request-id", "")
        parsed.request.request_id = label
        tenant = principal.tenant if principal is not None else ""
        prefix = "chatcmpl" if chat else "cmpl"
        if parsed.num_choices > 1 or parsed.echo:
            return await self._choices(
                request, parsed, chat, tenant, f"{prefix}-{uuid.uuid4().hex}", source
            )
        answer = answers.Answer(
            f"{prefix}-{uuid.uuid4().hex}", self.router.model_id, chat, parsed, self._token_text
        )
        if parsed.user:
            log.info("request %s: user %r", answer.id, parsed.user)
        messages = self.router.generate(
            source(parsed.request), HttpCallContext(request.headers), tenant
        )
        headers = {"x-request-id": label or answer.id}
        # Until the first message (admission, validation, placement, TTFT) errors are
        # statuses; the client leaving meanwhile cancels the request.
        first = await _unless_disconnected(request.receive, _first(messages))
        if first is None:
            await messages.aclose()
            return Response(status_code=499)
        if isinstance(first, oai.ApiError):
            return _error_response(first, headers)
        if parsed.stream:
            return _EventStream(_events(answer, first, messages), messages, headers)
        whole = await _unless_disconnected(request.receive, _collect(answer, first, messages))
        if whole is None:
            await messages.aclose()
            return Response(status_code=499)
        if isinstance(whole, oai.ApiError):
            return _error_response(whole, headers)
        return JSONResponse(whole, headers=headers)

    async def _choices(
        self,
        request: Request,
        parsed: oai.ParsedRequest,
        chat: bool,
        tenant: str,
        answer_id: str,
        source: Callable[[rpb.GenerateRequest], Source],
    ) -> Response:
        """Several choices (n > 1, a list of prompts) or echo: one router call per choice
        (tandem.services.router.openai.fanout), answered as one."""
        created = int(time.time())
        context = HttpCallContext(request.headers)

        def make_answer(plan: openai_choices.ChoicePlan) -> answers.Answer:
            prompt, echo = plan.request, ""
            if parsed.echo:
                ids = prompt.token_ids.ids
                echo = prompt.text if prompt.HasField("text") else self.router.tokenizer.decode(ids)
            model = self.router.model_id
            return answers.Answer(
                answer_id, model, chat, parsed, self._token_text, created,
                index=plan.index, echo=echo,
            )  # fmt: skip

        def start(one: rpb.GenerateRequest) -> Messages:
            return self.router.generate(source(one), context, tenant)

        return await openai_fanout.respond(request.receive, parsed, answer_id, start, make_answer)

    def _principal(self, request: Request) -> security.Principal | None:
        """The caller's key, checked as gRPC Generate checks it; None without keys."""
        if self.keyring is None:
            return None
        try:
            return security.check_bearer(self.keyring, request.headers.get("authorization"), RULE)
        except security.Refused as refused:
            raise oai.from_status(refused.code, refused.message) from None

    def _token_text(self, token_id: int) -> str:
        return self.router.tokenizer.decode([token_id], skip_special_tokens=False)


# -- helpers -----------------------------------------------------------------------------------


Messages = AsyncGenerator[rpb.GenerateResponse, None]


def _sources(
    messages: tuple[Message, ...], tools: ChatTools, constraint: Constraint | None
) -> Callable[[rpb.GenerateRequest], Source]:
    """The core's source for each router call of one HTTP request (one per choice): the call's
    own prompt, seed and label from its GenerateRequest, and what the body's one parse read
    and compiled (tandem.services.router.inputs.http_input)."""

    def source(request: rpb.GenerateRequest) -> Source:
        async def read() -> GenerateInput:
            return http_input(request, messages, tools, constraint)

        return Source(request.request_id, read)

    return source


async def _compile_constraint(found: tuple[rpb.Constraint, str] | None) -> Constraint | None:
    """The body's schema, regex or grammar compiled, once, off the event loop (milliseconds
    when large), before any compute. Raises ApiError naming the body's field."""
    if found is None:
        return None
    loop = asyncio.get_running_loop()
    result = await loop.run_in_executor(None, structured.compile_constraint, *found)
    if isinstance(result, structured.FieldError):
        raise oai.invalid(result.param, result.reason)
    return result


async def _check_tools(parsed: oai.ParsedRequest, tool_format: ToolFormat) -> oai.ParsedRequest:
    """Each tool's parameters schema compiled to check it, off the event loop, before any
    compute (ApiError naming the body's field); the request then reads calls in the
    router's tool-call format."""
    if not await _check_tool_schemas(parsed.tools):
        return parsed
    return dataclasses.replace(parsed, tool_format=tool_format)


async def _check_tool_schemas(chat_tools: ChatTools, flat: bool = False) -> bool:
    """Compile each tool's parameters schema off the event loop (ApiError naming the body's
    field; `flat`: the Responses API's names). False: the request has no tools."""
    if not chat_tools.tools:
        return False
    loop = asyncio.get_running_loop()
    error = await loop.run_in_executor(
        None, openai_tools.check, chat_tools.tools, chat_tools.choice
    )
    if error is not None:
        raise oai.invalid(openai_tools.field_name(error.field, flat), error.reason)
    return True


async def _read_json(request: Request) -> Any:
    """The body as JSON, at most MAX_BODY_BYTES. Raises ApiError (400, 413)."""
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise oai.ApiError(413, f"request body over {MAX_BODY_BYTES} bytes")
        chunks.append(chunk)
    try:
        return json.loads(b"".join(chunks))
    except (ValueError, UnicodeDecodeError) as exc:
        raise oai.invalid("body", f"not valid JSON ({exc})") from None


async def _next(messages: Messages) -> rpb.GenerateResponse | None:
    """The next chunk or completion (in-stream Error messages are skipped: the ServiceError
    raised right after carries the same status); None at the end."""
    async for message in messages:
        if message.WhichOneof("kind") != "error":
            return message
    return None


async def _first(messages: Messages) -> rpb.GenerateResponse | oai.ApiError:
    try:
        message = await _next(messages)
    except ServiceError as error:
        return oai.from_status(error.code, error.message, error.retry_after_ms)
    if message is None:
        return oai.from_status(grpc.StatusCode.INTERNAL, "the request ended without an answer")
    return message


async def _collect(
    answer: answers.Answer, message: rpb.GenerateResponse | None, messages: Messages
) -> dict[str, Any] | oai.ApiError:
    """The whole answer of a non-streaming request."""
    try:
        while message is not None:
            if message.WhichOneof("kind") == "complete":
                return answer.whole(message.complete)
            answer.chunk(message.chunk)
            message = await _next(messages)
    except ServiceError as error:
        return oai.from_status(error.code, error.message, error.retry_after_ms)
    return oai.from_status(grpc.StatusCode.INTERNAL, "the request ended without completing")


async def _events(
    answer: answers.Answer, message: rpb.GenerateResponse | None, messages: Messages
) -> AsyncGenerator[bytes, None]:
    """Server-sent events: OpenAI's chunks, the usage chunk if asked for, `[DONE]`; a
    failure mid-stream is one `error` event."""
    try:
        if answer.chat:
            yield _sse(answer.first())
        while message is not None:
            if message.WhichOneof("kind") == "complete":
                for chunk in answer.finish_chunks():  # with tools: what was held back
                    yield _sse(chunk)
                yield _sse(answer.last(message.complete))
                if answer.parsed.include_usage:
                    yield _sse(answer.usage_chunk(message.complete))
                break
            for chunk in answer.chunks(message.chunk):
                yield _sse(chunk)
            message = await _next(messages)
        yield b"data: [DONE]\n\n"
    except ServiceError as error:
        yield _sse(oai.from_status(error.code, error.message, error.retry_after_ms).body())
    finally:
        await messages.aclose()  # a client gone: the request is aborted on both workers


def _sse(obj: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


async def _http_exception(request: Request, exc: Exception) -> Response:
    """Unknown paths and methods (404, 405) in OpenAI's error shape, not FastAPI's."""
    assert isinstance(exc, StarletteHTTPException)
    what = f"{request.method} {request.url.path}"
    return _error_response(oai.ApiError(exc.status_code, f"{what}: {exc.detail}"))


async def _unexpected(request: Request, exc: Exception) -> Response:
    """A bug: logged with its traceback; the client sees a 500 without internals."""
    log.exception("HTTP %s %s failed", request.method, request.url.path)
    return _error_response(oai.ApiError(500, "internal error", "server_error"))
