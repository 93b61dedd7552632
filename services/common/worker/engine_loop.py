"""Runs an LLMEngine on its own thread and connects it to asyncio code.

The engine is single-threaded by design. gRPC handlers (on the asyncio loop) never touch it
directly: they send commands (`call`) that run between steps on the engine thread, and they
receive each request's outputs on an asyncio queue. When the engine has no work the thread
sleeps on its command queue, so an idle worker costs no CPU.

A step that raises aborts its requests and the loop goes on, except for a device error (an
illegal address, a device-side assert): the CUDA context is then unusable for good and every
later step would fail too, so the thread stops and hands the error to `on_device_error` (the
worker reports NOT_SERVING, deregisters and exits; the router moves its requests).
"""

from __future__ import annotations

import asyncio
import enum
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from typing import Any, TypeVar

import torch

from tandem.engine.device import use_device
from tandem.engine.engine import LLMEngine, RequestOutput
from tandem.engine.footprint import StateSize
from tandem.load import Load
from tandem.routing.stall import HopProgress
from tandem.services.common.observe.metrics import WorkerMetrics
from tandem.types import FinishReason

T = TypeVar("T")
log = logging.getLogger(__name__)
# What CUDA and Triton put in the messages of errors that leave the context broken.
DEVICE_ERROR_MARKERS = (
    "CUDA error",
    "Triton Error [CUDA]",
    "device-side assert",
    "illegal memory access",
    "unspecified launch failure",
)


def is_device_error(exc: BaseException) -> bool:
    """Did the accelerator fail (its context is unusable), rather than this step? torch's
    AcceleratorError and torch.cuda.CudaError, or an error naming a CUDA fault, in `exc` or
    what it was raised from. Out of memory is not one: the step failed, the device is fine."""
    seen: BaseException | None = exc
    while seen is not None:
        if isinstance(seen, torch.OutOfMemoryError):
            return False
        if isinstance(seen, (torch.AcceleratorError, torch.cuda.CudaError)):
            return True
        if any(marker in str(seen) for marker in DEVICE_ERROR_MARKERS):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


class StepMeter:
    """Rolling load figures of the engine thread over the last `period_s`: the fraction of
    time spent in steps, tokens computed per second and the mean step time, and the prefill
    rate admission plans with (below). Written by the engine thread, read by the heartbeat
    (a lock keeps the two consistent).

    The prefill rate is prompt tokens per second of the steps that computed prompts, and the
    one reported is the slowest measured over the last `rate_horizon_s`: admission promises
    a delay, so it plans with the pessimistic rate. A worker slows at once when something
    takes its CPU or memory bandwidth (a decode batch beside it on a small host, a noisy
    neighbour) and is trusted to be fast again only once the slow spell has aged out; the
    overload soak admitted 12 documents on a rate measured while the decode worker beside it
    was still idle, and they waited 190 s against a 120 s limit. While no step measures one
    (idle), the last measured rate is kept, so an idle worker still knows its speed."""

    def __init__(
        self,
        period_s: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
        rate_horizon_s: float = 60.0,
    ):
        if period_s <= 0:
            raise ValueError(f"period_s must be > 0, got {period_s}")
        self.period_s = period_s
        self.rate_horizon_s = rate_horizon_s
        self._clock = clock
        self._started = clock()
        # (end, duration_s, tokens, prompt tokens)
        self._steps: deque[tuple[float, float, int, int]] = deque()
        self._lock = threading.Lock()
        self._rates: deque[tuple[float, float]] = deque()  # (when, prompt tokens per s)

    def record(self, duration_s: float, num_tokens: int, num_prefill_tokens: int = 0) -> None:
        with self._lock:
            self._steps.append((self._clock(), duration_s, num_tokens, num_prefill_tokens))

    def seed_prefill_rate(self, tokens_per_s: float) -> None:
        """A rate to report until steps measure one (the warm-up's)."""
        with self._lock:
            if not self._rates and tokens_per_s > 0:
                self._rates.append((self._clock(), tokens_per_s))

    def prefill_tokens_per_s(self) -> float:
        """The slowest prompt rate measured within `rate_horizon_s` (the latest one when
        none is that recent); 0 until one was seen."""
        self.read()  # drops steps older than the window
        now = self._clock()
        with self._lock:
            steps = [(dur, n) for _, dur, _, n in self._steps if n > 0]
            busy = sum(dur for dur, _ in steps)
            if steps and busy > 0:
                self._rates.append((now, sum(n for _, n in steps) / busy))
            while len(self._rates) > 1 and self._rates[0][0] < now - self.rate_horizon_s:
                self._rates.popleft()
            return min((rate for _, rate in self._rates), default=0.0)

    def read(self) -> tuple[float, float, float]:
        """(busy fraction in [0, 1], tokens per second, mean step ms; 0 when idle)."""
        now = self._clock()
        start = now - self.period_s
        with self._lock:
            while self._steps and self._steps[0][0] <= start:
                self._steps.popleft()
            steps = list(self._steps)
        span = min(self.period_s, max(now - self._started, 1e-3))
        # A step that began before the window counts only its part inside it.
        busy = sum(min(dur, end - start) for end, dur, _, _ in steps)
        tokens = sum(n for _, _, n, _ in steps)
        step_ms = 1e3 * sum(dur for _, dur, _, _ in steps) / len(steps) if steps else 0.0
        return min(1.0, busy / span), tokens / span, step_ms


# Outputs of one request; None marks the end of its stream (finished, handed off, aborted).
OutputQueue = asyncio.Queue[RequestOutput | None]


class EngineLoop:
    def __init__(
        self,
        engine: LLMEngine,
        loop: asyncio.AbstractEventLoop,
        metrics: WorkerMetrics | None = None,
        on_device_error: Callable[[BaseException], None] | None = None,
    ) -> None:
        self.engine = engine
        self.loop = loop
        self.metrics = metrics  # step time, queue time, prefix-cache tokens (after each step)
        # Called on the asyncio loop once a step failed with a device error (the engine
        # thread has stopped by then).
        self.on_device_error = on_device_error
        self.device_error: BaseException | None = None
        self._commands: queue.SimpleQueue[tuple[Callable[[LLMEngine], Any], Future[Any]]] = (
            queue.SimpleQueue()
        )
        self._streams: dict[str, OutputQueue] = {}
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._stopping = False
        self._idle_hooks: list[Callable[[LLMEngine], None]] = []
        self.num_steps = 0
        self.last_step_s = 0.0
        self.meter = StepMeter()
        # Published by the engine thread after every turn, read anywhere without waiting for
        # a step: load figures (GetStats, heartbeats) and queue positions (progress).
        self.snapshot: Load = engine.stats()
        self._positions: dict[str, int] = {}

    def footprint(self) -> dict[str, StateSize]:
        """The loop's per-request structures (tandem.engine.footprint)."""
        return {
            "output_streams": StateSize(len(self._streams), None),
            "queue_positions": StateSize(len(self._positions), None),
        }

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopping = True
        self._commands.put((lambda e: None, Future()))
        self._thread.join(timeout=10)

    def add_hook(self, hook: Callable[[LLMEngine], None]) -> None:
        """Run `hook(engine)` on the engine thread every loop turn (e.g. lease expiry)."""
        self._idle_hooks.append(hook)

    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run fn(engine) on the engine thread between steps; its exception propagates."""
        fut: Future[T] = Future()
        self._commands.put((fn, fut))
        return await asyncio.wrap_future(fut)

    def abort(self, request_id: str) -> None:
        """Stop `request_id` wherever it is and free its blocks, without waiting for the
        engine: the command cannot be cancelled (an abort is never lost to its caller's
        deadline), and the stream open for the request now, if any, ends with an "abort"
        output. Asyncio loop only. A stream opened later under the same id (a new request
        reusing it once this one ended) is not this abort's to end."""
        stream = self._streams.get(request_id)

        def run(engine: LLMEngine) -> None:
            if engine.abort(request_id) and stream is not None:
                self.loop.call_soon_threadsafe(self._end_aborted, request_id, stream)

        self.post(run)

    def _end_aborted(self, request_id: str, stream: OutputQueue) -> None:
        if self._streams.get(request_id) is not stream:
            return  # that call ended; the id's stream now, if any, is another call's
        del self._streams[request_id]
        stream.put_nowait(_aborted(request_id))
        stream.put_nowait(None)

    async def hand_off(self, request_id: str) -> bool:
        """Decode role, draining: hand a decoding request off (`LLMEngine.hand_off_running`);
        its stream gets the handed-off output and ends. False: not now (not decoding)."""

        def run(engine: LLMEngine) -> bool:
            out = engine.hand_off_running(request_id)
            if out is not None:
                self.loop.call_soon_threadsafe(self._dispatch, [out])
            return out is not None

        return await self.call(run)

    def has_stream(self, request_id: str) -> bool:
        return request_id in self._streams

    def progress(self, request_id: str) -> HopProgress:
        """Where a request stands, from the last published state (no engine wait)."""
        request = self.engine.get_request(request_id)
        return HopProgress(
            queue_position=self._positions.get(request_id, 0),
            computed_tokens=request.num_computed_tokens if request is not None else 0,
            engine_steps=self.num_steps,
        )

    def post(self, fn: Callable[[LLMEngine], Any]) -> None:
        """Run fn(engine) on the engine thread between steps, without waiting for it
        (errors are logged). For bookkeeping that must not wait out a long step."""
        fut: Future[Any] = Future()
        fut.add_done_callback(_log_failure)
        self._commands.put((fn, fut))

    async def call_until(
        self,
        fn: Callable[[LLMEngine], T | None],
        timeout_s: float,
        poll_s: float = 0.01,
        clock: Callable[[], float] = time.monotonic,
    ) -> T | None:
        """Run `fn` between steps until it returns something other than None (then return
        that), retrying every `poll_s` for up to `timeout_s`; None when time ran out. For
        waits on engine state that steps change, such as free KV blocks."""
        deadline = clock() + timeout_s
        while True:
            result = await self.call(fn)
            if result is not None or clock() > deadline:
                return result
            await asyncio.sleep(poll_s)

    def open_stream(self, request_id: str) -> OutputQueue:
        """The queue that will receive `request_id`'s outputs (open before adding it).
        Raises KeyError when a stream of that id is open: one call never takes over
        another's outputs."""
        if request_id in self._streams:
            raise KeyError(request_id)
        q: OutputQueue = asyncio.Queue()
        self._streams[request_id] = q
        return q

    def close_stream(self, request_id: str) -> None:
        self._streams.pop(request_id, None)

    # -- engine thread -------------------------------------------------------------------

    def _run(self) -> None:
        engine = self.engine
        # Triton launches and graph captures go to the thread's current CUDA device.
        use_device(engine.config.device)
        while not self._stopping:
            block = not engine.has_unfinished()
            try:
                # Idle: wait for a command (with a timeout so hooks still run).
                self._run_command(*self._commands.get(block=block, timeout=0.05))
                while True:  # then drain whatever else is queued
                    self._run_command(*self._commands.get_nowait())
            except queue.Empty:
                pass
            for hook in self._idle_hooks:
                try:
                    hook(engine)
                except Exception:
                    log.exception("engine hook failed")
            self._publish()
            if self._stopping or not engine.has_unfinished():
                continue
            t0 = time.perf_counter()
            tokens_before = engine.num_tokens_computed
            try:
                outputs = engine.step()
            except Exception as exc:
                if is_device_error(exc):
                    log.critical("engine step failed with a device error", exc_info=True)
                    self._fail(exc)
                    return
                log.exception("engine step failed; aborting its requests")
                outputs = self._abort_all()
            self.last_step_s = time.perf_counter() - t0
            self.num_steps += 1
            self.meter.record(
                self.last_step_s,
                engine.num_tokens_computed - tokens_before,
                engine.last_step_prefill_tokens,
            )
            if self.metrics is not None:
                self.metrics.after_step(engine, self.last_step_s)
            # Before the outputs reach their streams: a client that has its reply sees
            # stats (GetStats, heartbeats) that count it.
            self._publish()
            if outputs:
                self.loop.call_soon_threadsafe(self._dispatch, outputs)

    def _publish(self) -> None:
        engine = self.engine
        self.snapshot = engine.stats()
        waiting = engine.scheduler.waiting
        self._positions = {r.request_id: i + 1 for i, r in enumerate(waiting)} if waiting else {}

    def _run_command(self, fn: Callable[[LLMEngine], Any], fut: Future[Any]) -> None:
        if not fut.set_running_or_notify_cancel():
            return
        try:
            fut.set_result(fn(self.engine))
        except BaseException as exc:  # handed to the awaiting coroutine
            fut.set_exception(exc)

    def _fail(self, exc: BaseException) -> None:
        """Stop for good after a device error: refuse the queued commands (nothing may touch
        the broken context again) and report it on the asyncio loop."""
        self.device_error = exc
        self._stopping = True
        error = RuntimeError(f"the engine stopped after a device error: {exc}")
        while True:
            try:
                _, fut = self._commands.get_nowait()
            except queue.Empty:
                break
            if fut.set_running_or_notify_cancel():
                fut.set_exception(error)
        if self.on_device_error is not None:
            self.loop.call_soon_threadsafe(self.on_device_error, exc)

    def _abort_all(self) -> list[RequestOutput]:
        outputs = []
        for r in list(self.engine.scheduler.requests()):
            self.engine.abort(r.request_id)
            outputs.append(_aborted(r.request_id))
        return outputs

    # -- asyncio loop ----------------------------------------------------------------------

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            q = self._streams.get(out.request_id)
            if q is None:
                continue
            q.put_nowait(out)
            if out.finished or out.handed_off:
                q.put_nowait(None)
                self._streams.pop(out.request_id, None)


def _aborted(request_id: str) -> RequestOutput:
    return RequestOutput(
        request_id=request_id,
        new_token_ids=[],
        new_text="",
        finished=True,
        finish_reason=FinishReason.ABORT,
    )


def _log_failure(fut: Future[Any]) -> None:
    if not fut.cancelled() and fut.exception() is not None:
        log.error("posted engine command failed", exc_info=fut.exception())


class Quiet(enum.Enum):
    """`next_output` waited its time without an item."""

    QUIET = 0


async def next_output(stream: OutputQueue, wait_s: float | None) -> RequestOutput | None | Quiet:
    """The stream's next item (an output, or None at its end); Quiet.QUIET when `wait_s`
    passed without one (the caller reports progress, then waits again). No item is lost to
    the timeout: a cancelled `Queue.get` takes nothing."""
    if not stream.empty() or wait_s is None:
        return await stream.get()
    try:
        return await asyncio.wait_for(stream.get(), wait_s)
    except TimeoutError:
        return Quiet.QUIET


async def output_batches(
    stream: OutputQueue, heartbeat_s: float | None = None
) -> AsyncIterator[list[RequestOutput]]:
    """A request's outputs in batches: each waits for one output, then takes every output
    already queued behind it, up to the finishing one. Tokens that piled up while the client
    was slow (or the event loop busy) so travel as one message; per-message cost dominates.
    With `heartbeat_s`, an empty batch every `heartbeat_s` without output (waiting in the
    queue, preempted): the caller reports progress."""
    while True:
        out = await next_output(stream, heartbeat_s)
        if isinstance(out, Quiet):
            yield []
            continue
        if out is None:
            return
        batch = [out]
        while not out.finished and not stream.empty():
            nxt = stream.get_nowait()
            if nxt is None:
                yield batch
                return
            out = nxt
            batch.append(out)
        yield batch
        if out.finished:
            return
