"""Request traces: Poisson arrivals whose rate and length mix change over time. Pure.

A trace is a cycle of phases (each with its own arrival rate and request classes) plus
bursts that multiply the rate for a while. `generate(spec, duration_s, seed)` draws the
requests; the same seed gives the same list.

Presets (`preset(name, scale)`), for an 8B model on Hopper GPUs at scale "gpu" and for the
CPU engine's small model at scale "cpu" (lengths and rates shrunk to what it serves):
  stationary  one mix at a constant rate: chat, long-document and long-generation requests
              (gpu: 100 req/s, about 6 prefill + 2 decode H200s)
  shifting    prefill-heavy (long prompts, short outputs), mixed and decode-heavy (short
              prompts, long outputs) phases of 5 minutes each, repeating; each phase needs
              3-4 H200s, but prefill-heavy needs ~3 prefill + 1 decode and decode-heavy
              ~1 prefill + 3 decode
  bursty      the stationary mix with 30-60 s bursts of 2.5x the rate
"""

from __future__ import annotations

import random
from dataclasses import dataclass

TRACES = ("stationary", "shifting", "bursty")
SCALES = ("gpu", "cpu")


@dataclass(frozen=True, slots=True)
class RequestClass:
    """One kind of request: its share of arrivals and inclusive length ranges."""

    weight: float
    prompt_tokens: tuple[int, int]
    output_tokens: tuple[int, int]

    def __post_init__(self) -> None:
        for label, (lo, hi) in (("prompt", self.prompt_tokens), ("output", self.output_tokens)):
            if not 1 <= lo <= hi:
                raise ValueError(f"{label}_tokens must be a range 1 <= lo <= hi, got {lo}-{hi}")
        if self.weight <= 0:
            raise ValueError(f"weight must be positive, got {self.weight}")


@dataclass(frozen=True, slots=True)
class Phase:
    name: str
    duration_s: float
    rate_rps: float
    classes: tuple[RequestClass, ...]

    def __post_init__(self) -> None:
        if self.duration_s <= 0 or self.rate_rps < 0 or not self.classes:
            raise ValueError(f"phase {self.name!r} needs duration > 0, rate >= 0 and classes")


@dataclass(frozen=True, slots=True)
class Burst:
    start_s: float
    duration_s: float
    rate_multiplier: float


@dataclass(frozen=True, slots=True)
class TraceSpec:
    """Phases repeat in order for the length of the run; bursts are absolute times."""

    name: str
    phases: tuple[Phase, ...]
    bursts: tuple[Burst, ...] = ()

    def __post_init__(self) -> None:
        if not self.phases:
            raise ValueError("a trace needs at least one phase")

    @property
    def cycle_s(self) -> float:
        return sum(p.duration_s for p in self.phases)

    def phase_at(self, t: float) -> Phase:
        offset = t % self.cycle_s
        for phase in self.phases:
            if offset < phase.duration_s:
                return phase
            offset -= phase.duration_s
        return self.phases[-1]

    def rate_at(self, t: float) -> float:
        rate = self.phase_at(t).rate_rps
        for b in self.bursts:
            if b.start_s <= t < b.start_s + b.duration_s:
                rate *= b.rate_multiplier
        return rate

    def boundaries(self, duration_s: float) -> list[float]:
        """Sorted times in [0, duration_s] where the rate or the mix may change."""
        out = {0.0, duration_s}
        t = 0.0
        while t < duration_s:
            for phase in self.phases:
                t += phase.duration_s
                if t < duration_s:
                    out.add(t)
        for b in self.bursts:
            for edge in (b.start_s, b.start_s + b.duration_s):
                if 0 < edge < duration_s:
                    out.add(edge)
        return sorted(out)


@dataclass(frozen=True, slots=True)
class TraceRequest:
    request_id: int
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    phase: str


def generate(spec: TraceSpec, duration_s: float, seed: int) -> list[TraceRequest]:
    """Arrivals in [0, duration_s): exponential gaps at the rate of the current segment
    (restarting at each boundary is exact for a Poisson process), lengths uniform in the
    drawn class's ranges."""
    rng = random.Random(seed)
    out: list[TraceRequest] = []
    edges = spec.boundaries(duration_s)
    for start, end in zip(edges, edges[1:], strict=False):
        phase = spec.phase_at(start)
        rate = spec.rate_at(start)
        if rate <= 0:
            continue
        weights = [c.weight for c in phase.classes]
        t = start
        while True:
            t += rng.expovariate(rate)
            if t >= end:
                break
            cls = rng.choices(phase.classes, weights)[0]
            out.append(
                TraceRequest(
                    len(out),
                    t,
                    rng.randint(*cls.prompt_tokens),
                    rng.randint(*cls.output_tokens),
                    phase.name,
                )
            )
    return out


# -- presets ------------------------------------------------------------------------------

# GPU scale (Llama-8B on H100/H200). Chat: medium prompts and answers; document: long
# prompts (RAG, summarisation), short answers; generation: short prompts, long outputs.
_CHAT = RequestClass(0.5, (200, 1200), (100, 400))
_DOCUMENT = RequestClass(0.3, (2000, 6000), (50, 200))
_GENERATION = RequestClass(0.2, (100, 400), (400, 1000))
_PREFILL_HEAVY = (RequestClass(1.0, (3000, 9000), (16, 96)),)
_DECODE_HEAVY = (RequestClass(1.0, (100, 400), (600, 1600)),)
_MIXED = (_CHAT, _DOCUMENT, _GENERATION)

# CPU scale (the small model: ~316 prompt tokens/s and ~170 generated tokens/s per worker
# within a 100 ms ITL): lengths like the serving benchmark's classes, prompts short enough
# to prefill within the 2.5 s TTFT target.
_CPU_CHAT = RequestClass(0.5, (64, 256), (32, 96))
_CPU_DOCUMENT = RequestClass(0.3, (256, 512), (8, 32))
_CPU_GENERATION = RequestClass(0.2, (16, 64), (96, 192))
_CPU_PREFILL_HEAVY = (RequestClass(1.0, (256, 640), (4, 16)),)
_CPU_DECODE_HEAVY = (RequestClass(1.0, (16, 96), (128, 256)),)
_CPU_MIXED = (_CPU_CHAT, _CPU_DOCUMENT, _CPU_GENERATION)


def preset(name: str, scale: str = "gpu", rate_scale: float = 1.0) -> TraceSpec:
    """A named trace at `scale` ("gpu" or "cpu"), its rates multiplied by `rate_scale`."""
    if scale not in SCALES:
        raise ValueError(f"scale must be one of {SCALES}, got {scale!r}")
    if rate_scale <= 0:
        raise ValueError(f"rate_scale must be positive, got {rate_scale}")
    gpu = scale == "gpu"
    mixed = _MIXED if gpu else _CPU_MIXED
    base = 100.0 if gpu else 4.0
    if name in ("stationary", "bursty"):
        phases: tuple[Phase, ...] = (Phase("mixed", 3600.0, base * rate_scale, mixed),)
        bursts: tuple[Burst, ...] = ()
        if name == "bursty":
            bursts = tuple(
                Burst(start, length, 2.5)
                for start, length in ((240, 30), (600, 60), (900, 45), (1320, 60), (1620, 30))
            )
        return TraceSpec(name, phases, bursts)
    if name == "shifting":
        prefill_heavy = _PREFILL_HEAVY if gpu else _CPU_PREFILL_HEAVY
        decode_heavy = _DECODE_HEAVY if gpu else _CPU_DECODE_HEAVY
        # Rates are set so each phase needs a similar number of workers in total, with the
        # split between roles turned around.
        p_rate, d_rate, m_rate = (12.0, 70.0, 30.0) if gpu else (0.8, 4.0, 3.0)
        phases = (
            Phase("prefill-heavy", 300.0, p_rate * rate_scale, prefill_heavy),
            Phase("mixed", 300.0, m_rate * rate_scale, mixed),
            Phase("decode-heavy", 300.0, d_rate * rate_scale, decode_heavy),
        )
        return TraceSpec(name, phases)
    raise ValueError(f"trace must be one of {TRACES}, got {name!r}")
