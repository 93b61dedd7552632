"""Ready-made settings shared by `tandem sim` and benchmarks/bench_sim.py: SLA targets per
scale, the controller's configuration, and a builder for `SimConfig`."""

from __future__ import annotations

from dataclasses import replace

from tandem.control import SLA, ControlConfig
from tandem.sim.cluster import SimConfig

# gpu: interactive targets for an 8B model (a 9k-token prompt prefills in ~0.3 s on an
# H200; a decode step at a full batch takes ~20 ms). cpu: the serving benchmark's targets
# (BENCHMARKS.md, "Disaggregated vs colocated").
SLAS = {
    "gpu": SLA(ttft_p90_ms=1000.0, itl_p90_ms=25.0),
    "cpu": SLA(ttft_p90_ms=2500.0, itl_p90_ms=100.0),
}

# Seconds from "scale up" to a worker serving: an 8B checkpoint from local NVMe plus CUDA
# graph capture (gpu); a Python worker process loading the 176 MiB small model (cpu).
STARTUP_S = {"gpu": 30.0, "cpu": 10.0}

# The controller's knobs for the simulated clusters (see `tandem.control.ControlConfig`):
#   target_utilization 0.95, hysteresis 0.05: the TTFT target is 3-20x a prompt's prefill
#     time on a GPU and the ITL target is the step time of a batch the policy already
#     caps, so queues stay short up to high utilization; the SLA corrections add a worker
#     when p90 latency says otherwise. Scale down when demand fits under 90% of the smaller
#     count. (Chosen after trying 0.7-0.95 on the benchmark traces: see BENCHMARKS.md.)
#   scale_up_cooldown_s 30 = the startup time: judge the last scale-up once its workers
#     serve; max_step 2 up, max_down_step 2 down, scale_down_stable_s 20,
#     scale_down_cooldown_s 10: a phase of a few minutes must not be over before the count
#     follows it.
#   prefill_backlog_s 10: queued prompt tokens are planned to clear within 10 s, not within
#     the 1 s TTFT target (workers added now serve only after startup_s).
#   decode_backlog_s 60: decode scale-up by token rate; sequences waiting for KV are
#     planned to be served within 60 s (about two of their lifetimes) rather than all
#     seated at once by workers that arrive after the queue has gone.
# The controller service's interval (5 s) and a 30 s window of samples.
CONTROL = ControlConfig(
    min_prefill=1,
    max_prefill=64,
    min_decode=1,
    max_decode=64,
    target_utilization=0.95,
    hysteresis=0.05,
    scale_up_cooldown_s=30.0,
    scale_down_cooldown_s=10.0,
    scale_down_stable_s=20.0,
    max_step=2,
    min_requests=20,
    prefill_backlog_s=10.0,
    decode_backlog_s=60.0,
    max_down_step=2,
)
INTERVAL_S = 5.0
WINDOW_S = 30.0


def scale_of(cost_name: str) -> str:
    return "cpu" if cost_name == "cpu" else "gpu"


def sim_config(
    cost_name: str,
    duration_s: float,
    num_prefill: int = 1,
    num_decode: int = 1,
    autoscale: bool = False,
    warmup_s: float = 0.0,
    **overrides: object,
) -> SimConfig:
    """A SimConfig with this module's SLA, startup time and controller settings for the
    cost model's scale; `overrides` replace SimConfig fields."""
    scale = scale_of(cost_name)
    config = SimConfig(
        duration_s=duration_s,
        num_prefill=num_prefill,
        num_decode=num_decode,
        autoscale=autoscale,
        control=CONTROL,
        sla=SLAS[scale],
        interval_s=INTERVAL_S,
        window_s=WINDOW_S,
        startup_s=STARTUP_S[scale],
        warmup_s=warmup_s,
        label=("autoscale" if autoscale else f"static {num_prefill}P:{num_decode}D"),
    )
    return replace(config, **overrides)  # type: ignore[arg-type]
