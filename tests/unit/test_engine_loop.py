"""EngineLoop.call_until (the decode worker's wait for free KV blocks) on a fake clock,
output_batches (how a request's outputs are coalesced into stream messages), what a failing
step does (an ordinary error aborts its requests, a device error stops the loop), and the
engine thread's CUDA device."""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from tandem.engine.engine import RequestOutput
from tandem.load import Load
from tandem.services.common.worker.engine_loop import EngineLoop, is_device_error, output_batches


class IdleEngine:
    """All EngineLoop asks of an engine with nothing to run."""

    scheduler = SimpleNamespace(waiting=[])
    config = SimpleNamespace(device="cpu")

    def has_unfinished(self) -> bool:
        return False

    def stats(self) -> Load:
        return Load()


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


class SlowAbortingEngine(AbortingEngine):
    """Holds each abort until `go` is set: the asyncio side moves on meanwhile."""

    def __init__(self) -> None:
        super().__init__()
        self.go = threading.Event()

    def abort(self, request_id: str) -> bool:
        assert self.go.wait(5)
        return super().abort(request_id)


def test_an_abort_ends_only_the_stream_it_was_issued_for() -> None:
    """A request that ended and a new one under the same id (a client reusing its ids, a
    prefill lease released just before a retry): the first request's abort, applied on the
    engine after the new stream opened, must not end the new stream (it used to, and the
    new call failed with "the engine step failed")."""
    engine = SlowAbortingEngine()

    async def main() -> None:
        loop = EngineLoop(engine, asyncio.get_running_loop())  # type: ignore[arg-type]
        loop.start()
        try:
            first = loop.open_stream("known")
            loop.abort("known")  # issued for `first`
            loop.close_stream("known")  # that call ends on its own
            second = loop.open_stream("known")  # and the id is taken again
            loop.abort("known")  # issued for `second`, which ends before it lands
            loop.close_stream("known")
            loop.abort("known")  # issued with no stream open: nothing to end
            third = loop.open_stream("known")
            engine.go.set()
            await asyncio.sleep(0.3)
            assert engine.aborted == ["known"] * 3
            assert first.empty() and loop.has_stream("known")
            assert second.empty() and third.empty()
            loop.abort("known")  # issued while `third` is open: it ends `third`
            out = await asyncio.wait_for(third.get(), 5)
            assert out.finish_reason == "abort" and not loop.has_stream("known")
        finally:
            loop.stop()

    asyncio.run(main())


def test_next_output_reports_quiet_without_losing_the_item() -> None:
    from tandem.services.common.worker.engine_loop import Quiet, next_output

    async def main() -> list[Any]:
        q: asyncio.Queue[Any] = asyncio.Queue()
        first = await next_output(q, 0.05)
        q.put_nowait(_out([1]))
        second = await next_output(q, 0.05)
        return [first, second]

    first, second = asyncio.run(main())
    assert first is Quiet.QUIET
    assert second.new_token_ids == [1]


ILLEGAL_ADDRESS = "CUDA error: an illegal memory access was encountered"


@pytest.mark.parametrize(
    ("exc", "device_error"),
    [
        (RuntimeError(ILLEGAL_ADDRESS), True),
        (RuntimeError("CUDA error: device-side assert triggered"), True),
        (RuntimeError("Triton Error [CUDA]: an illegal memory access was encountered"), True),
        (torch.AcceleratorError("an illegal instruction was encountered"), True),
        (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), False),
        (ValueError("need 4 blocks, 2 free"), False),
        (RuntimeError("shape mismatch"), False),
    ],
)
def test_is_device_error(exc: BaseException, device_error: bool) -> None:
    assert is_device_error(exc) is device_error


def test_is_device_error_looks_at_the_cause() -> None:
    try:
        try:
            raise RuntimeError(ILLEGAL_ADDRESS)
        except RuntimeError as inner:
            raise ValueError("sampling failed") from inner
    except ValueError as outer:
        assert is_device_error(outer)


class FailingEngine(IdleEngine):
    """One request that never finishes; each step raises the next of `errors` (then runs)."""

    def __init__(self, errors: list[BaseException]) -> None:
        self.errors = errors
        self.live = {"r1"}
        self.num_steps = 0
        self.num_tokens_computed = 0
        self.last_step_prefill_tokens = 0
        self.scheduler = SimpleNamespace(
            waiting=[], requests=lambda: [SimpleNamespace(request_id=r) for r in self.live]
        )

    def has_unfinished(self) -> bool:
        return bool(self.live)

    def step(self) -> list[RequestOutput]:
        self.num_steps += 1
        if self.errors:
            raise self.errors.pop(0)
        return []

    def abort(self, request_id: str) -> bool:
        self.live.discard(request_id)
        return True


def test_an_ordinary_step_error_aborts_the_requests_and_the_loop_goes_on() -> None:
    engine = FailingEngine([ValueError("bad sampling params")])
    reported: list[BaseException] = []

    async def main() -> tuple[Any, int]:
        loop = EngineLoop(engine, asyncio.get_running_loop(), on_device_error=reported.append)
        r1 = loop.open_stream("r1")
        loop.start()
        try:
            out = await asyncio.wait_for(r1.get(), 5)
            engine.live.add("r2")  # a later request is stepped
            while engine.num_steps < 3:
                await asyncio.sleep(0.01)
            return out, await loop.call(lambda e: e.num_steps)
        finally:
            loop.stop()

    out, steps = asyncio.run(main())
    assert out.request_id == "r1" and out.finish_reason == "abort"
    assert steps >= 3 and reported == []


def test_a_device_error_stops_the_loop_and_reports_it() -> None:
    error = RuntimeError(ILLEGAL_ADDRESS)
    engine = FailingEngine([error])

    async def main() -> tuple[list[BaseException], EngineLoop]:
        reported: asyncio.Queue[BaseException] = asyncio.Queue()
        loop = EngineLoop(engine, asyncio.get_running_loop(), on_device_error=reported.put_nowait)
        loop.start()
        got = [await asyncio.wait_for(reported.get(), 5)]
        loop._thread.join(5)
        assert not loop._thread.is_alive()
        return got, loop

    reported, loop = asyncio.run(main())
    assert reported == [error] and loop.device_error is error
    assert engine.num_steps == 1  # never stepped again
    assert engine.live == {"r1"}  # nothing touched the engine after the fault


def test_the_engine_thread_makes_the_engine_device_current(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[tuple[int, str]] = []
    monkeypatch.setattr(
        torch.cuda, "set_device", lambda d: calls.append((d, threading.current_thread().name))
    )
    for device in ("cuda:1", "cuda", "cpu"):
        engine = IdleEngine()
        engine.config = SimpleNamespace(device=device)
        _run_with_loop_on(engine)
    # A bare "cuda" is the thread's current device already; a CPU engine has none.
    assert calls == [(1, "engine")]


def _run_with_loop_on(engine: Any) -> None:
    async def main() -> None:
        loop = EngineLoop(engine, asyncio.get_running_loop())
        loop.start()
        await loop.call(lambda e: None)
        loop.stop()

    asyncio.run(main())
