"""The fitted model of worker capacity: from a window of samples, what one worker of each
role can carry and what the load demands of it. Pure; `tandem.control.policy` turns these
figures into replica counts.

  prefill  capacity C = tokens/s a worker computes while busy (sum tokens_per_s / sum
           busy_frac over busy samples); demand D = tokens/s computed now plus the queued
           backlog spread over max(TTFT target, prefill_backlog_s).
           want = ceil(D / (C * target_utilization)).
  decode   step time is modelled as step_ms = a + b * batch (least squares over
           (num_running, step_ms) samples); the batch a worker can carry is the largest
           whose predicted step fits the ITL target, scaled by measured / predicted ITL and
           capped by its KV blocks; demand is the number of running + waiting sequences.
           want = ceil(demand / (batch * target_util)), or, with decode_backlog_s > 0, the
           count that generates the token demand (`decode_token_demand`) within that batch
           (`decode_workers_for`). Scale-down always checks the token rate: fewer workers
           run bigger, slower batches, so the same load holds more sequences (Little's law).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

from tandem.control.config import SLA
from tandem.control.samples import WorkerSample

StepModel = tuple[float, float]  # (a, b) of step_ms = a + b * num_running


class PrefillFit(NamedTuple):
    capacity_tps: float | None  # tokens/s one busy worker computes; None without busy samples
    demand_tps: float  # tokens/s the load asks for, backlog included
    busy: float  # mean busy fraction over the samples


@dataclass(frozen=True, slots=True)
class DecodeFit:
    """The decode model over a window. Every field but `demand_seqs` and `waiting` is None
    without a step model (no busy decode sample yet, in this window or before)."""

    step_model: StepModel | None
    demand_seqs: float  # running + waiting sequences, mean over ticks
    waiting: float  # sequences waiting for KV, mean over ticks
    batch_capacity: float | None = None  # sequences per worker within the ITL target
    itl_correction: float | None = None  # measured / predicted ITL the capacity was scaled by
    rate_tps: float | None = None  # tokens/s generated now (None also without samples)
    demand_tps: float | None = None  # token demand, with decode_backlog_s > 0 only
    mean_output_tokens: float | None = None  # of the window's requests, with demand_tps


def _by_tick(samples: Sequence[WorkerSample]) -> list[list[WorkerSample]]:
    ticks: dict[float, list[WorkerSample]] = {}
    for s in samples:
        ticks.setdefault(s.t, []).append(s)
    return [ticks[t] for t in sorted(ticks)]


def workers_for(demand: float, per_worker: float | None, utilization: float) -> int | None:
    """Workers that carry `demand` at `utilization` of `per_worker` each; None when the
    capacity is unknown."""
    if per_worker is None or per_worker <= 0:
        return None
    # The epsilon keeps a demand of exactly k workers' worth from rounding up to k + 1.
    return math.ceil(demand / (per_worker * utilization) - 1e-9)


def fit_prefill(samples: Sequence[WorkerSample], sla: SLA, backlog_s: float = 0.0) -> PrefillFit:
    """Capacity per busy worker, demand (the rate computed plus the queued backlog planned
    to clear within max(TTFT target, backlog_s)) and mean busy fraction."""
    busy = [s for s in samples if s.busy_frac >= 0.05]
    capacity = sum(s.tokens_per_s for s in busy) / sum(s.busy_frac for s in busy) if busy else None
    ticks = _by_tick(samples)
    if not ticks:
        return PrefillFit(capacity, 0.0, 0.0)
    rate = sum(sum(s.tokens_per_s for s in tick) for tick in ticks) / len(ticks)
    backlog = sum(s.queued_prefill_tokens for s in ticks[-1])
    demand = rate + backlog / max(sla.ttft_p90_ms / 1e3, backlog_s)
    mean_busy = sum(s.busy_frac for s in samples) / len(samples)
    return PrefillFit(capacity, demand, mean_busy)


def fit_decode_step(samples: Sequence[WorkerSample]) -> StepModel | None:
    """Least-squares (a, b) of step_ms = a + b * num_running over busy decode samples.

    With a single batch size seen, or a fit that makes no physical sense (b <= 0 or a < 0:
    noise from nearly equal batches), it assumes no fixed cost, a = 0, b = mean step / mean
    batch, which overestimates the per-sequence cost: the safe side for scaling. None when
    idle."""
    points = [(s.num_running, s.step_ms) for s in samples if s.num_running > 0 and s.step_ms > 0]
    if not points:
        return None
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    if sxx > 0:
        b = sum((x - mx) * (y - my) for x, y in points) / sxx
        a = my - b * mx
        if b > 0 and a >= 0:
            return a, b
    return 0.0, my / mx


def fit_decode(
    samples: Sequence[WorkerSample],
    step_model: StepModel | None,
    sla: SLA,
    itl_p90_ms: float | None,
    output_tokens: Sequence[int],
    backlog_s: float,
) -> DecodeFit:
    """The decode model over live decode samples, given the step model (fitted from them,
    or the last good one). `itl_p90_ms` is the measured ITL (None with too few requests),
    `output_tokens` those of the window's multi-token requests."""
    ticks = _by_tick(samples)
    n = len(ticks)
    demand = sum(sum(s.num_running + s.num_waiting for s in t) for t in ticks) / n if n else 0.0
    waiting = sum(sum(s.num_waiting for s in t) for t in ticks) / max(1, n)
    if step_model is None:
        return DecodeFit(None, demand, waiting)
    a, b = step_model
    batch_cap = max(1.0, (sla.itl_p90_ms - a) / b)
    correction = None
    busy = [s for s in samples if s.num_running > 0]
    if busy and itl_p90_ms is not None:
        # What users measured corrects the model: scale the capacity by measured / predicted
        # ITL, bounded to [0.5, 2] so that one noisy window moves it by at most 2x.
        mean_batch = sum(s.num_running for s in busy) / len(busy)
        correction = min(2.0, max(0.5, itl_p90_ms / (a + b * mean_batch)))
        batch_cap = max(1.0, batch_cap / correction)
    kv = [s for s in busy if s.num_blocks > 0]
    if kv:
        per_seq = sum((s.num_blocks - s.num_free_blocks) / s.num_running for s in kv) / len(kv)
        if per_seq > 0:
            batch_cap = min(batch_cap, max(1.0, min(s.num_blocks for s in kv) / per_seq))
    rate = decode_token_rate(ticks, step_model) if ticks else None
    demand_tps = mean_out = None
    if backlog_s > 0 and ticks and output_tokens:
        mean_out = sum(output_tokens) / len(output_tokens)
        demand_tps = decode_token_demand(ticks, step_model, mean_out, backlog_s)
    return DecodeFit(step_model, demand, waiting, batch_cap, correction, rate, demand_tps, mean_out)


def decode_token_rate(ticks: Sequence[Sequence[WorkerSample]], step_model: StepModel) -> float:
    """Tokens/s the decode workers generate, mean over the ticks, from each worker's batch
    and the fitted step time (one token per sequence per step)."""
    a, b = step_model
    total = 0.0
    for tick in ticks:
        total += sum(1e3 * s.num_running / (a + b * s.num_running) for s in tick if s.num_running)
    return total / len(ticks) if ticks else 0.0


def decode_token_demand(
    ticks: Sequence[Sequence[WorkerSample]],
    step_model: StepModel,
    mean_output_tokens: float,
    backlog_s: float,
) -> float:
    """Tokens/s decode has to generate: what it generates now, plus the growth of the
    sequences waiting for KV (arrivals it does not keep up with), plus the waiting
    sequences' tokens spread over `backlog_s`."""
    rate = decode_token_rate(ticks, step_model)
    waiting = sum(s.num_waiting for s in ticks[-1]) if ticks else 0
    if len(ticks) >= 2:
        span = ticks[-1][0].t - ticks[0][0].t
        growth = (waiting - sum(s.num_waiting for s in ticks[0])) / span
        rate += max(0.0, growth) * mean_output_tokens
    return rate + waiting * mean_output_tokens / backlog_s


def decode_workers_for(
    token_rate: float, step_model: StepModel, max_batch: float, waiting: float = 0.0
) -> int:
    """Fewest decode workers that generate `token_rate` tokens/s (and seat `waiting` more
    sequences) with at most `max_batch` sequences each.

    Fewer workers mean bigger batches, slower steps and so more sequences in flight for the
    same rate (Little's law): with step_ms = a + b * B and C sequences on n workers,
    R = 1000 * C / (a + b * C / n), so C(n) = (R * a / 1000) / (1 - R * b / (1000 * n)),
    and n workers cannot keep up at all when R * b / 1000 >= n. Dividing today's sequence
    count by the batch capacity instead predicts that a smaller count fits, shrinks, finds
    the batches grown, and scales back up: an oscillation."""
    a, b = step_model
    n = 1
    while True:
        load = token_rate * b / 1e3 / n
        if load < 1 and (token_rate * a / 1e3 / (1 - load) + waiting) / n <= max_batch + 1e-9:
            return n
        n += 1
