"""The I/O of an OpenAI request with several choices (n > 1, a list of prompts, echo): one
router call per choice (tandem.services.router.openai.choices plans them), merged into one answer.

Sequence 0 of every prompt is sent first; the other sequences once every first one has its
first token, so they find the prompt's blocks cached instead of computing them again. Until
every choice has its first message, an error is the request's HTTP status (the other choices
are then cancelled); after that, a failing choice ends the stream with an `error` event.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import grpc
from fastapi.responses import JSONResponse, Response
from starlette.types import Receive

from tandem.services.common.rpc.errors import ServiceError
from tandem.services.router.openai import answers
from tandem.services.router.openai import choices as choices
from tandem.services.router.openai import protocol as oai
from tandem.services.router.openai.sse import EventStream, error_response, sse, unless_disconnected
from tandem.v1 import router_pb2 as rpb

Messages = AsyncGenerator[rpb.GenerateResponse, None]
JSON = dict[str, Any]


@dataclass(slots=True)
class Lane:
    """One choice's router call and the answer it builds."""

    plan: choices.ChoicePlan
    answer: answers.Answer
    messages: Messages
    read: list[rpb.GenerateResponse] = field(default_factory=list)  # not yet answered

    async def next(self) -> rpb.GenerateResponse | None:
        """The next message (those read ahead first); None at the end."""
        return self.read.pop(0) if self.read else await next_message(self.messages)


class Lanes:
    """Every choice's call, in choice order; `aclose` ends those still running (each one's
    request is then aborted on its workers)."""

    def __init__(self, lanes: Sequence[Lane]) -> None:
        self.lanes = sorted(lanes, key=lambda lane: lane.plan.index)

    async def aclose(self) -> None:
        for lane in self.lanes:
            await lane.messages.aclose()


async def respond(
    receive: Receive,
    parsed: oai.ParsedRequest,
    answer_id: str,
    start: Callable[[rpb.GenerateRequest], Messages],
    make_answer: Callable[[choices.ChoicePlan], answers.Answer],
) -> Response:
    """The HTTP answer of a request with several choices; the client leaving (499) or an
    error closes every choice's call."""
    label = parsed.request.request_id
    plans = choices.plan((parsed.request, *parsed.more_prompts), parsed.n, label)
    headers = {"x-request-id": label or answer_id}
    lanes = await unless_disconnected(receive, open_lanes(plans, start, make_answer))
    if lanes is None:
        return Response(status_code=499)  # open_lanes closed every call
    if isinstance(lanes, oai.ApiError):
        return error_response(lanes, headers)
    if parsed.stream:
        return EventStream(events(lanes, parsed.include_usage), lanes, headers)
    answer = await unless_disconnected(receive, whole(lanes))
    await lanes.aclose()
    if answer is None:
        return Response(status_code=499)
    if isinstance(answer, oai.ApiError):
        return error_response(answer, headers)
    return JSONResponse(answer, headers=headers)


async def open_lanes(
    plans: Sequence[choices.ChoicePlan],
    start: Callable[[rpb.GenerateRequest], Messages],
    make_answer: Callable[[choices.ChoicePlan], answers.Answer],
) -> Lanes | oai.ApiError:
    """Start every choice and wait for each one's first message; the first refusal instead,
    with every call closed. A prompt's first sequence goes first, and its siblings once it
    has streamed a token from its decode worker (its second message after a hand-off):
    that worker then holds the prompt's blocks and has published them to the prefix index,
    so the siblings are placed on it and served from its cache, with no prefill hop."""
    lanes: list[Lane] = []
    has_siblings = {p.prompt_index for p in plans if p.sequence}

    async def begin(plan: choices.ChoicePlan) -> oai.ApiError | None:
        lane = Lane(plan, make_answer(plan), start(plan.request))
        lanes.append(lane)
        first = await first_message(lane.messages)
        if isinstance(first, oai.ApiError):
            return first
        lane.read.append(first)
        if plan.sequence == 0 and plan.prompt_index in has_siblings:
            if first.WhichOneof("kind") == "chunk":
                try:
                    second = await next_message(lane.messages)
                except ServiceError as error:
                    return oai.from_status(error.code, error.message, error.retry_after_ms)
                if second is not None:
                    lane.read.append(second)
        return None

    try:
        for wave in ([p for p in plans if p.sequence == 0], [p for p in plans if p.sequence]):
            refusals = [e for e in await asyncio.gather(*map(begin, wave)) if e is not None]
            if refusals:
                await Lanes(lanes).aclose()
                return refusals[0]
    except BaseException:
        await Lanes(lanes).aclose()
        raise
    return Lanes(lanes)


async def whole(lanes: Lanes) -> JSON | oai.ApiError:
    """The whole answer: every choice collected, their usage merged."""
    results = await asyncio.gather(*(_collect(lane) for lane in lanes.lanes))
    collected: list[tuple[JSON, rpb.Complete]] = []
    for result in results:
        if isinstance(result, oai.ApiError):
            return result
        collected.append(result)
    merged = collected[0][0]
    merged["choices"] = [answer["choices"][0] for answer, _ in collected]
    merged["usage"] = answers.usage(_usage(lanes, [complete for _, complete in collected]))
    return merged


async def events(lanes: Lanes, include_usage: bool) -> AsyncGenerator[bytes, None]:
    """Server-sent events: each choice's chunks as they come (each with its index), its
    finish chunk, then the merged usage chunk if asked for, `[DONE]`."""
    queue: asyncio.Queue[tuple[Lane, rpb.GenerateResponse | ServiceError | None]]
    queue = asyncio.Queue()

    async def pump(lane: Lane) -> None:
        try:
            message = await lane.next()
            while message is not None:
                await queue.put((lane, message))
                if message.WhichOneof("kind") == "complete":
                    return
                message = await lane.next()
        except ServiceError as error:
            await queue.put((lane, error))
        finally:
            await queue.put((lane, None))

    tasks: list[asyncio.Task[None]] = []
    completes: dict[int, rpb.Complete] = {}
    try:
        for lane in lanes.lanes:
            if lane.answer.chat:
                yield sse(lane.answer.first())
            elif lane.answer.echo:
                yield sse(lane.answer.echo_chunk())
        tasks = [asyncio.create_task(pump(lane)) for lane in lanes.lanes]
        running = len(tasks)
        while running:
            lane, item = await queue.get()
            if item is None:
                running -= 1
            elif isinstance(item, ServiceError):
                yield sse(oai.from_status(item.code, item.message, item.retry_after_ms).body())
                return
            elif item.WhichOneof("kind") == "complete":
                completes[lane.plan.index] = item.complete
                for chunk in lane.answer.finish_chunks():  # with tools: what was held back
                    yield sse(chunk)
                yield sse(lane.answer.last(item.complete))
            else:
                for chunk in lane.answer.chunks(item.chunk):  # with tools: 0 or more
                    yield sse(chunk)
        if include_usage:
            ordered = [completes[lane.plan.index] for lane in lanes.lanes]
            usage = rpb.Complete(usage=_usage(lanes, ordered))
            yield sse(lanes.lanes[0].answer.usage_chunk(usage))
        yield b"data: [DONE]\n\n"
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await lanes.aclose()  # a client gone: every choice is aborted on its workers


def _usage(lanes: Lanes, completes: Sequence[rpb.Complete]) -> rpb.Usage:
    pairs = zip(lanes.lanes, completes, strict=True)
    return choices.usage([(lane.plan.prompt_index, c.usage) for lane, c in pairs])


async def next_message(messages: Messages) -> rpb.GenerateResponse | None:
    """The next chunk or completion (in-stream Error messages are skipped: the ServiceError
    raised right after carries the same status); None at the end."""
    async for message in messages:
        if message.WhichOneof("kind") != "error":
            return message
    return None


async def first_message(messages: Messages) -> rpb.GenerateResponse | oai.ApiError:
    try:
        message = await next_message(messages)
    except ServiceError as error:
        return oai.from_status(error.code, error.message, error.retry_after_ms)
    if message is None:
        return oai.from_status(grpc.StatusCode.INTERNAL, "the request ended without an answer")
    return message


async def _collect(lane: Lane) -> tuple[JSON, rpb.Complete] | oai.ApiError:
    try:
        message = await lane.next()
        while message is not None:
            if message.WhichOneof("kind") == "complete":
                return lane.answer.whole(message.complete), message.complete
            lane.answer.chunk(message.chunk)
            message = await lane.next()
    except ServiceError as error:
        return oai.from_status(error.code, error.message, error.retry_after_ms)
    return oai.from_status(grpc.StatusCode.INTERNAL, "the request ended without completing")
