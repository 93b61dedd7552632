"""EngineLoop.call_until (the decode worker's wait for free KV blocks) on a fake clock, and
output_batches (how a request's outputs are coalesced into stream messages)."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

from services.common.worker.engine_loop import EngineLoop, output_batches
from tandem.engine.engine import EngineStats, RequestOutput


class IdleEngine:
    """All EngineLoop asks of an engine with nothing to run."""

    scheduler = SimpleNamespace(waiting=[])

    def has_unfinished(self) -> bool:
        return False

    def stats(self) -> EngineStats:
        return EngineStats(0, 0, 0, 0, 0, 0)


def _run_with_loop(body: Any) -> Any:
    async def main() -> Any:
        loop = EngineLoop(IdleEngine(), asyncio.get_running_loop())  # type: ignore[arg-type]
        loop.start()
        try:
            return await body(loop)
        finally:
            loop.stop()

    return asyncio.run(main())


def test_call_until_returns_the_first_answer_and_stops_asking() -> None:
    answers = iter([None, None, (3, 7), (9, 9)])
    calls: list[int] = []

    def reserve(engine: Any) -> tuple[int, int] | None:
        calls.append(1)
        return next(answers)

    got = _run_with_loop(lambda loop: loop.call_until(reserve, 10.0, poll_s=0))
    assert got == (3, 7) and len(calls) == 3


def test_call_until_gives_up_once_the_clock_passes_the_deadline() -> None:
    now = [50.0]
    calls: list[float] = []

    def clock() -> float:
        return now[0]

    def never(engine: Any) -> None:
        calls.append(now[0])
        now[0] += 1.0  # every try takes a second of the fake clock

    got = _run_with_loop(lambda loop: loop.call_until(never, 2.5, poll_s=0, clock=clock))
    # Tries at 50, 51, 52; after the third the clock reads 53 > 52.5: give up.
    assert got is None and calls == [50.0, 51.0, 52.0]


def _out(tokens: list[int], finished: bool = False) -> RequestOutput:
    return RequestOutput("r", tokens, "", finished, "stop" if finished else None)


def test_output_batches_coalesce_what_is_queued_and_end_at_the_finish() -> None:
    async def main() -> list[list[list[int]]]:
        q: asyncio.Queue[RequestOutput | None] = asyncio.Queue()
        for item in (_out([1]), _out([2]), _out([3], finished=True), None):
            q.put_nowait(item)
        return [[o.new_token_ids for o in batch] async for batch in output_batches(q)]

    assert asyncio.run(main()) == [[[1], [2], [3]]]


def test_output_batches_stop_at_the_end_of_stream_marker() -> None:
    async def main() -> list[list[list[int]]]:
        q: asyncio.Queue[RequestOutput | None] = asyncio.Queue()
        batches = []
        q.put_nowait(_out([1]))
        stream = output_batches(q)
        batches.append([o.new_token_ids for o in await anext(stream)])
        q.put_nowait(_out([2]))
        q.put_nowait(None)  # aborted: no finishing output
        batches.extend([[o.new_token_ids for o in b] async for b in stream])
        return batches

    assert asyncio.run(main()) == [[[1]], [[2]]]


class AbortingEngine(IdleEngine):
    def __init__(self) -> None:
        self.aborted: list[str] = []

    def abort(self, request_id: str) -> bool:
        self.aborted.append(request_id)
        return request_id == "known"


def test_abort_runs_on_the_engine_and_ends_the_open_stream_with_abort() -> None:
    engine = AbortingEngine()

    async def main() -> list[Any]:
        loop = EngineLoop(engine, asyncio.get_running_loop())  # type: ignore[arg-type]
        loop.start()
        try:
            known, other = loop.open_stream("known"), loop.open_stream("other")
            loop.abort("known")  # returns at once: nothing to await, nothing to cancel
            loop.abort("unknown")
            got = [await asyncio.wait_for(known.get(), 5), await asyncio.wait_for(known.get(), 5)]
            await asyncio.sleep(0.2)
            assert other.empty() and loop.has_stream("other") and not loop.has_stream("known")
            return got
        finally:
            loop.stop()

    out, end = asyncio.run(main())
    assert out.finished and out.finish_reason == "abort" and out.request_id == "known"
    assert end is None
    assert engine.aborted == ["known", "unknown"]


def test_next_output_reports_quiet_without_losing_the_item() -> None:
    from services.common.worker.engine_loop import Quiet, next_output

    async def main() -> list[Any]:
        q: asyncio.Queue[Any] = asyncio.Queue()
        first = await next_output(q, 0.05)
        q.put_nowait(_out([1]))
        second = await next_output(q, 0.05)
        return [first, second]

    first, second = asyncio.run(main())
    assert first is Quiet.QUIET
    assert second.new_token_ids == [1]
