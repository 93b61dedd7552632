"""The soak's memory verdict (issue 38): the trend of a process's RSS troughs after warm-up.

A serving process's RSS is a sawtooth (a long prefill's activations come and go), so two
samples -- the first after warm-up and the last -- can land on a peak and a trough and call a
leak flat, or the other way round. The prefill worker's leak was exactly that: troughs rising
~40 MB a minute while the soak's "last vs first" check passed. So:

    after warm-up, cut the samples into `WINDOWS` equal windows in time
    -> the lowest sample of each (a trough: what the process keeps between bursts)
    -> a least-squares line through the troughs
    growth = fitted value at the last sample / fitted value at the first - 1

A leak raises every trough and the line with them; a sawtooth without a leak leaves the line
flat whatever its phase at the ends. Pure: samples in, numbers out (tests/unit/test_soak_memory.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

WINDOWS = 8
MIN_WINDOWS = 4  # fewer troughs than this (a run too short after warm-up): no verdict


class TroughTrend(NamedTuple):
    troughs: list[tuple[float, float]]  # (t_s, bytes), one per window with samples
    slope_bytes_per_s: float
    start_bytes: float  # the line at the first sample after warm-up
    end_bytes: float  # the line at the last sample
    growth: float  # end_bytes / start_bytes - 1


def trough_trend(points: Sequence[tuple[float, float]], warmup_s: float) -> TroughTrend | None:
    """The trend of `points` ((t_s, bytes) of one process, any order) after `warmup_s`; None
    when fewer than MIN_WINDOWS windows hold a sample."""
    after = sorted(p for p in points if p[0] >= warmup_s)
    if len(after) < 2:
        return None
    t0, t1 = after[0][0], after[-1][0]
    span = t1 - t0
    if span <= 0:
        return None
    windows: list[list[tuple[float, float]]] = [[] for _ in range(WINDOWS)]
    for t, v in after:
        windows[min(int((t - t0) / span * WINDOWS), WINDOWS - 1)].append((t, v))
    troughs = [min(w, key=lambda p: (p[1], p[0])) for w in windows if w]
    if len(troughs) < MIN_WINDOWS:
        return None
    n = len(troughs)
    mean_t = sum(t for t, _ in troughs) / n
    mean_v = sum(v for _, v in troughs) / n
    var_t = sum((t - mean_t) ** 2 for t, _ in troughs)
    slope = sum((t - mean_t) * (v - mean_v) for t, v in troughs) / var_t if var_t else 0.0
    start = mean_v + slope * (t0 - mean_t)
    end = mean_v + slope * (t1 - mean_t)
    return TroughTrend(troughs, slope, start, end, end / start - 1 if start > 0 else 0.0)
