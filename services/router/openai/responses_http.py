"""The I/O of POST /v1/responses: a checked request through the router, answered as one
`response` object or as its stream of events (tandem.services.router.openai.responses builds
them). Until the first token an error is an HTTP status; after it, an `error` event."""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable

from fastapi.responses import JSONResponse, Response
from starlette.types import Receive

from tandem.services.common.rpc.errors import ServiceError
from tandem.services.router.openai import protocol as oai
from tandem.services.router.openai import responses as responses
from tandem.services.router.openai import structured as structured
from tandem.services.router.openai.fanout import Messages, first_message, next_message
from tandem.services.router.openai.sse import EventStream, error_response, sse, unless_disconnected
from tandem.v1 import router_pb2 as rpb


async def respond(
    receive: Receive,
    reply: responses.Reply,
    start: Callable[[rpb.GenerateRequest], Messages],
    label: str,
) -> Response:
    """The answer to one Responses request; the client leaving (499) aborts it."""
    messages = start(reply.parsed.request)
    headers = {"x-request-id": label or reply.id}
    first = await unless_disconnected(receive, first_message(messages))
    if first is None:
        await messages.aclose()
        return Response(status_code=499)
    if isinstance(first, oai.ApiError):
        return error_response(first, headers)
    if reply.parsed.stream:
        return EventStream(_events(reply, first, messages), messages, headers)
    whole = await unless_disconnected(receive, _collect(reply, first, messages))
    await messages.aclose()
    if whole is None:
        return Response(status_code=499)
    if isinstance(whole, oai.ApiError):
        return error_response(whole, headers)
    return JSONResponse(whole, headers=headers)


async def _collect(
    reply: responses.Reply, message: rpb.GenerateResponse | None, messages: Messages
) -> dict[str, object] | oai.ApiError:
    chunks: list[rpb.Chunk] = []
    try:
        while message is not None:
            if message.WhichOneof("kind") == "complete":
                return reply.whole(chunks, message.complete)
            chunks.append(message.chunk)
            message = await next_message(messages)
    except ServiceError as error:
        return oai.from_status(error.code, error.message, error.retry_after_ms)
    return oai.ApiError(500, "the request ended without completing", "server_error")


async def _events(
    reply: responses.Reply, message: rpb.GenerateResponse | None, messages: Messages
) -> AsyncGenerator[bytes, None]:
    """OpenAI's events, each named by its type (`event:` and `data:` lines)."""
    try:
        for event in reply.opening():
            yield sse(event, event["type"])
        while message is not None:
            if message.WhichOneof("kind") == "complete":
                for event in reply.closing(message.complete):
                    yield sse(event, event["type"])
                break
            for event in reply.deltas(message.chunk):
                yield sse(event, event["type"])
            message = await next_message(messages)
    except ServiceError as error:
        failed = reply.error(oai.from_status(error.code, error.message, error.retry_after_ms))
        yield sse(failed, "error")
    finally:
        await messages.aclose()  # a client gone: the request is aborted on both workers
