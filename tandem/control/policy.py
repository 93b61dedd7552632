"""The P:D ratio policy: how many prefill and decode workers the load needs. Pure.

`decide(observation, config, state) -> (Decision, state)`; the controller service calls it
every `interval_s` with a sliding window of what workers and routers reported, and applies
the decision through an actuator. Nothing here reads a clock or does I/O, so scenario tests
drive it with plain data and the simulator reuses it unchanged.

The model, per role, fitted from the window:

  prefill  capacity C = tokens/s a worker computes while busy (sum tokens_per_s / sum
           busy_frac over busy samples); demand D = tokens/s computed now plus the queued
           backlog spread over max(TTFT target, prefill_backlog_s).
           want = ceil(D / (C * target_utilization)).
  decode   step time is modelled as step_ms = a + b * batch (least squares over
           (num_running, step_ms) samples); the batch a worker can carry is the largest
           whose predicted step fits the ITL target, capped by its KV blocks; demand is the
           number of running + waiting sequences. want = ceil(demand / (batch * target_util)),
           or, with decode_backlog_s > 0, the count that generates the token demand
           (`decode_token_demand`) within that batch (`decode_workers_for`). Scale-down
           always checks the token rate: fewer workers run bigger, slower batches, so the
           same load holds more sequences (Little's law).

Then corrections from what users saw: the fitted decode model is scaled by measured / predicted
ITL, and a TTFT (ITL) p90 above the SLA while prefill (decode) is busy asks for one more worker
even if the model is content.

Turning `want` into a replica count, per role:
  - bounds: [min, max] always;
  - up: at once, at most `max_step` per decision, not within `scale_up_cooldown_s` of the
    role's last change;
  - down: only when even a stricter utilization target (target * (1 - hysteresis)) would
    need fewer workers, continuously for `scale_down_stable_s`, at most `max_down_step`
    workers at a time (default 1), not within `scale_down_cooldown_s` of the last change,
    and only when no worker of the role is still draining from the previous scale-down.
A short burst therefore scales up and stays up until the load has been low for a while, and
input that flaps between high and low does not make the count oscillate.

An operator can pin a ratio (`ControlState.pinned`); the policy then holds it (within bounds)
and reports why.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

ROLES = ("prefill", "decode")


@dataclass(frozen=True, slots=True)
class SLA:
    """Latency targets, in milliseconds, at the 90th percentile."""

    ttft_p90_ms: float = 2000.0
    itl_p90_ms: float = 200.0

    def __post_init__(self) -> None:
        for name in ("ttft_p90_ms", "itl_p90_ms"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")

    def met(self, ttft_ms: float, itl_ms: float) -> bool:
        """Whether one request met both targets: its TTFT, and its mean inter-token latency
        (0 for a single-token output)."""
        return ttft_ms <= self.ttft_p90_ms and itl_ms <= self.itl_p90_ms


@dataclass(frozen=True, slots=True)
class ControlConfig:
    """Policy knobs (controller flags of the same names).

    Attributes:
        min_prefill, max_prefill, min_decode, max_decode: replica bounds per role.
        target_utilization: fraction of a worker's fitted capacity to plan for (headroom
            for bursts and for the model's error).
        hysteresis: scale down only if demand fits under target_utilization * (1 - this).
        scale_up_cooldown_s, scale_down_cooldown_s: minimum time since the role's last
            change before the next scale-up / scale-down.
        scale_down_stable_s: how long the load must stay low before a scale-down.
        max_step: most workers added to one role per decision.
        min_requests: requests needed in the window before SLA percentiles are trusted.
        prefill_backlog_s: queued prefill tokens are planned to clear within
            max(TTFT target, this); 0 keeps the TTFT target. A worker added now serves only
            after it has started, so clearing a burst's queue within the TTFT target is
            not something added workers can do; asking for it overshoots.
        decode_backlog_s: 0 sizes decode scale-up by sequences (running + waiting over
            the batch capacity). > 0 sizes it by token rate (see `decode_token_demand`):
            sequences waiting for KV are planned to be served within this many seconds
            instead of all being seated at once.
        max_down_step: most workers removed from one role per decision.
    """

    min_prefill: int = 1
    max_prefill: int = 8
    min_decode: int = 1
    max_decode: int = 8
    target_utilization: float = 0.7
    hysteresis: float = 0.2
    scale_up_cooldown_s: float = 30.0
    scale_down_cooldown_s: float = 120.0
    scale_down_stable_s: float = 60.0
    max_step: int = 2
    min_requests: int = 20
    prefill_backlog_s: float = 0.0
    decode_backlog_s: float = 0.0
    max_down_step: int = 1

    def __post_init__(self) -> None:
        for role in ROLES:
            lo, hi = self.bounds(role)
            if not 0 <= lo <= hi or hi < 1:
                raise ValueError(f"need 0 <= min_{role} <= max_{role} and max >= 1, got {lo}, {hi}")
        if self.min_decode < 1:
            raise ValueError(
                f"min_decode must be >= 1 (decode serves every request), got {self.min_decode}"
            )
        if not 0 < self.target_utilization <= 1:
            raise ValueError(f"target_utilization must be in (0, 1], got {self.target_utilization}")
        if not 0 <= self.hysteresis < 1:
            raise ValueError(f"hysteresis must be in [0, 1), got {self.hysteresis}")
        for name in ("scale_up_cooldown_s", "scale_down_cooldown_s", "scale_down_stable_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.max_step < 1:
            raise ValueError(f"max_step must be >= 1, got {self.max_step}")
        if self.min_requests < 1:
            raise ValueError(f"min_requests must be >= 1, got {self.min_requests}")
        for name in ("prefill_backlog_s", "decode_backlog_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.max_down_step < 1:
            raise ValueError(f"max_down_step must be >= 1, got {self.max_down_step}")

    def bounds(self, role: str) -> tuple[int, int]:
        if role == "prefill":
            return self.min_prefill, self.max_prefill
        return self.min_decode, self.max_decode


@dataclass(frozen=True, slots=True)
class WorkerSample:
    """One worker's heartbeat stats at time `t` (seconds, any monotonic origin).

    busy_frac: fraction of the last stats period the engine spent in steps.
    tokens_per_s: tokens computed per second over that period (prefill: prompt tokens;
        decode: generated tokens plus prompt tokens it prefilled itself).
    step_ms: mean step time over the period (0 when idle).
    """

    t: float
    worker_id: str
    role: str
    busy_frac: float = 0.0
    tokens_per_s: float = 0.0
    step_ms: float = 0.0
    num_running: int = 0
    num_waiting: int = 0
    queued_prefill_tokens: int = 0
    num_blocks: int = 0
    num_free_blocks: int = 0
    draining: bool = False


@dataclass(frozen=True, slots=True)
class RequestSample:
    """One finished request as the router timed it."""

    t: float
    ttft_ms: float
    itl_ms: float  # mean inter-token latency after the first token; 0 for 1-token outputs
    prompt_tokens: int
    output_tokens: int
    cached_tokens: int = 0
    disaggregated: bool = False


@dataclass(frozen=True, slots=True)
class Observation:
    """What the controller knows at time `now`: the replica counts it last asked for, and
    the samples of the window (older ones are the caller's to drop)."""

    now: float
    replicas: dict[str, int]
    workers: Sequence[WorkerSample] = ()
    requests: Sequence[RequestSample] = ()
    sla: SLA = SLA()


@dataclass(frozen=True, slots=True)
class ControlState:
    """What the policy remembers between decisions (returned anew by `decide`)."""

    last_change: dict[str, float] = field(default_factory=dict)  # role -> time of last change
    low_since: dict[str, float] = field(default_factory=dict)  # role -> load low since
    pinned: tuple[int, int] | None = None  # operator's (prefill, decode), or None for auto
    # Last good fits, kept across idle windows: prefill tokens/s per busy worker, and the
    # decode step model (a, b) in ms.
    prefill_capacity_tps: float | None = None
    decode_step_model: tuple[float, float] | None = None


@dataclass(frozen=True, slots=True)
class Decision:
    """Target replica counts and why. `figures` holds the model's numbers for `explain`."""

    t: float
    current: dict[str, int]
    target: dict[str, int]
    reasons: dict[str, str]
    figures: dict[str, float]

    @property
    def changed(self) -> bool:
        return self.current != self.target

    def summary(self) -> str:
        return "; ".join(f"{role}: {self.reasons[role]}" for role in ROLES)


def percentile(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile (q in [0, 100]) of a non-empty sequence."""
    if not values:
        raise ValueError("percentile of no values")
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


def _by_tick(samples: Sequence[WorkerSample]) -> list[list[WorkerSample]]:
    ticks: dict[float, list[WorkerSample]] = {}
    for s in samples:
        ticks.setdefault(s.t, []).append(s)
    return [ticks[t] for t in sorted(ticks)]


def fit_prefill(
    samples: Sequence[WorkerSample], sla: SLA, backlog_s: float = 0.0
) -> tuple[float | None, float, float]:
    """(capacity tokens/s per busy worker or None, demand tokens/s, mean busy fraction).

    Demand is the rate computed plus the queued backlog planned to clear within
    max(TTFT target, backlog_s)."""
    busy = [s for s in samples if s.busy_frac >= 0.05]
    capacity = sum(s.tokens_per_s for s in busy) / sum(s.busy_frac for s in busy) if busy else None
    ticks = _by_tick(samples)
    if not ticks:
        return capacity, 0.0, 0.0
    rate = sum(sum(s.tokens_per_s for s in tick) for tick in ticks) / len(ticks)
    backlog = sum(s.queued_prefill_tokens for s in ticks[-1])
    demand = rate + backlog / max(sla.ttft_p90_ms / 1e3, backlog_s)
    mean_busy = sum(s.busy_frac for s in samples) / len(samples)
    return capacity, demand, mean_busy


def fit_decode_step(samples: Sequence[WorkerSample]) -> tuple[float, float] | None:
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


def _want(demand: float, per_worker: float | None, utilization: float) -> int | None:
    if per_worker is None or per_worker <= 0:
        return None
    return math.ceil(demand / (per_worker * utilization) - 1e-9)


def decode_token_rate(
    ticks: Sequence[Sequence[WorkerSample]], step_model: tuple[float, float]
) -> float:
    """Tokens/s the decode workers generate, mean over the ticks, from each worker's batch
    and the fitted step time (one token per sequence per step)."""
    a, b = step_model
    total = 0.0
    for tick in ticks:
        total += sum(1e3 * s.num_running / (a + b * s.num_running) for s in tick if s.num_running)
    return total / len(ticks) if ticks else 0.0


def decode_token_demand(
    ticks: Sequence[Sequence[WorkerSample]],
    step_model: tuple[float, float],
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
    token_rate: float, step_model: tuple[float, float], max_batch: float, waiting: float = 0.0
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


def decide(
    obs: Observation, config: ControlConfig, state: ControlState
) -> tuple[Decision, ControlState]:
    """One control decision; see the module docstring for the model and the guards."""
    sla = obs.sla
    current = {role: obs.replicas.get(role, 0) for role in ROLES}
    live = [w for w in obs.workers if not w.draining]
    prefill_samples = [w for w in live if w.role == "prefill"]
    decode_samples = [w for w in live if w.role == "decode"]
    latest_t = max((w.t for w in obs.workers), default=None)
    latest = [w for w in obs.workers if w.t == latest_t]
    draining = {role: sum(1 for w in latest if w.role == role and w.draining) for role in ROLES}
    figures: dict[str, float] = {}

    # -- prefill model ------------------------------------------------------------------
    capacity, p_demand, p_busy = fit_prefill(prefill_samples, sla, config.prefill_backlog_s)
    capacity = capacity if capacity is not None else state.prefill_capacity_tps
    figures.update(prefill_demand_tps=p_demand, prefill_busy=p_busy)
    if capacity is not None:
        figures["prefill_capacity_tps"] = capacity
    # -- decode model -------------------------------------------------------------------
    step_model = fit_decode_step(decode_samples) or state.decode_step_model
    d_ticks = _by_tick(decode_samples)
    d_demand = (
        sum(sum(s.num_running + s.num_waiting for s in tick) for tick in d_ticks) / len(d_ticks)
        if d_ticks
        else 0.0
    )
    figures["decode_demand_seqs"] = d_demand
    batch_cap: float | None = None
    # Latency measured before a role's last change reflects the old count: only requests
    # that finished since then judge it.
    since = {role: state.last_change.get(role, -math.inf) for role in ROLES}
    ttfts = [r.ttft_ms for r in obs.requests if r.t > since["prefill"]]
    itls = [r.itl_ms for r in obs.requests if r.t > since["decode"] and r.output_tokens > 1]
    ttft_p90 = percentile(ttfts, 90) if len(ttfts) >= config.min_requests else None
    itl_p90 = percentile(itls, 90) if len(itls) >= config.min_requests else None
    if ttft_p90 is not None:
        figures["ttft_p90_ms"] = ttft_p90
    if itl_p90 is not None:
        figures["itl_p90_ms"] = itl_p90
    if step_model is not None:
        a, b = step_model
        figures.update(decode_step_a_ms=a, decode_step_b_ms=b)
        batch_cap = max(1.0, (sla.itl_p90_ms - a) / b)
        busy = [s for s in decode_samples if s.num_running > 0]
        if busy and itl_p90 is not None:
            mean_batch = sum(s.num_running for s in busy) / len(busy)
            predicted = a + b * mean_batch
            correction = min(2.0, max(0.5, itl_p90 / predicted))
            figures["itl_measured_over_model"] = correction
            batch_cap = max(1.0, batch_cap / correction)
        kv = [s for s in busy if s.num_blocks > 0]
        if kv:
            per_seq = sum((s.num_blocks - s.num_free_blocks) / s.num_running for s in kv) / len(kv)
            if per_seq > 0:
                batch_cap = min(batch_cap, max(1.0, min(s.num_blocks for s in kv) / per_seq))
        figures["decode_batch_capacity"] = batch_cap

    low_util = config.target_utilization * (1 - config.hysteresis)
    want_up = {
        "prefill": _want(p_demand, capacity, config.target_utilization),
        "decode": _want(d_demand, batch_cap, config.target_utilization),
    }
    want_down = {"prefill": _want(p_demand, capacity, low_util), "decode": None}
    if step_model is not None and batch_cap is not None:
        # Down: the count that carries today's token rate (sequence counts grow when workers
        # go, see decode_workers_for), never fewer than the sequence count alone says.
        waiting = sum(sum(s.num_waiting for s in t) for t in d_ticks) / max(1, len(d_ticks))
        rate = decode_token_rate(d_ticks, step_model)
        want_down["decode"] = max(
            _want(d_demand, batch_cap, low_util) or 0,
            decode_workers_for(rate, step_model, batch_cap * low_util, waiting) if d_ticks else 0,
        )
        outputs = [r.output_tokens for r in obs.requests if r.output_tokens > 1]
        if config.decode_backlog_s > 0 and d_ticks and outputs:
            mean_out = sum(outputs) / len(outputs)
            demand_tps = decode_token_demand(d_ticks, step_model, mean_out, config.decode_backlog_s)
            figures["decode_demand_tps"] = demand_tps
            figures["decode_mean_output_tokens"] = mean_out
            want_up["decode"] = decode_workers_for(
                demand_tps, step_model, batch_cap * config.target_utilization
            )
    why_model = {
        "prefill": (
            f"demand {p_demand:.0f} tok/s vs {capacity:.0f} tok/s per worker"
            if capacity is not None
            else "no busy prefill samples yet"
        ),
        "decode": (
            f"{d_demand:.1f} sequences vs {batch_cap:.1f} per worker within ITL"
            + (
                f", {figures['decode_demand_tps']:.0f} tok/s to generate"
                if "decode_demand_tps" in figures
                else ""
            )
            if batch_cap is not None
            else "no busy decode samples yet"
        ),
    }
    # SLA corrections: a measured violation asks for one more worker of the busy role.
    if (
        ttft_p90 is not None
        and ttft_p90 > sla.ttft_p90_ms
        and (
            p_busy >= config.target_utilization
            or sum(s.queued_prefill_tokens for s in prefill_samples if s.t == latest_t) > 0
        )
    ):
        want_up["prefill"] = max(want_up["prefill"] or 0, current["prefill"] + 1)
        why_model["prefill"] += f"; TTFT p90 {ttft_p90:.0f} ms > SLA {sla.ttft_p90_ms:.0f} ms"
    if itl_p90 is not None and itl_p90 > sla.itl_p90_ms:
        want_up["decode"] = max(want_up["decode"] or 0, current["decode"] + 1)
        why_model["decode"] += f"; ITL p90 {itl_p90:.0f} ms > SLA {sla.itl_p90_ms:.0f} ms"

    target: dict[str, int] = {}
    reasons: dict[str, str] = {}
    last_change = dict(state.last_change)
    low_since = dict(state.low_since)
    for i, role in enumerate(ROLES):
        lo, hi = config.bounds(role)
        cur = current[role]
        if state.pinned is not None:
            pin = min(hi, max(lo, state.pinned[i]))
            target[role] = pin
            reasons[role] = f"pinned by operator at {state.pinned[i]}" + (
                f" (bounded to {pin})" if pin != state.pinned[i] else ""
            )
            low_since.pop(role, None)
        elif cur < lo or cur > hi:
            target[role] = min(hi, max(lo, cur))
            reasons[role] = f"{cur} outside bounds [{lo}, {hi}]"
            low_since.pop(role, None)
        else:
            target[role], reasons[role] = _scale_role(
                role, cur, want_up[role], want_down[role], why_model[role],
                obs.now, config, last_change, low_since, draining[role],
            )  # fmt: skip
        if target[role] != cur:
            last_change[role] = obs.now
            low_since.pop(role, None)

    new_state = replace(
        state,
        last_change=last_change,
        low_since=low_since,
        prefill_capacity_tps=capacity,
        decode_step_model=step_model,
    )
    return Decision(obs.now, current, target, reasons, figures), new_state


def _scale_role(
    role: str,
    cur: int,
    up: int | None,
    down: int | None,
    why: str,
    now: float,
    config: ControlConfig,
    last_change: dict[str, float],
    low_since: dict[str, float],
    draining: int,
) -> tuple[int, str]:
    """(target, reason) for one role under automatic control; updates `low_since`."""
    lo, hi = config.bounds(role)
    since_change = now - last_change.get(role, -math.inf)
    if up is not None and up > cur:
        low_since.pop(role, None)
        if cur >= hi:
            return cur, f"hold {cur}: {why}; wants {up} but max_{role} is {hi}"
        if since_change < config.scale_up_cooldown_s:
            return cur, (
                f"hold {cur}: {why}; wants {up}, in scale-up cooldown "
                f"({since_change:.0f}/{config.scale_up_cooldown_s:.0f} s)"
            )
        new = min(hi, up, cur + config.max_step)
        return new, f"scale up {cur} -> {new}: {why}; wants {up}"
    if down is None or down >= cur or cur <= lo:
        low_since.pop(role, None)
        return cur, f"hold {cur}: {why}"
    start = low_since.setdefault(role, now)
    if draining:
        return cur, f"hold {cur}: {why}; {draining} worker(s) still draining"
    if now - start < config.scale_down_stable_s:
        return cur, (
            f"hold {cur}: {why}; low for {now - start:.0f}/{config.scale_down_stable_s:.0f} s "
            f"before scaling down"
        )
    if since_change < config.scale_down_cooldown_s:
        return cur, (
            f"hold {cur}: {why}; in scale-down cooldown "
            f"({since_change:.0f}/{config.scale_down_cooldown_s:.0f} s)"
        )
    new = max(lo, down, cur - config.max_down_step)
    return new, f"scale down {cur} -> {new}: {why}; needs {max(lo, down)}"
