"""The P:D ratio policy: how many prefill and decode workers the load needs. Pure.

`decide(observation, config, state) -> (Decision, state)`; the controller service calls it
every `interval_s` with a sliding window of what workers and routers reported, and applies
the decision through an actuator. Nothing here reads a clock or does I/O, so scenario tests
drive it with plain data and the simulator reuses it unchanged.

One decision, per role:
  observe  the live workers' samples, the workers still draining, and the latency
           percentiles of the requests that finished since the role's last change;
  fit      the capacity model of `tandem.control.model` (a role without busy samples in
           the window keeps its last fit);
  want     the count that model asks for at `target_utilization`, and the count a
           scale-down must fit at the stricter target * (1 - hysteresis); then corrections
           from what users saw: a TTFT (ITL) p90 above the SLA while prefill (decode) is
           busy asks for one more worker even if the model is content;
  guard    turn `want` into a replica count:
  - bounds: [min, max] always;
  - up: at once, at most `max_step` per decision, not within `scale_up_cooldown_s` of the
    role's last change;
  - down: only when even the stricter utilization target would need fewer workers,
    continuously for `scale_down_stable_s`, at most `max_down_step` workers at a time
    (default 1), not within `scale_down_cooldown_s` of the last change, and only when no
    worker of the role is still draining from the previous scale-down.
A short burst therefore scales up and stays up until the load has been low for a while, and
input that flaps between high and low does not make the count oscillate.

An operator can pin a ratio (`ControlState.pinned`); the policy then holds it (within bounds)
and reports why.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import NamedTuple

from tandem.control.config import ROLES, SLA, ControlConfig
from tandem.control.model import (
    DecodeFit,
    PrefillFit,
    StepModel,
    decode_workers_for,
    fit_decode,
    fit_decode_step,
    fit_prefill,
    workers_for,
)
from tandem.control.samples import Observation, WorkerSample, percentile


@dataclass(frozen=True, slots=True)
class ControlState:
    """What the policy remembers between decisions (returned anew by `decide`)."""

    last_change: dict[str, float] = field(default_factory=dict)  # role -> time of last change
    low_since: dict[str, float] = field(default_factory=dict)  # role -> load low since
    pinned: tuple[int, int] | None = None  # operator's (prefill, decode), or None for auto
    # Last good fits, kept across idle windows: prefill tokens/s per busy worker, and the
    # decode step model (a, b) in ms.
    prefill_capacity_tps: float | None = None
    decode_step_model: StepModel | None = None


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


class Want(NamedTuple):
    """What the model asks of one role."""

    up: int | None  # count to scale up to; None without a model yet
    down: int | None  # count a scale-down must fit under; None: no scale-down now
    why: str


@dataclass(frozen=True, slots=True)
class Scaled:
    """One role's guarded outcome: the target, why, and since when its load has been low
    (for the next decision; None when it is not low, or when the count just changed)."""

    target: int
    reason: str
    low_since: float | None = None


class _Seen(NamedTuple):
    """An observation digested for one decision."""

    current: dict[str, int]  # replicas last asked for
    prefill: list[WorkerSample]  # live (not draining) workers' samples
    decode: list[WorkerSample]
    draining: dict[str, int]  # workers still draining at the latest tick
    queued_prefill_tokens: int  # on live prefill workers at the latest tick
    ttft_p90_ms: float | None  # None with fewer than min_requests since the last change
    itl_p90_ms: float | None
    output_tokens: list[int]  # of the window's multi-token requests


def decide(
    obs: Observation, config: ControlConfig, state: ControlState
) -> tuple[Decision, ControlState]:
    """One control decision: observe -> fit -> want -> guard (see the module docstring)."""
    seen = _observe(obs, config, state)

    prefill = fit_prefill(seen.prefill, obs.sla, config.prefill_backlog_s)
    if prefill.capacity_tps is None:
        prefill = prefill._replace(capacity_tps=state.prefill_capacity_tps)
    step_model = fit_decode_step(seen.decode) or state.decode_step_model
    decode = fit_decode(
        seen.decode, step_model, obs.sla, seen.itl_p90_ms, seen.output_tokens,
        config.decode_backlog_s,
    )  # fmt: skip

    wants = {
        "prefill": _want_prefill(seen, prefill, obs.sla, config),
        "decode": _want_decode(seen, decode, obs.sla, config),
    }

    target: dict[str, int] = {}
    reasons: dict[str, str] = {}
    last_change, low_since = dict(state.last_change), dict(state.low_since)
    for role in ROLES:
        scaled = _guard(role, wants[role], seen, obs.now, config, state)
        target[role], reasons[role] = scaled.target, scaled.reason
        if scaled.target != seen.current[role]:
            last_change[role] = obs.now
        if scaled.low_since is None:
            low_since.pop(role, None)
        else:
            low_since[role] = scaled.low_since

    new_state = replace(
        state,
        last_change=last_change,
        low_since=low_since,
        prefill_capacity_tps=prefill.capacity_tps,
        decode_step_model=step_model,
    )
    figures = _figures(seen, prefill, decode)
    return Decision(obs.now, seen.current, target, reasons, figures), new_state


def _observe(obs: Observation, config: ControlConfig, state: ControlState) -> _Seen:
    live = [w for w in obs.workers if not w.draining]
    prefill = [w for w in live if w.role == "prefill"]
    latest_t = max((w.t for w in obs.workers), default=None)
    latest = [w for w in obs.workers if w.t == latest_t]
    # Latency measured before a role's last change reflects the old count: only requests
    # that finished since then judge it.
    since = {role: state.last_change.get(role, -math.inf) for role in ROLES}
    ttfts = [r.ttft_ms for r in obs.requests if r.t > since["prefill"]]
    itls = [r.itl_ms for r in obs.requests if r.t > since["decode"] and r.output_tokens > 1]
    enough = config.min_requests
    return _Seen(
        current={role: obs.replicas.get(role, 0) for role in ROLES},
        prefill=prefill,
        decode=[w for w in live if w.role == "decode"],
        draining={role: sum(1 for w in latest if w.role == role and w.draining) for role in ROLES},
        queued_prefill_tokens=sum(s.queued_prefill_tokens for s in prefill if s.t == latest_t),
        ttft_p90_ms=percentile(ttfts, 90) if len(ttfts) >= enough else None,
        itl_p90_ms=percentile(itls, 90) if len(itls) >= enough else None,
        output_tokens=[r.output_tokens for r in obs.requests if r.output_tokens > 1],
    )


def _want_prefill(seen: _Seen, fit: PrefillFit, sla: SLA, config: ControlConfig) -> Want:
    up = workers_for(fit.demand_tps, fit.capacity_tps, config.target_utilization)
    down = workers_for(fit.demand_tps, fit.capacity_tps, config.low_utilization)
    why = (
        f"demand {fit.demand_tps:.0f} tok/s vs {fit.capacity_tps:.0f} tok/s per worker"
        if fit.capacity_tps is not None
        else "no busy prefill samples yet"
    )
    ttft = seen.ttft_p90_ms
    busy = fit.busy >= config.target_utilization or seen.queued_prefill_tokens > 0
    if ttft is not None and ttft > sla.ttft_p90_ms and busy:
        up = max(up or 0, seen.current["prefill"] + 1)
        why += f"; TTFT p90 {ttft:.0f} ms > SLA {sla.ttft_p90_ms:.0f} ms"
    return Want(up, down, why)


def _want_decode(seen: _Seen, fit: DecodeFit, sla: SLA, config: ControlConfig) -> Want:
    cap = fit.batch_capacity
    up = workers_for(fit.demand_seqs, cap, config.target_utilization)
    down = None
    why = "no busy decode samples yet"
    if fit.step_model is not None and cap is not None:
        # Down: the count that carries today's token rate (sequence counts grow when workers
        # go, see decode_workers_for), never fewer than the sequence count alone says.
        low = config.low_utilization
        carry = (
            decode_workers_for(fit.rate_tps, fit.step_model, cap * low, fit.waiting)
            if fit.rate_tps is not None
            else 0
        )
        down = max(workers_for(fit.demand_seqs, cap, low) or 0, carry)
        why = f"{fit.demand_seqs:.1f} sequences vs {cap:.1f} per worker within ITL"
        if fit.demand_tps is not None:
            up = decode_workers_for(fit.demand_tps, fit.step_model, cap * config.target_utilization)
            why += f", {fit.demand_tps:.0f} tok/s to generate"
    itl = seen.itl_p90_ms
    if itl is not None and itl > sla.itl_p90_ms:
        up = max(up or 0, seen.current["decode"] + 1)
        why += f"; ITL p90 {itl:.0f} ms > SLA {sla.itl_p90_ms:.0f} ms"
    return Want(up, down, why)


def _guard(
    role: str, want: Want, seen: _Seen, now: float, config: ControlConfig, state: ControlState
) -> Scaled:
    """An operator's pin, then the bounds, then automatic control."""
    lo, hi = config.bounds(role)
    cur = seen.current[role]
    if state.pinned is not None:
        asked = state.pinned[ROLES.index(role)]
        pin = min(hi, max(lo, asked))
        bounded = f" (bounded to {pin})" if pin != asked else ""
        return Scaled(pin, f"pinned by operator at {asked}{bounded}")
    if cur < lo or cur > hi:
        return Scaled(min(hi, max(lo, cur)), f"{cur} outside bounds [{lo}, {hi}]")
    return _scale_role(role, cur, want, seen.draining[role], now, config, state)


def _scale_role(
    role: str,
    cur: int,
    want: Want,
    draining: int,
    now: float,
    config: ControlConfig,
    state: ControlState,
) -> Scaled:
    """The target for one role within its bounds under automatic control: up at once within
    the step and cooldown, down only after the load stayed low (module docstring)."""
    lo, hi = config.bounds(role)
    up, down, why = want
    since_change = now - state.last_change.get(role, -math.inf)
    if up is not None and up > cur:
        if cur >= hi:
            return Scaled(cur, f"hold {cur}: {why}; wants {up} but max_{role} is {hi}")
        if since_change < config.scale_up_cooldown_s:
            return Scaled(cur, (
                f"hold {cur}: {why}; wants {up}, in scale-up cooldown "
                f"({since_change:.0f}/{config.scale_up_cooldown_s:.0f} s)"
            ))  # fmt: skip
        new = min(hi, up, cur + config.max_step)
        return Scaled(new, f"scale up {cur} -> {new}: {why}; wants {up}")
    if down is None or down >= cur or cur <= lo:
        return Scaled(cur, f"hold {cur}: {why}")
    start = state.low_since.get(role, now)
    if draining:
        return Scaled(cur, f"hold {cur}: {why}; {draining} worker(s) still draining", start)
    if now - start < config.scale_down_stable_s:
        return Scaled(cur, (
            f"hold {cur}: {why}; low for {now - start:.0f}/{config.scale_down_stable_s:.0f} s "
            f"before scaling down"
        ), start)  # fmt: skip
    if since_change < config.scale_down_cooldown_s:
        return Scaled(cur, (
            f"hold {cur}: {why}; in scale-down cooldown "
            f"({since_change:.0f}/{config.scale_down_cooldown_s:.0f} s)"
        ), start)  # fmt: skip
    # Always at least one fewer (down < cur, cur > lo), so the count changes and the low
    # spell that led here ends with it.
    new = max(lo, down, cur - config.max_down_step)
    return Scaled(new, f"scale down {cur} -> {new}: {why}; needs {max(lo, down)}")


def _figures(seen: _Seen, prefill: PrefillFit, decode: DecodeFit) -> dict[str, float]:
    """The model's numbers for `explain`; those not known this time are left out."""
    a, b = decode.step_model or (None, None)
    known: dict[str, float | None] = {
        "prefill_demand_tps": prefill.demand_tps,
        "prefill_busy": prefill.busy,
        "prefill_capacity_tps": prefill.capacity_tps,
        "decode_demand_seqs": decode.demand_seqs,
        "ttft_p90_ms": seen.ttft_p90_ms,
        "itl_p90_ms": seen.itl_p90_ms,
        "decode_step_a_ms": a,
        "decode_step_b_ms": b,
        "itl_measured_over_model": decode.itl_correction,
        "decode_batch_capacity": decode.batch_capacity,
        "decode_demand_tps": decode.demand_tps,
        "decode_mean_output_tokens": decode.mean_output_tokens,
    }
    return {name: value for name, value in known.items() if value is not None}
