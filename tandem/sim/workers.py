"""Simulated prefill and decode workers: queues, batches, KV blocks and step times.

Both run on the simulator's clock (`Clock.schedule`) and report `WorkerSample`s of the last
stats period. Step times come from a `CostModel`.

Prefill worker: one FCFS queue; a step takes chunks from the head of the queue up to the
token budget (the head request may be split across steps) and lasts
`cost.prefill_step_s(tokens)`. A request whose last chunk is in the step has its first token
when the step ends.

Decode worker, a continuous batch advanced lazily:

    step s0 starts at t0; while the batch is unchanged every step lasts step_s
    |-- s0 --|-- s0+1 --|-- ... --|-- s0+K-1 --|
    t0                                         t0 + K * step_s: wake, apply finishes/joins

Sequences join and leave only at step boundaries. A wake is scheduled at the next boundary
where something changes (the first finish, a join waiting for the boundary) or after at most
`MAX_EPOCH_STEPS` steps, so the step time follows the growing context. Each sequence
produces one token per step; it finishes at `finish_step`. Admission reserves the KV blocks
of the whole sequence (prompt + output) before the KV transfer starts, so nothing is ever
preempted; requests wait FIFO when blocks are short. A colocated request (no prefill worker)
prefills in the first step it joins, which lasts `prefill_step_s(n) - prefill_step_s(0)`
longer for the whole batch.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from tandem.control import WorkerSample
from tandem.sim.cost import CostModel, transfer_s
from tandem.types import Role

MAX_EPOCH_STEPS = 32


class Clock(Protocol):
    now: float

    def schedule(self, t: float, fn: Callable[[Any], None], arg: Any = None) -> None: ...


@dataclass(slots=True, eq=False)
class SimRequest:
    """One request's progress through the cluster (times in seconds)."""

    request_id: int
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    phase: str = ""
    prefill_id: str | None = None
    decode_id: str | None = None
    disaggregated: bool = False
    remaining_prefill: int = 0  # prompt tokens its prefill worker has still to compute
    num_blocks: int = 0  # KV blocks reserved on its decode worker
    first_token_s: float | None = None
    finish_s: float | None = None
    finish_step: int = 0  # decode step at whose start it has all its tokens

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.output_tokens


# Lifecycle of a worker: starting (loading the model, not routable) -> live -> draining
# (routers skip it; it finishes what it holds) -> removed.
STARTING, LIVE, DRAINING, REMOVED = "starting", "live", "draining", "removed"


class Worker:
    role = ""

    def __init__(
        self,
        worker_id: str,
        cost: CostModel,
        clock: Clock,
        created_s: float,
        on_idle: Callable[[Worker], None],
    ) -> None:
        self.worker_id = worker_id
        self.cost = cost
        self.clock = clock
        self.on_idle = on_idle  # called when a draining worker may have emptied
        self.state = STARTING
        self.created_s = created_s
        self.removed_s: float | None = None
        # Stats of the current period.
        self._busy_s = 0.0
        self._tokens = 0.0
        self._step_time_s = 0.0  # prefill: sum of step times; decode: busy-time weighted

    @property
    def load(self) -> int:
        raise NotImplementedError

    def is_empty(self) -> bool:
        raise NotImplementedError

    def report(self, now: float, period_s: float) -> WorkerSample:
        raise NotImplementedError

    def _notify_if_drained(self) -> None:
        if self.state == DRAINING and self.is_empty():
            self.on_idle(self)


class PrefillWorker(Worker):
    role = Role.PREFILL

    def __init__(
        self,
        worker_id: str,
        cost: CostModel,
        clock: Clock,
        created_s: float,
        on_prefilled: Callable[[SimRequest, float], None],
        on_idle: Callable[[Worker], None],
    ) -> None:
        super().__init__(worker_id, cost, clock, created_s, on_idle)
        self.on_prefilled = on_prefilled
        self.queue: deque[SimRequest] = deque()
        self.queued_tokens = 0  # uncomputed prompt tokens of everything queued
        self._step: list[tuple[SimRequest, int]] | None = None
        self._busy_since: float | None = None
        self._num_steps = 0

    @property
    def load(self) -> int:
        return self.queued_tokens

    def is_empty(self) -> bool:
        return not self.queue and self._step is None

    def submit(self, req: SimRequest) -> None:
        req.remaining_prefill = req.prompt_tokens
        self.queue.append(req)
        self.queued_tokens += req.prompt_tokens
        if self._step is None:
            self._start_step(self.clock.now)

    def _start_step(self, now: float) -> None:
        budget = self.cost.prefill_token_budget
        chunks: list[tuple[SimRequest, int]] = []
        for req in self.queue:
            n = min(req.remaining_prefill, budget)
            chunks.append((req, n))
            budget -= n
            if budget == 0:
                break
        self._step = chunks
        if self._busy_since is None:
            self._busy_since = now
        dt = self.cost.prefill_step_s(sum(n for _, n in chunks))
        self.clock.schedule(now + dt, self._on_step_done, dt)

    def _on_step_done(self, dt: float) -> None:
        now = self.clock.now
        assert self._step is not None
        done = 0
        for req, n in self._step:
            req.remaining_prefill -= n
            done += n
        self.queued_tokens -= done
        self._tokens += done
        self._step_time_s += dt
        self._num_steps += 1
        finished = []
        while self.queue and self.queue[0].remaining_prefill == 0:
            finished.append(self.queue.popleft())
        self._step = None
        if self.queue:
            self._start_step(now)
        else:
            assert self._busy_since is not None
            self._busy_s += now - self._busy_since
            self._busy_since = None
        for req in finished:
            self.on_prefilled(req, now)
        self._notify_if_drained()

    def report(self, now: float, period_s: float) -> WorkerSample:
        if self._busy_since is not None:
            self._busy_s += now - self._busy_since
            self._busy_since = now
        running = len(self._step) if self._step is not None else 0
        sample = WorkerSample(
            t=now,
            worker_id=self.worker_id,
            role=Role.PREFILL,
            busy_frac=min(1.0, self._busy_s / period_s),
            tokens_per_s=self._tokens / period_s,
            step_ms=1e3 * self._step_time_s / self._num_steps if self._num_steps else 0.0,
            num_running=running,
            num_waiting=len(self.queue) - running,
            queued_prefill_tokens=self.queued_tokens,
            draining=self.state == DRAINING,
        )
        self._busy_s = self._tokens = self._step_time_s = 0.0
        self._num_steps = 0
        return sample

    def check_integrity(self) -> None:
        assert self.queued_tokens == sum(r.remaining_prefill for r in self.queue)
        assert all(r.remaining_prefill > 0 for r in self.queue)


class DecodeWorker(Worker):
    role = Role.DECODE

    def __init__(
        self,
        worker_id: str,
        cost: CostModel,
        clock: Clock,
        created_s: float,
        on_finished: Callable[[SimRequest, float], None],
        on_idle: Callable[[Worker], None],
    ) -> None:
        super().__init__(worker_id, cost, clock, created_s, on_idle)
        self.on_finished = on_finished
        self.num_blocks = cost.num_kv_blocks
        self.free_blocks = self.num_blocks
        self.waiting: deque[SimRequest] = deque()  # for KV blocks
        self.transferring: dict[int, SimRequest] = {}
        self.pending: deque[SimRequest] = deque()  # KV in place, join at the next boundary
        self._batch: list[tuple[int, int, SimRequest]] = []  # heap of (finish_step, id, req)
        self.context = 0  # tokens the batch attends over at step `step`
        self.step = 0
        self.t0 = 0.0
        self.step_s = 0.0  # 0 while idle
        self._wake_at: float | None = None
        self._wake_version = 0
        self._acc_t = created_s
        # Decode cost's own prefill share, for colocated prompts (see module docstring).
        self._prefill_base_s = cost.prefill_step_s(0)

    @property
    def batch_size(self) -> int:
        return len(self._batch)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + len(self.transferring) + len(self.pending)

    @property
    def load(self) -> int:
        return self.batch_size + self.num_waiting

    def is_empty(self) -> bool:
        return not (self._batch or self.waiting or self.transferring or self.pending)

    def admit(self, req: SimRequest) -> None:
        """A request arrives with its first token (disaggregated: its KV is on the prefill
        worker) or with only its prompt (colocated)."""
        req.num_blocks = -(-req.total_tokens // self.cost.block_size)
        assert req.num_blocks <= self.num_blocks, "the caller rejects oversized requests"
        self.waiting.append(req)
        self._admit_waiting(self.clock.now)

    def _admit_waiting(self, now: float) -> None:
        while self.waiting and self.waiting[0].num_blocks <= self.free_blocks:
            req = self.waiting.popleft()
            self.free_blocks -= req.num_blocks
            if req.disaggregated:
                self.transferring[req.request_id] = req
                self.clock.schedule(
                    now + transfer_s(self.cost, req.prompt_tokens), self._on_transferred, req
                )
            else:
                self._join(req, now)

    def _on_transferred(self, req: SimRequest) -> None:
        del self.transferring[req.request_id]
        self._join(req, self.clock.now)

    def _join(self, req: SimRequest, now: float) -> None:
        self.pending.append(req)
        if not self._batch:
            if self._wake_at is None:
                self._schedule_wake(now, 0)
            return
        # Busy: join at the end of the step in progress.
        k = math.floor((now - self.t0) / self.step_s) + 1 if now >= self.t0 else 1
        t_b = self.t0 + k * self.step_s
        if self._wake_at is None or t_b < self._wake_at:
            self._schedule_wake(t_b, k)

    def _schedule_wake(self, t: float, k: int) -> None:
        self._wake_version += 1
        self._wake_at = t
        self.clock.schedule(t, self._on_wake, (self._wake_version, k))

    def _accrue(self, now: float) -> None:
        dt = now - self._acc_t
        if self._batch and dt > 0:
            self._busy_s += dt
            self._tokens += dt * len(self._batch) / self.step_s
            self._step_time_s += dt * self.step_s
        self._acc_t = now

    def _on_wake(self, arg: tuple[int, int]) -> None:
        version, k = arg
        if version != self._wake_version:
            return
        now = self.clock.now
        self._wake_at = None
        self._accrue(now)
        batch = self._batch
        if batch:
            self.step += k
            self.context += len(batch) * k
        self.t0 = now
        while batch and batch[0][0] <= self.step:
            _, _, req = heapq.heappop(batch)
            assert batch is self._batch and req.finish_step == self.step
            self.context -= req.total_tokens
            self.free_blocks += req.num_blocks
            req.finish_s = now
            self.on_finished(req, now)
        self._admit_waiting(now)
        colocated: list[SimRequest] = []
        while self.pending and len(batch) < self.cost.max_num_seqs:
            req = self.pending.popleft()
            if req.disaggregated:  # token 1 came from the prefill worker
                req.finish_step = self.step + req.output_tokens - 1
                self.context += req.prompt_tokens + 1
            else:
                req.finish_step = self.step + req.output_tokens
                self.context += req.prompt_tokens
                colocated.append(req)
            heapq.heappush(batch, (req.finish_step, req.request_id, req))
        if not batch:
            self.step_s = 0.0
            self._notify_if_drained()
            return
        self.step_s = self.cost.decode_step_s(len(batch), self.context)
        if colocated:
            extra = self.cost.prefill_step_s(sum(r.prompt_tokens for r in colocated))
            self.t0 = now + max(0.0, extra - self._prefill_base_s)
            for req in colocated:
                req.first_token_s = self.t0 + self.step_s
        steps = min(batch[0][0] - self.step, MAX_EPOCH_STEPS)
        assert steps >= 1
        self._schedule_wake(self.t0 + steps * self.step_s, steps)

    def report(self, now: float, period_s: float) -> WorkerSample:
        self._accrue(now)
        sample = WorkerSample(
            t=now,
            worker_id=self.worker_id,
            role=Role.DECODE,
            busy_frac=min(1.0, self._busy_s / period_s),
            tokens_per_s=self._tokens / period_s,
            step_ms=1e3 * self._step_time_s / self._busy_s if self._busy_s > 0 else 0.0,
            num_running=self.batch_size,
            num_waiting=self.num_waiting,
            num_blocks=self.num_blocks,
            num_free_blocks=self.free_blocks,
            draining=self.state == DRAINING,
        )
        self._busy_s = self._tokens = self._step_time_s = 0.0
        return sample

    def check_integrity(self) -> None:
        """Blocks: free + reserved == total; the batch's context matches its sequences."""
        held = (
            [r for _, _, r in self._batch] + list(self.pending) + list(self.transferring.values())
        )
        reserved = sum(r.num_blocks for r in held)
        assert self.free_blocks + reserved == self.num_blocks, (self.free_blocks, reserved)
        assert 0 <= self.free_blocks <= self.num_blocks
        expected = sum(r.total_tokens - (r.finish_step - self.step) for _, _, r in self._batch)
        assert self.context == expected, (self.context, expected)
