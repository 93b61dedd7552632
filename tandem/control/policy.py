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
    role's last change; not while the role's workers are not all serving
    (`Observation.ready` below the count: workers still loading, or Pending pods), so that
    a scale-up whose workers have not come up is not followed by another; not while the
    role's last scale-up is on probation, nor within `undo_cooldown_s` of an undo;
  - down: only when even the stricter utilization target would need fewer workers,
    continuously for `scale_down_stable_s`, at most `max_down_step` workers at a time
    (default 1), not within `scale_down_cooldown_s` of the last change, and only when no
    worker of the role is still draining from the previous scale-down.
  judge    every automatic scale-up is on probation (`tandem.control.trial`): undone (back
           to the count before) when its workers do not all serve within
           `worker_start_timeout_s`, or when, `scale_up_trial_s` after they do, it raised
           neither goodput nor the work the role's workers do; kept otherwise. The verdict
           and its figures are in the role's reason.
  clamp    host capacity (`Observation.capacity`, the local actuator): the workers added in
           one decision fit into the host's room (`tandem.control.capacity`), shared out
           one at a time starting with the role that asks for more; never below a role's
           minimum. A clamped role's reason says what the host holds and what was wanted.
A short burst therefore scales up and stays up until the load has been low for a while, and
input that flaps between high and low does not make the count oscillate.

An operator can pin a ratio (`ControlState.pinned`); the policy then holds it (within bounds)
and reports why.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from typing import NamedTuple

from tandem.control.capacity import HostCapacity
from tandem.control.config import SLA, ControlConfig
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
from tandem.control.trial import Hold, Trial, Verdict, goodput, judge, work_rate
from tandem.control.trial import describe as describe_trial
from tandem.types import Role


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
    trials: dict[str, Trial] = field(default_factory=dict)  # role -> its scale-up on probation
    holds: dict[str, Hold] = field(default_factory=dict)  # role -> no scale-up until (undone)


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
        return "; ".join(f"{role}: {self.reasons[role]}" for role in Role)


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
    ready: dict[str, int]  # workers up and serving (Observation.ready, or the latest live)
    queued_prefill_tokens: int  # on live prefill workers at the latest tick
    ttft_p90_ms: float | None  # None with fewer than min_requests since the last change
    itl_p90_ms: float | None
    output_tokens: list[int]  # of the window's multi-token requests


def decide(
    obs: Observation, config: ControlConfig, state: ControlState
) -> tuple[Decision, ControlState]:
    """One control decision: observe -> fit -> want -> guard, then the trials and the host
    capacity (see the module docstring)."""
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
        Role.PREFILL: _want_prefill(seen, prefill, obs.sla, config),
        Role.DECODE: _want_decode(seen, decode, obs.sla, config),
    }

    trials, verdicts, notes = _judge_trials(obs, seen, config, state)
    holds = {role: h for role, h in state.holds.items() if h.until > obs.now}
    target: dict[str, int] = {}
    reasons: dict[str, str] = {}
    last_change, low_since = dict(state.last_change), dict(state.low_since)
    for role in Role:
        verdict = verdicts.get(role)
        if verdict is not None and not verdict.keep:
            before = state.trials[role].before
            holds[role] = Hold(obs.now + config.undo_cooldown_s, verdict.why)
            scaled = Scaled(before, (
                f"{verdict.why}; back to {before}, no {role} scale-up for "
                f"{config.undo_cooldown_s:.0f} s"
            ))  # fmt: skip
        else:
            scaled = _guard(role, wants[role], seen, obs.now, config, state, trials, holds)
        target[role], reasons[role] = scaled.target, scaled.reason
        if verdict is not None and verdict.keep:
            reasons[role] += f"; {verdict.why}"
        if role in notes:
            reasons[role] += f"; {notes[role]}"
        if scaled.low_since is None:
            low_since.pop(role, None)
        else:
            low_since[role] = scaled.low_since

    if obs.capacity is not None:
        target, reasons = _clamp(target, reasons, seen.current, obs.capacity, config)
    for role in Role:
        cur = seen.current[role]
        if target[role] == cur:
            continue
        last_change[role] = obs.now
        low_since.pop(role, None)
        trials.pop(role, None)  # the count changed: whatever was judged is over
        lo, hi = config.bounds(role)
        undone = role in verdicts and not verdicts[role].keep
        automatic = state.pinned is None and lo <= cur <= hi and not undone
        if target[role] > cur and automatic and config.scale_up_trial_s > 0:
            span = config.scale_up_trial_s
            trials[role] = Trial(
                obs.now,
                cur,
                target[role],
                goodput(obs.requests, obs.sla, obs.now, span, obs.since),
                work_rate(obs.workers, role, obs.now, span, obs.since),
            )

    new_state = replace(
        state,
        last_change=last_change,
        low_since=low_since,
        prefill_capacity_tps=prefill.capacity_tps,
        decode_step_model=step_model,
        trials=trials,
        holds=holds,
    )
    figures = _figures(seen, prefill, decode, obs.capacity, verdicts, state.trials)
    return Decision(obs.now, seen.current, target, reasons, figures), new_state


def _observe(obs: Observation, config: ControlConfig, state: ControlState) -> _Seen:
    live = [w for w in obs.workers if not w.draining]
    prefill = [w for w in live if w.role == Role.PREFILL]
    latest_t = max((w.t for w in obs.workers), default=None)
    latest = [w for w in obs.workers if w.t == latest_t]
    # Latency measured before a role's last change reflects the old count: only requests
    # that finished since then judge it.
    since = {role: state.last_change.get(role, -math.inf) for role in Role}
    ttfts = [r.ttft_ms for r in obs.requests if r.t > since[Role.PREFILL]]
    itls = [r.itl_ms for r in obs.requests if r.t > since[Role.DECODE] and r.output_tokens > 1]
    enough = config.min_requests
    ready: dict[str, int]
    if obs.ready is not None:
        ready = {role: obs.ready.get(role, 0) for role in Role}
    else:
        ready = {
            role: len({w.worker_id for w in latest if w.role == role and not w.draining})
            for role in Role
        }
    return _Seen(
        current={role: obs.replicas.get(role, 0) for role in Role},
        prefill=prefill,
        decode=[w for w in live if w.role == Role.DECODE],
        draining={role: sum(1 for w in latest if w.role == role and w.draining) for role in Role},
        ready=ready,
        queued_prefill_tokens=sum(s.queued_prefill_tokens for s in prefill if s.t == latest_t),
        ttft_p90_ms=percentile(ttfts, 90) if len(ttfts) >= enough else None,
        itl_p90_ms=percentile(itls, 90) if len(itls) >= enough else None,
        output_tokens=[r.output_tokens for r in obs.requests if r.output_tokens > 1],
    )


def _judge_trials(
    obs: Observation, seen: _Seen, config: ControlConfig, state: ControlState
) -> tuple[dict[str, Trial], dict[str, Verdict], dict[str, str]]:
    """The open trials after this observation, the verdicts reached now, and notes on trials
    that ended without one (the count changed under them, or an operator pinned a ratio)."""
    trials: dict[str, Trial] = {}
    verdicts: dict[str, Verdict] = {}
    notes: dict[str, str] = {}
    for role, trial in state.trials.items():
        step = f"scale up {trial.before} -> {trial.after}"
        if state.pinned is not None:
            notes[role] = f"{step} no longer judged: pinned by operator"
            continue
        if seen.current[role] != trial.after:
            notes[role] = f"{step} no longer judged: the count is {seen.current[role]}"
            continue
        ready = seen.ready[role]
        out = judge(
            role, trial, obs.now, ready, obs.requests, obs.workers, obs.sla, config, obs.since
        )
        if isinstance(out, Verdict):
            verdicts[role] = out
        else:
            trials[role] = out
    return trials, verdicts, notes


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
        up = max(up or 0, seen.current[Role.PREFILL] + 1)
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
        up = max(up or 0, seen.current[Role.DECODE] + 1)
        why += f"; ITL p90 {itl:.0f} ms > SLA {sla.itl_p90_ms:.0f} ms"
    return Want(up, down, why)


def _guard(
    role: str,
    want: Want,
    seen: _Seen,
    now: float,
    config: ControlConfig,
    state: ControlState,
    trials: dict[str, Trial],
    holds: dict[str, Hold],
) -> Scaled:
    """An operator's pin, then the bounds, then automatic control."""
    lo, hi = config.bounds(role)
    cur = seen.current[role]
    if state.pinned is not None:
        asked = state.pinned[Role(role).rank]
        pin = min(hi, max(lo, asked))
        bounded = f" (bounded to {pin})" if pin != asked else ""
        return Scaled(pin, f"pinned by operator at {asked}{bounded}")
    if cur < lo or cur > hi:
        return Scaled(min(hi, max(lo, cur)), f"{cur} outside bounds [{lo}, {hi}]")
    held = _held_up(role, cur, seen.ready[role], now, config, trials.get(role), holds.get(role))
    return _scale_role(role, cur, want, seen.draining[role], held, now, config, state)


def _held_up(
    role: str,
    cur: int,
    ready: int,
    now: float,
    config: ControlConfig,
    trial: Trial | None,
    hold: Hold | None,
) -> str | None:
    """Why the role may not scale up now, beyond its cooldown; None when it may."""
    if trial is not None:
        return describe_trial(role, trial, now, ready, config)
    if ready < cur:
        return (
            f"{cur - ready} of {cur} {role} workers not serving yet (starting, or not schedulable)"
        )
    if hold is not None:
        return f"{hold.why}; no {role} scale-up for {hold.until - now:.0f} s more"
    return None


def _scale_role(
    role: str,
    cur: int,
    want: Want,
    draining: int,
    held: str | None,
    now: float,
    config: ControlConfig,
    state: ControlState,
) -> Scaled:
    """The target for one role within its bounds under automatic control: up at once within
    the step and cooldown unless `held` says why not, down only after the load stayed low
    (module docstring)."""
    lo, hi = config.bounds(role)
    up, down, why = want
    since_change = now - state.last_change.get(role, -math.inf)
    if up is not None and up > cur:
        if cur >= hi:
            return Scaled(cur, f"hold {cur}: {why}; wants {up} but max_{role} is {hi}")
        if held is not None:
            return Scaled(cur, f"hold {cur}: {why}; wants {up}, but {held}")
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


def _clamp(
    target: dict[str, int],
    reasons: dict[str, str],
    current: dict[str, int],
    capacity: HostCapacity,
    config: ControlConfig,
) -> tuple[dict[str, int], dict[str, str]]:
    """Targets whose additions fit into the host's room. A role's minimum is granted first
    (a cluster without it does not serve); the rest of the room goes one worker at a time,
    starting with the role that asks for more (prefill on a tie). A clamped role's reason
    says what it wanted and what the host holds."""
    asked = {role: max(0, target[role] - current[role]) for role in Role}
    if sum(asked.values()) <= capacity.room:
        return target, reasons
    granted = {
        role: min(asked[role], max(0, config.bounds(role)[0] - current[role])) for role in Role
    }
    room = capacity.room - sum(granted.values())
    order = sorted(Role, key=lambda role: (-asked[role], Role(role).rank))
    while room > 0 and any(granted[role] < asked[role] for role in order):
        for role in order:
            if room > 0 and granted[role] < asked[role]:
                granted[role] += 1
                room -= 1
    target, reasons = dict(target), dict(reasons)
    for role in Role:
        if granted[role] == asked[role]:
            continue
        cur = current[role]
        new = cur + granted[role]
        verb = f"hold {cur}" if new == cur else f"scale up {cur} -> {new}"
        reasons[role] = (
            f"{verb}: the host holds {capacity.max_workers} workers and runs "
            f"{capacity.num_workers} ({capacity.why}); was: {reasons[role]}"
        )
        target[role] = new
    return target, reasons


def _figures(
    seen: _Seen,
    prefill: PrefillFit,
    decode: DecodeFit,
    capacity: HostCapacity | None,
    verdicts: dict[str, Verdict],
    trials: dict[str, Trial],
) -> dict[str, float]:
    """The model's numbers for `explain`; those not known this time are left out."""
    a, b = decode.step_model or (None, None)
    judged: dict[str, float | None] = {}
    for role, verdict in verdicts.items():
        baseline = trials[role].baseline
        judged[f"{role}_goodput_before_rps"] = baseline.met_per_s if baseline else None
        judged[f"{role}_goodput_after_rps"] = verdict.after.met_per_s if verdict.after else None
        judged[f"{role}_work_before_tps"] = trials[role].baseline_tps
        judged[f"{role}_work_after_tps"] = verdict.after_tps
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
        "host_max_workers": capacity.max_workers if capacity else None,
        "host_num_workers": capacity.num_workers if capacity else None,
        **judged,
    }
    return {name: value for name, value in known.items() if value is not None}
