"""tandem.services.common.observe.metrics with plain objects: the routing-reason categories of real
placements, histogram observations for a known chunk sequence, the names the dashboard and
`tandem ctl top` rely on, and the /metrics server."""

from __future__ import annotations

import asyncio
import re
import urllib.request
from collections.abc import Callable
from importlib.metadata import version
from typing import Any

import grpc
import pytest
from prometheus_client import CollectorRegistry, Histogram, generate_latest

from tandem.engine.sampling import SamplingParams
from tandem.load import Load
from tandem.routing import Placement, RouteKind, RouteRequest, RoutingConfig, WorkerLoad, choose
from tandem.services.common.observe.metrics import (
    RouterMetrics,
    WorkerMetrics,
    metric_names,
    observe_many,
    start_metrics_server,
    stop_metrics_server,
)
from tandem.services.common.rpc.errors import ServiceError


def w(worker_id: str, role: str) -> WorkerLoad:
    return WorkerLoad(
        worker_id=worker_id,
        role=role,
        address=f"{worker_id}:1",
        num_blocks=1000,
        num_free_blocks=1000,
    )


BOTH = [w("p0", "prefill"), w("d0", "decode")]
DECODE_ONLY = [w("d0", "decode")]


def placed(n: int, workers: list[WorkerLoad], policy: str = "kv", **overlap: int) -> Placement:
    config = RoutingConfig(policy=policy, disagg_min_uncached_tokens=64)
    p = choose(RouteRequest(n, block_size=16, overlap=overlap), workers, config)
    assert p is not None
    return p


@pytest.mark.parametrize(
    "placement, path, reason",
    [
        (placed(500, BOTH), "disaggregated", "kv_affinity"),
        (placed(500, BOTH, p0=10), "disaggregated", "kv_affinity"),
        (placed(63, BOTH), "colocated", "short_prompt"),
        (placed(1000, BOTH, d0=60), "colocated", "short_prompt"),  # 40 uncached on d0
        (placed(500, DECODE_ONLY), "colocated", "no_prefill_worker"),
        (placed(500, BOTH, "load"), "disaggregated", "load"),
        (placed(63, BOTH, "load"), "colocated", "short_prompt"),
        (placed(500, DECODE_ONLY, "load"), "colocated", "no_prefill_worker"),
        (placed(500, BOTH, "round_robin"), "disaggregated", "round_robin"),
        (placed(63, BOTH, "round_robin"), "colocated", "round_robin"),
    ],
)
def test_route_kind_is_a_bounded_category_of_real_placements(
    placement: Placement, path: str, reason: str
) -> None:
    assert placement.disaggregated == (path == "disaggregated")
    assert placement.kind == reason
    assert reason in tuple(RouteKind)


def test_a_placement_counts_under_its_kind() -> None:
    m = RouterMetrics()
    m.placed(placed(63, BOTH), 0.0)
    labels = {"path": "colocated", "reason": "short_prompt"}
    assert sample(m.registry, "tandem_router_routing_decisions_total", **labels) == 1.0
    assert sample(m.registry, "tandem_router_routing_decisions_total", path="colocated",
                  reason="kv_affinity") == 0.0  # fmt: skip


def sample(registry: CollectorRegistry, name: str, **labels: str) -> float:
    value = registry.get_sample_value(name, labels)
    assert value is not None, (name, labels)
    return value


def test_a_chunk_sequence_gives_ttft_and_one_gap_per_token() -> None:
    m = RouterMetrics()
    r = m.registry
    # Admitted at t=10; token 1 at 10.5; one token 1/64 s later; then 4 tokens after 4/64 s
    # (binary fractions: the bucket edges below are exact).
    t_last = 0.0
    for n, now in [(1, 10.5), (0, 10.51), (1, 10.515625), (4, 10.578125)]:
        t_last = m.streamed(True, 10.0, t_last, n, now)
    assert t_last == 10.578125
    ttft = "tandem_router_time_to_first_token_seconds"
    itl = "tandem_router_inter_token_latency_seconds"
    assert sample(r, f"{ttft}_count", path="disaggregated") == 1
    assert sample(r, f"{ttft}_sum", path="disaggregated") == pytest.approx(0.5)
    assert sample(r, f"{ttft}_count", path="colocated") == 0
    assert sample(r, f"{itl}_count", path="disaggregated") == 5  # 1 + 4 gaps of 1/64 s
    assert sample(r, f"{itl}_sum", path="disaggregated") == 5 / 64
    assert sample(r, f"{itl}_bucket", path="disaggregated", le="0.015") == 0
    assert sample(r, f"{itl}_bucket", path="disaggregated", le="0.02") == 5
    assert sample(r, f"{itl}_bucket", path="disaggregated", le="+Inf") == 5

    m.completed(True, aborted=False, elapsed_s=0.7)
    m.completed(False, aborted=True, elapsed_s=0.1)
    e2e = "tandem_router_e2e_request_latency_seconds"
    assert sample(r, f"{e2e}_count", path="disaggregated") == 1
    assert sample(r, f"{e2e}_count", path="colocated") == 0  # aborted: no latency
    assert sample(r, "tandem_router_requests_total", outcome="finished", code="OK") == 1
    assert sample(r, "tandem_router_requests_total", outcome="aborted", code="OK") == 1


def test_outcomes_of_a_raised_generate() -> None:
    m = RouterMetrics()
    m.raised(ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED, "busy"), completed=False)
    m.raised(asyncio.CancelledError(), completed=False)  # the client went away
    m.raised(GeneratorExit(), completed=True)  # ... after its final message: counted then
    m.raised(RuntimeError("bug"), completed=False)
    total = "tandem_router_requests_total"
    r = m.registry
    assert sample(r, total, outcome="error", code="RESOURCE_EXHAUSTED") == 1
    assert sample(r, total, outcome="aborted", code="OK") == 1
    assert sample(r, total, outcome="error", code="UNKNOWN") == 1


def test_worker_aborts_split_answered_late_and_failed() -> None:
    m = RouterMetrics()
    r = m.registry
    m.worker_abort("prefill", 0.004)
    m.worker_abort("prefill", 0.1)  # at the limit: still answered in time
    m.worker_abort("prefill", 0.35)
    m.worker_abort("decode", None)
    aborts = "tandem_router_worker_aborts_total"
    assert sample(r, aborts, role="prefill", outcome="answered") == 2
    assert sample(r, aborts, role="prefill", outcome="late") == 1
    assert sample(r, aborts, role="decode", outcome="failed") == 1
    assert sample(r, "tandem_router_worker_abort_seconds_count", role="prefill") == 3
    assert sample(r, "tandem_router_worker_abort_seconds_count", role="decode") == 0
    assert sample(r, "tandem_router_worker_abort_seconds_bucket", role="prefill", le="0.005") == 1


def test_routing_recoveries_tokens_and_workers() -> None:
    m = RouterMetrics()
    r = m.registry
    m.placed(placed(500, BOTH), queue_s=0.003)
    m.placed(placed(63, BOTH), queue_s=0.001)
    m.recovery("kv_pull_failed", "reprefill")
    m.tokens(prompt=500, generated=7, cached=32)
    m.set_workers({("decode", "healthy"): 2, ("prefill", "open_breaker"): 1})
    decisions = "tandem_router_routing_decisions_total"
    assert sample(r, decisions, path="disaggregated", reason="kv_affinity") == 1
    assert sample(r, decisions, path="colocated", reason="short_prompt") == 1
    assert sample(r, decisions, path="colocated", reason="no_prefill_worker") == 0
    assert sample(r, "tandem_router_queue_seconds_count") == 2
    assert sample(r, "tandem_router_recoveries_total", fault="kv_pull_failed",
                  action="reprefill") == 1  # fmt: skip
    assert sample(r, "tandem_router_prompt_tokens_total") == 500
    assert sample(r, "tandem_router_generation_tokens_total") == 7
    assert sample(r, "tandem_router_cached_prompt_tokens_total") == 32
    workers = "tandem_router_workers"
    assert sample(r, workers, role="decode", state="healthy") == 2
    assert sample(r, workers, role="prefill", state="open_breaker") == 1
    assert sample(r, workers, role="prefill", state="healthy") == 0
    m.set_workers({})
    assert sample(r, workers, role="decode", state="healthy") == 0


@pytest.mark.parametrize("value", [0.0001, 0.02, 0.021, 1.9, 2.0, 3.0])
def test_observe_many_is_count_single_observations(value: float) -> None:
    one = Histogram("one", "", buckets=(0.001, 0.02, 2.0), registry=CollectorRegistry())
    many = Histogram("many", "", buckets=(0.001, 0.02, 2.0), registry=CollectorRegistry())
    for _ in range(7):
        one.observe(value)
    observe_many(many, value, 7)
    assert [s.value for s in many.collect()[0].samples] == pytest.approx(
        [s.value for s in one.collect()[0].samples]
    )


@pytest.mark.parametrize("component", ["router", "prefill", "decode"])
def test_build_info_is_one_with_version_and_component(component: str) -> None:
    m: Any = RouterMetrics() if component == "router" else WorkerMetrics(component)
    labels = {"version": version("tandem"), "component": component}
    assert sample(m.registry, "tandem_build_info", **labels) == 1


HISTOGRAM = ("_bucket", "_sum", "_count")


def names(*bases: str, suffixes: tuple[str, ...] = ("",)) -> set[str]:
    return {b + s for b in bases for s in suffixes}


def test_metric_names_are_the_spec() -> None:
    assert metric_names("router") == (
        names(
            "tandem_router_time_to_first_token_seconds",
            "tandem_router_inter_token_latency_seconds",
            "tandem_router_e2e_request_latency_seconds",
            "tandem_router_queue_seconds",
            "tandem_router_worker_abort_seconds",
            "tandem_router_queue_delay_estimate_seconds",
            "tandem_router_queue_delay_seconds",
            suffixes=HISTOGRAM,
        )
        | names(
            "tandem_router_requests",
            "tandem_router_prompt_tokens",
            "tandem_router_generation_tokens",
            "tandem_router_cached_prompt_tokens",
            "tandem_router_routing_decisions",
            "tandem_router_recoveries",
            "tandem_router_ejections",
            "tandem_router_worker_aborts",
            "tandem_router_admission_refusals",
            suffixes=("_total",),
        )
        | names(
            "tandem_router_requests_running",
            "tandem_router_prefix_index_degraded",
            "tandem_router_workers",
            "tandem_build_info",
        )
    )
    worker = names(
        "tandem_worker_step_seconds", "tandem_worker_queue_seconds", suffixes=HISTOGRAM
    ) | names(
        "tandem_worker_prefix_cache_queried_tokens_total",
        "tandem_worker_prefix_cache_hit_tokens_total",
        "tandem_worker_requests_running",
        "tandem_worker_requests_waiting",
        "tandem_worker_kv_blocks_used",
        "tandem_worker_kv_blocks_capacity",
        "tandem_worker_aborts_total",
        "tandem_worker_kv_blocks_reaped_total",
        "tandem_worker_kv_audit_violations_total",
        "tandem_worker_preemptions_total",
        "tandem_build_info",
    )
    assert metric_names("prefill") == worker | {"tandem_worker_lease_expired_total"}
    assert metric_names("decode") == (
        worker
        | names("tandem_worker_kv_transfer_seconds", suffixes=HISTOGRAM)
        | names("tandem_worker_kv_wire_bytes_per_token", suffixes=HISTOGRAM)
        | {
            "tandem_worker_kv_transfer_bytes_total",
            "tandem_worker_kv_transfers_total",
            "tandem_worker_kv_recomputed_total",
        }
    )
    assert "tandem_controller_replicas" in metric_names("controller")
    with pytest.raises(ValueError, match="component"):
        metric_names("gateway")


def test_every_listed_name_is_in_the_exposition() -> None:
    for component in ("router", "prefill", "decode"):
        m: Any = RouterMetrics() if component == "router" else WorkerMetrics(component)
        text = generate_latest(m.registry).decode()
        for name in metric_names(component):
            # a sample, or (a labelled family with no series yet) its TYPE line
            assert re.search(rf"^(# TYPE )?{name}[ {{]", text, re.MULTILINE), name


def test_engine_gauges_are_read_when_scraped() -> None:
    stats = [
        Load(num_running=3, num_waiting=2, num_blocks=100, num_free_blocks=40, num_preemptions=7)
    ]
    m = WorkerMetrics("decode", lambda: stats[0])
    r = m.registry
    assert sample(r, "tandem_worker_requests_running", role="decode") == 3
    assert sample(r, "tandem_worker_requests_waiting", role="decode") == 2
    assert sample(r, "tandem_worker_kv_blocks_used", role="decode") == 60
    assert sample(r, "tandem_worker_kv_blocks_capacity", role="decode") == 100
    assert sample(r, "tandem_worker_preemptions_total", role="decode") == 7
    stats[0] = Load(num_blocks=100, num_free_blocks=100, num_preemptions=9)
    assert sample(r, "tandem_worker_kv_blocks_used", role="decode") == 0
    assert sample(r, "tandem_worker_preemptions_total", role="decode") == 9


def test_queue_time_and_prefix_cache_tokens_at_first_schedule(
    tiny_model_dir: Any, engine_factory: Callable[..., Any]
) -> None:
    engine = engine_factory(tiny_model_dir, block_size=4)
    m = WorkerMetrics("prefill", engine.stats)
    r = m.registry
    prompt = list(range(5, 25))  # 20 tokens: 4 full blocks cacheable (the last token never)
    params = SamplingParams(max_tokens=2, temperature=0.0)
    for rid in ("a", "b"):
        m.admitted(rid)
        engine.add_request(engine.spec(rid, prompt, params))
        while engine.has_unfinished():
            engine.step()
            m.after_step(engine, 0.001)
    m.admitted("gone")  # never added: dropped once it has been missing twice
    m.after_step(engine, 0.001)
    m.after_step(engine, 0.001)
    assert m._pending == {}
    assert sample(r, "tandem_worker_queue_seconds_count", role="prefill") == 2
    assert sample(r, "tandem_worker_step_seconds_count", role="prefill") >= 4
    assert sample(r, "tandem_worker_prefix_cache_queried_tokens_total", role="prefill") == 40
    assert sample(r, "tandem_worker_prefix_cache_hit_tokens_total", role="prefill") == 16


def test_kv_transfer_outcomes() -> None:
    m = WorkerMetrics("decode")
    r = m.registry
    m.kv_transfer("committed", 4096, 0.002)
    m.kv_transfer("lapsed", 4096, 0.003)
    m.kv_transfer("refused")
    assert sample(r, "tandem_worker_kv_transfer_bytes_total") == 8192
    assert sample(r, "tandem_worker_kv_transfer_seconds_count") == 2
    for outcome, n in [("committed", 1), ("lapsed", 1), ("failed", 0), ("refused", 1)]:
        assert sample(r, "tandem_worker_kv_transfers_total", outcome=outcome) == n


def test_wire_bytes_per_token_of_a_hand_off() -> None:
    """Bytes over the transport per token slot of the blocks read: DeepSeek-V3's latent, one
    copy (576 bf16 numbers x 61 layers = 70,272 bytes), whatever the TP sizes."""
    from tandem.services.common.worker.kv_pull import Pulled

    m = WorkerMetrics("decode")
    r = m.registry
    m.kv_pulled(Pulled(True, 0, 5 * 16 * 70_272, 1.0, num_tokens=5 * 16), 70)
    m.kv_pulled(Pulled(False, 0, 0, 0.0, "refused", num_tokens=0), 70)  # nothing read
    assert sample(r, "tandem_worker_kv_wire_bytes_per_token_count") == 1
    assert sample(r, "tandem_worker_kv_wire_bytes_per_token_sum") == 70_272


def test_metrics_server_binds_the_host_and_a_free_port() -> None:
    m = RouterMetrics()
    server, port = start_metrics_server("127.0.0.1", 0, m.registry)
    try:
        assert port > 0 and server.server_address[0] == "127.0.0.1"
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
            text = resp.read().decode()
        assert 'tandem_build_info{component="router"' in text
    finally:
        stop_metrics_server(server)
