"""HTTP plumbing every OpenAI endpoint shares: work that stops when the client disconnects,
a server-sent-event response that aborts its requests when the client goes, event framing,
and OpenAI's error responses."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncGenerator, Awaitable, Callable
from typing import Any, Protocol

from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from tandem.services.router.openai import protocol as oai


class Closable(Protocol):
    async def aclose(self) -> None: ...


def sse(obj: dict[str, Any], event: str = "") -> bytes:
    """One server-sent event: `data: <json>`, after `event: <name>` when named (the
    Responses API names each event by its type)."""
    data = json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()
    head = f"event: {event}\n".encode() if event else b""
    return head + b"data: " + data + b"\n\n"


def error_response(error: oai.ApiError, headers: dict[str, str] | None = None) -> Response:
    return JSONResponse(error.body(), error.status, headers={**(headers or {}), **error.headers()})


async def unless_disconnected(receive: Receive, work: Awaitable[Any]) -> Any:
    """`work`'s result, or None when the client disconnects first. `work` is cancelled then,
    and when this call is (it never outlives its caller)."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_disconnected(receive))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    return None if task.cancelled() else task.result()


async def _disconnected(receive: Callable[[], Awaitable[Any]]) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


class EventStream(StreamingResponse):
    """A text/event-stream response that stops (and closes its iterator, aborting the
    request) as soon as the client disconnects, whatever the ASGI server's spec version.
    `messages` (the router calls behind it) is closed too: a client gone before the first
    event."""

    def __init__(
        self, events: AsyncGenerator[bytes, None], messages: Closable, headers: dict[str, str]
    ) -> None:
        headers = {**headers, "cache-control": "no-cache", "x-accel-buffering": "no"}
        super().__init__(events, headers=headers, media_type="text/event-stream")
        self.events = events
        self.messages = messages

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async def stream() -> None:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            async for event in self.events:
                await send({"type": "http.response.body", "body": event, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})

        try:
            with contextlib.suppress(OSError):  # the client went away mid-send
                await unless_disconnected(receive, stream())
        finally:
            await self.events.aclose()
            await self.messages.aclose()
