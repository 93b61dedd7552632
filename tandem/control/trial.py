"""A scale-up on probation: kept only if it raised goodput, undone otherwise. Pure.

Adding workers can add contention instead of capacity (a host whose cores are all taken, a
cluster whose new pods cannot be scheduled). So every automatic scale-up of a role opens a
`Trial` that remembers the counts before and after and the goodput of the window before:

  starting  until `ready` (workers of the role up and serving) reaches the new count. Not
            there within `worker_start_timeout_s`: the added workers count as not added
            (still loading, or Pending in Kubernetes) and the scale-up is undone.
  judging   from the moment they all serve, for `scale_up_trial_s`; then the goodput of the
            last `scale_up_trial_s`, and the tokens/s the role's workers computed, are
            compared with the baseline (`improved`).
  verdict   kept, or undone: the role goes back to the count before, and the policy does
            not scale it up again for `undo_cooldown_s` (a `Hold`).

Goodput is the rate of finished requests that met both SLA targets (requests/s), over the
part of a span that the observation covers (`Goodput.span_s`), so that a window shortened by
a controller's start or by its own length compares rates, not counts.

  t0 scale-up        all serving             judged
  |--- starting ---->|------ judging ------->|
  baseline: (t0 - scale_up_trial_s, t0]      after: (judged - scale_up_trial_s, judged]
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import NamedTuple

from tandem.control.config import SLA, ControlConfig
from tandem.control.samples import RequestSample, WorkerSample

MIN_WORK_GAIN = 0.1  # a role computing > 10% more tokens/s after a scale-up gained capacity


class Goodput(NamedTuple):
    """What finished over a span: requests that met the SLA and all of them."""

    met: int
    done: int
    span_s: float  # > 0

    @property
    def met_per_s(self) -> float:
        return self.met / self.span_s

    @property
    def done_per_s(self) -> float:
        return self.done / self.span_s

    @property
    def attainment(self) -> float | None:
        """Fraction that met the SLA; None when nothing finished."""
        return self.met / self.done if self.done else None


def goodput(
    requests: Sequence[RequestSample], sla: SLA, now: float, span_s: float, since: float | None
) -> Goodput | None:
    """The requests that finished in (now - span_s, now], cut to (since, now] when the
    observation reaches back only to `since`; None when nothing of the span is covered."""
    start = now - span_s if since is None else max(now - span_s, since)
    if not now > start:
        return None
    recent = [r for r in requests if start < r.t <= now]
    met = sum(1 for r in recent if sla.met(r.ttft_ms, r.itl_ms if r.output_tokens > 1 else 0.0))
    return Goodput(met, len(recent), now - start)


def work_rate(
    workers: Sequence[WorkerSample], role: str, now: float, span_s: float, since: float | None
) -> float | None:
    """Tokens/s the role's live workers computed together over (now - span_s, now] (cut to
    (since, now]), mean over the heartbeat ticks in it; None without a tick."""
    start = now - span_s if since is None else max(now - span_s, since)
    ticks: dict[float, float] = {}
    for w in workers:
        if w.role == role and not w.draining and start < w.t <= now:
            ticks[w.t] = ticks.get(w.t, 0.0) + w.tokens_per_s
    return sum(ticks.values()) / len(ticks) if ticks else None


def improved(
    before: Goodput | None,
    after: Goodput | None,
    tps_before: float | None = None,
    tps_after: float | None = None,
) -> tuple[bool, str]:
    """Whether a scale-up helped, and why. Kept when, in this order:
      1. goodput rose (more requests/s met the SLA); with no baseline (the observation
         reached back to nothing before the scale-up), when any request met it after;
      2. every request met the SLA before (a scale-up for headroom, which cannot raise
         goodput) and every request still does after, with some finishing;
      3. the role's workers computed more than MIN_WORK_GAIN (10%) more tokens/s together
         than before: the added workers carry load. Goodput alone would undo a scale-up
         that a rising load outran (more requests, all late), though the workers it added
         are the capacity that load needs; added workers that only contend for the same
         cores compute no more together.
    Otherwise undone: goodput flat or down and no more work done, or no traffic left."""
    if after is None:
        return False, "no goodput measured after it"
    ga = after.met_per_s
    gb = before.met_per_s if before is not None else None
    figures = f"goodput {ga:.2f} req/s within the SLA after, " + (
        f"{gb:.2f} before" if gb is not None else "none measured before"
    )
    if (ga > gb) if gb is not None else after.met > 0:
        return True, figures
    if before is not None and before.attainment == 1.0 and after.attainment == 1.0:
        return True, f"{figures}; every request within the SLA before and after"
    if tps_before is not None and tps_after is not None:
        work = f"its workers computed {tps_after:.0f} tok/s, {tps_before:.0f} before"
        if tps_after > tps_before * (1 + MIN_WORK_GAIN):
            return True, f"{figures}, but {work}"
        return False, f"{figures}; {work}"
    return False, figures


@dataclass(frozen=True, slots=True)
class Trial:
    """One role's scale-up on probation (module docstring)."""

    t: float  # when the scale-up was decided
    before: int  # the role's count before it
    after: int  # the count it asked for
    baseline: Goodput | None  # the window before `t`; None: it covered nothing
    baseline_tps: float | None  # tokens/s the role's workers computed then (work_rate)
    serving_since: float | None = None  # when `after` workers first all served


class Verdict(NamedTuple):
    keep: bool
    why: str
    after: Goodput | None = None  # the goodput judged on; None when the workers never served
    after_tps: float | None = None  # the role's work rate judged on (work_rate)


class Hold(NamedTuple):
    """No scale-up of a role until `until`: the last one was undone, for `why`."""

    until: float
    why: str


def judge(
    role: str,
    trial: Trial,
    now: float,
    ready: int,
    requests: Sequence[RequestSample],
    workers: Sequence[WorkerSample],
    sla: SLA,
    config: ControlConfig,
    since: float | None = None,
) -> Trial | Verdict:
    """The trial's next state at `now`, given `ready` workers of `role` serving and the
    window's samples: the trial (updated) while it is still starting or judging, else its
    verdict."""
    step = f"scale up {trial.before} -> {trial.after}"
    serving_since = trial.serving_since
    if serving_since is None:
        if ready < trial.after:
            if now - trial.t < config.worker_start_timeout_s:
                return trial
            missing = min(trial.after - trial.before, trial.after - ready)
            return Verdict(False, (
                f"{step} undone: {missing} added {role} worker(s) not serving after "
                f"{config.worker_start_timeout_s:.0f} s (still starting, or not schedulable)"
            ))  # fmt: skip
        trial = replace(trial, serving_since=now)
        serving_since = now
    if now - serving_since < config.scale_up_trial_s:
        return trial
    span = config.scale_up_trial_s
    after = goodput(requests, sla, now, span, since)
    tps = work_rate(workers, role, now, span, since)
    keep, why = improved(trial.baseline, after, trial.baseline_tps, tps)
    return Verdict(keep, f"{step} {'kept' if keep else 'undone'}: {why}", after, tps)


def describe(role: str, trial: Trial, now: float, ready: int, config: ControlConfig) -> str:
    """What an open trial waits for (the hold reason of its role)."""
    step = f"scale up {trial.before} -> {trial.after}"
    if trial.serving_since is None:
        return (
            f"{step} not serving yet: {ready}/{trial.after} {role} workers serve "
            f"({now - trial.t:.0f}/{config.worker_start_timeout_s:.0f} s)"
        )
    return (
        f"judging {step}: {now - trial.serving_since:.0f}/{config.scale_up_trial_s:.0f} s "
        f"of goodput since its workers serve"
    )
