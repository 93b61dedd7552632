"""The cluster simulator: determinism, conservation, cost models, and the real policies'
behaviour on small traces (seconds of CPU in all)."""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

import pytest

from tandem.control import (
    SLA,
    ControlConfig,
    WorkerSample,
    decode_token_rate,
    decode_workers_for,
    fit_prefill,
)
from tandem.sim import (
    H100,
    H200,
    CpuFittedCost,
    Phase,
    RequestClass,
    RooflineCost,
    SimConfig,
    TraceRequest,
    TraceSpec,
    cost_model,
    generate,
    preset,
    simulate,
)
from tandem.sim.cli import add_parser
from tandem.sim.cli import main as sim_main
from tandem.sim.cluster import Cluster
from tandem.sim.cost import transfer_s
from tandem.sim.results import FINISHED, SimResult
from tandem.sim.scenario import CONTROL, sim_config
from tandem.sim.workers import DecodeWorker, PrefillWorker

H200_COST = cost_model("h200")
GPU_SLA = SLA(ttft_p90_ms=1000.0, itl_p90_ms=25.0)
SMALL = RequestClass(1.0, (200, 2000), (20, 200))


def small_trace(rate: float = 20.0, duration_s: float = 120.0, seed: int = 0) -> list[TraceRequest]:
    return generate(TraceSpec("small", (Phase("p", duration_s, rate, (SMALL,)),)), duration_s, seed)


def run_cluster(trace: list[TraceRequest], config: SimConfig, cost=H200_COST) -> Cluster:  # type: ignore[no-untyped-def]
    cluster = Cluster(cost, config)
    cluster.run(trace)
    return cluster


def static(p: int, d: int, duration_s: float = 120.0, **kw: object) -> SimConfig:
    return SimConfig(duration_s=duration_s, num_prefill=p, num_decode=d, sla=GPU_SLA, **kw)  # type: ignore[arg-type]


# -- traces -------------------------------------------------------------------------------


def test_trace_rates_lengths_and_phases() -> None:
    spec = TraceSpec(
        "two", (Phase("a", 100, 10.0, (RequestClass(1, (5, 9), (1, 3)),)),
                Phase("b", 100, 40.0, (RequestClass(1, (50, 50), (7, 7)),))),
    )  # fmt: skip
    reqs = generate(spec, 400, seed=3)
    a = [r for r in reqs if r.phase == "a"]
    b = [r for r in reqs if r.phase == "b"]
    assert len(a) == pytest.approx(2 * 100 * 10, rel=0.15)  # two cycles of each phase
    assert len(b) == pytest.approx(2 * 100 * 40, rel=0.1)
    assert all(5 <= r.prompt_tokens <= 9 and 1 <= r.output_tokens <= 3 for r in a)
    assert all(r.prompt_tokens == 50 and r.output_tokens == 7 for r in b)
    assert all(0 <= (r.arrival_s % 200) < 100 for r in a)
    assert [r.request_id for r in reqs] == list(range(len(reqs)))
    assert reqs == sorted(reqs, key=lambda r: r.arrival_s)


def test_bursts_multiply_the_rate() -> None:
    spec = preset("bursty")
    burst = spec.bursts[0]
    assert spec.rate_at(burst.start_s + 1) == pytest.approx(2.5 * spec.rate_at(0))
    reqs = generate(spec, burst.start_s + burst.duration_s, seed=0)
    inside = sum(1 for r in reqs if r.arrival_s >= burst.start_s)
    before = len(reqs) - inside
    assert inside / burst.duration_s == pytest.approx(2.5 * before / burst.start_s, rel=0.15)


@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(prompt_tokens=(0, 5), output_tokens=(1, 1)), "prompt_tokens"),
    (dict(prompt_tokens=(1, 5), output_tokens=(3, 2)), "output_tokens"),
])  # fmt: skip
def test_request_class_rejects_bad_ranges(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        RequestClass(1.0, **kwargs)  # type: ignore[arg-type]


# -- cost models --------------------------------------------------------------------------


def test_roofline_prefill_is_linear_in_tokens_once_compute_bound() -> None:
    cost = RooflineCost(H200)
    t4k, t8k, t16k = (cost.prefill_step_s(n) - cost.step_overhead_s for n in (4096, 8192, 16384))
    assert t8k / t4k == pytest.approx(2.0, rel=1e-6)
    assert t16k / t8k == pytest.approx(2.0, rel=1e-6)
    # 8B at 50% MFU of 989 TFLOP/s: 2 * 8.03e9 * 8192 / 4.945e14 = 0.266 s.
    assert t8k == pytest.approx(0.266, rel=0.01)
    # A tiny prefill is bounded by reading the weights, not by FLOPs.
    assert cost.prefill_step_s(16) == pytest.approx(cost.prefill_step_s(1))


def test_roofline_decode_grows_with_batch_and_context_and_h200_is_faster() -> None:
    h100, h200 = RooflineCost(H100), RooflineCost(H200)
    steps = [h200.decode_step_s(b, b * 2000) for b in (1, 16, 64, 256)]
    assert steps == sorted(steps) and steps[-1] > 2 * steps[0]
    assert h200.decode_step_s(64, 64_000) < h200.decode_step_s(64, 128_000)
    for batch in (1, 32, 256):
        assert h200.decode_step_s(batch, batch * 2000) < h100.decode_step_s(batch, batch * 2000)
    # Memory-bound: the step time ratio approaches the bandwidth ratio (4.8 / 3.35).
    ratio = (h100.decode_step_s(1, 1000) - 1e-3) / (h200.decode_step_s(1, 1000) - 1e-3)
    assert ratio == pytest.approx(4.8 / 3.35, rel=1e-6)
    assert h200.num_kv_blocks > 2 * h100.num_kv_blocks  # 141 GB vs 80 GB, minus 16 GB weights
    assert h200.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2


def test_cpu_cost_reproduces_the_measurements_it_was_fitted_on() -> None:
    cpu = CpuFittedCost()
    assert cpu.prefill_step_s(1024) == pytest.approx(3.242)  # TTFT of a 1024-token prompt
    assert cpu.decode_step_s(1, 248) == pytest.approx(16.93e-3, rel=0.01)  # batch-1 step
    assert cpu.decode_step_s(6, 1250) == pytest.approx(44.94e-3, rel=0.01)  # 6 in flight
    assert cpu.num_kv_blocks * cpu.block_size * cpu.kv_bytes_per_token <= 512 * 2**20
    assert transfer_s(cpu, 0) == pytest.approx(cpu.link_latency_s)


def test_cost_model_names() -> None:
    assert cost_model("h100").name == "H100-SXM/llama-8b"
    with pytest.raises(ValueError, match="cost model must be one of"):
        cost_model("tpu")


# -- runs ---------------------------------------------------------------------------------


def _fingerprint(r: SimResult) -> tuple[object, ...]:
    return (
        [(x.request_id, x.ttft_s, x.itl_s, x.prefill_id, x.decode_id) for x in r.requests],
        [(p.t, p.workers, p.queued_prefill_tokens) for p in r.series],
        [(d.t, d.target, d.summary()) for d in r.decisions],
        r.gpu_s,
    )


def test_runs_are_deterministic_given_a_seed() -> None:
    cfg = sim_config("h200", 300.0, 1, 1, autoscale=True)
    spec = preset("shifting", rate_scale=0.5)
    a = simulate(generate(spec, 300, seed=7), H200_COST, cfg)
    b = simulate(generate(spec, 300, seed=7), H200_COST, cfg)
    c = simulate(generate(spec, 300, seed=8), H200_COST, cfg)
    assert a.decisions and any(d.changed for d in a.decisions)
    assert _fingerprint(a) == _fingerprint(b)
    assert _fingerprint(a) != _fingerprint(c)


def test_every_request_finishes_and_no_kv_block_leaks() -> None:
    trace = small_trace(rate=40.0)
    cluster = run_cluster(trace, static(2, 2, drain_grace_s=3600.0))
    cluster.check_integrity()
    result = cluster.result("", 0.0)
    assert len(result.requests) == len(trace)
    assert all(r.status == FINISHED for r in result.requests)
    assert all(
        r.ttft_s is not None and r.ttft_s > 0 and r.itl_s is not None for r in result.requests
    )
    for w in cluster.workers.values():
        assert w.is_empty()
        if isinstance(w, DecodeWorker):
            assert w.free_blocks == w.num_blocks
    # The router's in-flight counts return to zero too.
    assert not any(cluster._inflight_reqs.values()) and not any(cluster._inflight_tokens.values())
    # Both roles did work; every request was disaggregated (all prompts >= 200 tokens).
    assert {r.prefill_id for r in result.requests} == {"p0", "p1"}
    assert {r.decode_id for r in result.requests} == {"d0", "d1"}
    assert all(r.disaggregated for r in result.requests)


def test_short_prompts_are_prefilled_on_the_decode_worker() -> None:
    spec = TraceSpec("short", (Phase("p", 60, 20.0, (RequestClass(1, (8, 40), (1, 30)),)),))
    cluster = run_cluster(generate(spec, 60, 0), static(1, 1, 60.0, drain_grace_s=600.0))
    cluster.check_integrity()
    records = cluster.result("", 0.0).requests
    assert records and all(r.status == FINISHED and not r.disaggregated for r in records)
    assert all(r.prefill_id is None for r in records)


def test_short_kv_makes_requests_wait_but_loses_none() -> None:
    tiny = replace(CpuFittedCost(), num_kv_blocks=40)  # 640 tokens: a few requests at a time
    spec = TraceSpec("cpu", (Phase("p", 60, 1.5, (RequestClass(1, (100, 300), (16, 64)),)),))
    trace = generate(spec, 60, 1)
    cfg = SimConfig(duration_s=60, num_prefill=1, num_decode=1, sla=SLA(2500, 100),
                    drain_grace_s=3600.0)  # fmt: skip
    cluster = Cluster(tiny, cfg)
    waited = 0
    original = DecodeWorker._admit_waiting

    def spy(self: DecodeWorker, now: float) -> None:
        nonlocal waited
        original(self, now)
        waited = max(waited, len(self.waiting))
        self.check_integrity()

    DecodeWorker._admit_waiting = spy  # type: ignore[method-assign]
    try:
        cluster.run(trace)
    finally:
        DecodeWorker._admit_waiting = original  # type: ignore[method-assign]
    assert waited > 0
    cluster.check_integrity()
    assert all(r.status == FINISHED for r in cluster.result("", 0.0).requests)
    assert all(w.free_blocks == 40 for w in cluster.workers.values() if isinstance(w, DecodeWorker))


def test_underprovisioned_prefill_has_worse_ttft() -> None:
    trace = small_trace(rate=40.0)  # ~44k prompt tokens/s: ~1.5 H200s of prefill
    starved = simulate(trace, H200_COST, static(1, 2)).summary()
    provisioned = simulate(trace, H200_COST, static(4, 2)).summary()
    assert starved.ttft_p90_ms > 10 * provisioned.ttft_p90_ms
    assert provisioned.ttft_p90_ms < GPU_SLA.ttft_p90_ms
    assert starved.attainment < 0.5 < 0.99 < provisioned.attainment
    assert starved.goodput_per_gpu < provisioned.goodput_per_gpu


def test_gpu_seconds_count_starting_and_draining_workers() -> None:
    trace = small_trace(rate=5.0, duration_s=200.0)
    result = simulate(trace, H200_COST, static(3, 2, 200.0, warmup_s=50.0))
    assert result.gpu_s == {"prefill": pytest.approx(3 * 150), "decode": pytest.approx(2 * 150)}
    assert result.summary().num_requests == sum(1 for r in trace if r.arrival_s >= 50)


def test_controller_scales_prefill_up_under_a_prefill_burst_and_back_down() -> None:
    light = (RequestClass(1.0, (200, 600), (50, 150)),)
    heavy = (RequestClass(1.0, (4000, 8000), (16, 64)),)
    spec = TraceSpec("burst", (
        Phase("light", 120, 10.0, light),
        Phase("prefill-heavy", 180, 15.0, heavy),  # ~90k prompt tokens/s: 3+ prefill workers
        Phase("light-after", 300, 10.0, light),
    ))  # fmt: skip
    cfg = sim_config("h200", 600.0, 1, 1, autoscale=True)
    cluster = run_cluster(generate(spec, 600, seed=0), cfg)
    cluster.check_integrity()
    assert cluster.removed_nonempty == 0
    series = cluster.series
    during = max(p.workers["prefill"] for p in series if 120 <= p.t < 300)
    after = series[-1].workers["prefill"]
    assert during >= 3
    assert after <= 2 < during
    reasons = [d.reasons["prefill"] for d in cluster.decisions if d.target != d.current]
    assert any(r.startswith("scale up") for r in reasons)
    assert any(r.startswith("scale down") for r in reasons)
    # Scale-down drained workers: they were removed, and only once empty.
    removed = [w for w in cluster.workers.values() if w.removed_s is not None]
    assert removed and all(w.is_empty() for w in removed)
    assert all(isinstance(w, PrefillWorker | DecodeWorker) for w in removed)


def test_scale_down_drains_a_busy_decode_worker_before_removing_it() -> None:
    cfg = sim_config("h200", 400.0, 1, 6, autoscale=True, drain_grace_s=3600.0)
    trace = small_trace(rate=10.0, duration_s=400.0)
    cluster = run_cluster(trace, cfg)
    decodes = [w for w in cluster.workers.values() if isinstance(w, DecodeWorker)]
    removed = [w for w in decodes if w.removed_s is not None]
    assert removed, "six decode workers for a light load: some must go"
    # A draining worker kept serving what it held: requests placed on it still finished.
    placed_on_removed = [
        r for r in cluster.result("", 0.0).requests if r.decode_id in {w.worker_id for w in removed}
    ]
    assert placed_on_removed and all(r.status == FINISHED for r in placed_on_removed)
    assert cluster.removed_nonempty == 0
    cluster.check_integrity()


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="num_decode"):
        SimConfig(num_decode=0)
    with pytest.raises(ValueError, match="warmup_s"):
        SimConfig(duration_s=10, warmup_s=10)
    assert CONTROL.decode_backlog_s > 0 and CONTROL.max_down_step == 2


# -- CLI ----------------------------------------------------------------------------------


def _cli(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="tandem")
    add_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["sim", *argv])
    assert args.func is sim_main
    return int(args.func(args))


def test_cli_runs_a_short_trace(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    png = tmp_path / "run.png"
    rc = _cli("--trace", "shifting", "--duration", "120", "--rate-scale", "0.3", "--autoscale",
              "--plot", str(png), "--json", str(tmp_path / "s.json"))  # fmt: skip
    assert rc == 0
    out = capsys.readouterr().out
    assert "goodput/GPU" in out and "attainment" in out and "mean GPUs" in out
    assert png.stat().st_size > 10_000
    assert '"goodput_per_gpu"' in (tmp_path / "s.json").read_text()
    assert _cli("--trace", "stationary", "--cost", "cpu", "--duration", "60",
                "--prefill", "2", "--decode", "1") == 0  # fmt: skip
    assert "static 2P:1D" in capsys.readouterr().err
    assert _cli("--duration", "60", "--warmup", "60") == 2  # warm-up must be shorter


# -- policy knobs the simulator relies on (tandem.control) --------------------------------


def test_decode_workers_for_follows_littles_law() -> None:
    model = (10.0, 2.0)  # step_ms = 10 + 2 * batch
    # 120 sequences on 4 workers: 30 each, 70 ms steps, 1714 tokens/s in all.
    rate = 4 * 1e3 * 30 / 70
    tick = [WorkerSample(t=0.0, worker_id=f"d{i}", role="decode", num_running=30) for i in range(4)]
    assert decode_token_rate([tick], model) == pytest.approx(rate)
    # 3 workers cannot generate that at any batch size (each tops out at 500 tokens/s).
    assert decode_workers_for(rate, model, max_batch=1000) == 4
    assert decode_workers_for(rate, model, max_batch=30) == 4
    assert decode_workers_for(rate, model, max_batch=29) == 5
    assert decode_workers_for(100.0, model, max_batch=30) == 1
    assert decode_workers_for(0.0, model, max_batch=30, waiting=61) == 3


def test_prefill_backlog_horizon_and_new_config_fields() -> None:
    w = WorkerSample(t=0.0, worker_id="p0", role="prefill", busy_frac=1.0, tokens_per_s=1000,
                     queued_prefill_tokens=20_000)  # fmt: skip
    sla = SLA(ttft_p90_ms=1000.0, itl_p90_ms=25.0)
    assert fit_prefill([w], sla)[1] == pytest.approx(1000 + 20_000 / 1.0)
    assert fit_prefill([w], sla, backlog_s=10.0)[1] == pytest.approx(1000 + 20_000 / 10.0)
    assert fit_prefill([w], sla, backlog_s=0.5)[1] == pytest.approx(1000 + 20_000 / 1.0)
    for kwargs, message in (({"max_down_step": 0}, "max_down_step"),
                            ({"decode_backlog_s": -1.0}, "decode_backlog_s")):  # fmt: skip
        with pytest.raises(ValueError, match=message):
            ControlConfig(**kwargs)
