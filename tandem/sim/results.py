"""What a simulation run produces: per-request records, a time series, the controller's
decisions, and the summary figures (goodput per GPU, SLA attainment, mean replicas)."""

from __future__ import annotations

from dataclasses import dataclass, field

from tandem.control import SLA, Decision, percentile
from tandem.types import Role

FINISHED, UNFINISHED, REJECTED = "finished", "unfinished", "rejected"


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """One request. `ttft_s` and `itl_s` (mean inter-token latency after token 1) are None
    for requests that never got that far; `met_sla` needs both within the SLA."""

    request_id: int
    arrival_s: float
    phase: str
    prompt_tokens: int
    output_tokens: int
    status: str
    disaggregated: bool
    prefill_id: str | None
    decode_id: str | None
    ttft_s: float | None
    itl_s: float | None
    finish_s: float | None
    met_sla: bool


@dataclass(frozen=True, slots=True)
class SeriesPoint:
    """The cluster at time `t` (sampled every controller interval, static runs included).

    workers: allocated workers per role (starting + live + draining), the GPUs it pays for.
    """

    t: float
    target: dict[str, int]
    workers: dict[str, int]
    starting: dict[str, int]
    draining: dict[str, int]
    queued_prefill_tokens: int
    decode_running: int
    decode_waiting: int


@dataclass(frozen=True, slots=True)
class Summary:
    num_requests: int
    num_finished: int
    num_met: int
    attainment: float  # met / arrived
    goodput_rps: float  # met / duration
    gpu_s: float
    mean_gpus: float
    goodput_per_gpu: float  # met requests per GPU-second
    mean_prefill: float
    mean_decode: float
    ttft_p50_ms: float
    ttft_p90_ms: float
    itl_p50_ms: float
    itl_p90_ms: float

    def line(self) -> str:
        return (
            f"goodput/GPU {self.goodput_per_gpu:.3f} req/s, attainment "
            f"{100 * self.attainment:.1f}% ({self.num_met}/{self.num_requests}), mean GPUs "
            f"{self.mean_gpus:.2f} (P {self.mean_prefill:.2f}, D {self.mean_decode:.2f}), "
            f"TTFT p50/p90 {self.ttft_p50_ms:.0f}/{self.ttft_p90_ms:.0f} ms, "
            f"ITL p50/p90 {self.itl_p50_ms:.1f}/{self.itl_p90_ms:.1f} ms"
        )


@dataclass(slots=True)
class SimResult:
    label: str
    duration_s: float
    warmup_s: float
    sla: SLA
    interval_s: float
    requests: list[RequestRecord]
    series: list[SeriesPoint]
    decisions: list[Decision]
    gpu_s: dict[str, float]  # role -> allocated workers integrated over [warmup_s, duration_s]
    wall_s: float = 0.0
    events: int = 0
    extra: dict[str, float] = field(default_factory=dict)

    @property
    def measured(self) -> list[RequestRecord]:
        """The requests that count: those that arrived after the warm-up."""
        return [r for r in self.requests if r.arrival_s >= self.warmup_s]

    def summary(self) -> Summary:
        """Figures over the measured span [warmup_s, duration_s)."""
        reqs = self.measured
        span = self.duration_s - self.warmup_s
        met = sum(1 for r in reqs if r.met_sla)
        ttfts = [1e3 * r.ttft_s for r in reqs if r.ttft_s is not None]
        itls = [1e3 * r.itl_s for r in reqs if r.itl_s is not None]
        gpu_s = sum(self.gpu_s.values())

        def pct(values: list[float], q: float) -> float:
            return percentile(values, q) if values else float("nan")

        return Summary(
            num_requests=len(reqs),
            num_finished=sum(1 for r in reqs if r.status == FINISHED),
            num_met=met,
            attainment=met / len(reqs) if reqs else 0.0,
            goodput_rps=met / span,
            gpu_s=gpu_s,
            mean_gpus=gpu_s / span,
            goodput_per_gpu=met / gpu_s if gpu_s else 0.0,
            mean_prefill=self.gpu_s.get(Role.PREFILL, 0.0) / span,
            mean_decode=self.gpu_s.get(Role.DECODE, 0.0) / span,
            ttft_p50_ms=pct(ttfts, 50),
            ttft_p90_ms=pct(ttfts, 90),
            itl_p50_ms=pct(itls, 50),
            itl_p90_ms=pct(itls, 90),
        )

    def attainment_series(self, bucket_s: float | None = None) -> list[tuple[float, float, int]]:
        """(bucket start, fraction of the requests that arrived in it and met the SLA,
        number of requests) per bucket of `bucket_s` (default: the controller interval)."""
        bucket_s = bucket_s or self.interval_s
        n = max(1, int(self.duration_s // bucket_s + (self.duration_s % bucket_s > 0)))
        met = [0] * n
        total = [0] * n
        for r in self.requests:
            i = min(n - 1, int(r.arrival_s // bucket_s))
            total[i] += 1
            met[i] += r.met_sla
        return [
            (i * bucket_s, met[i] / total[i] if total[i] else float("nan"), total[i])
            for i in range(n)
        ]
