"""tandem.services.common.observe.tracing without a collector: off by default, W3C context round
trips
through gRPC metadata, span status on errors, and the attributes computed from plain data
(route candidates, KV read descriptors, engine phases)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import NamedTuple

import grpc
import pytest
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from tandem.routing import RouteKind, RouteRequest, RoutingConfig, WorkerLoad, choose, weigh
from tandem.services.common.observe import tracing
from tandem.services.common.rpc.errors import ServiceError, unavailable

CLIENT_TRACE_ID = 0x4BF92F3577B34DA6A3CE929D0E0E4736
CLIENT_TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


class FakeContext:
    """The part of grpc.aio.ServicerContext that tracing reads."""

    def __init__(self, metadata: tuple[tuple[str, str], ...] | None) -> None:
        self._metadata = metadata

    def invocation_metadata(self) -> tuple[tuple[str, str], ...] | None:
        return self._metadata


@pytest.fixture
def exporter(monkeypatch: pytest.MonkeyPatch) -> Iterator[InMemorySpanExporter]:
    """Tracing on, into memory (the module's provider only: the process-global one of
    OpenTelemetry can be set once, and other tests must not see it)."""
    memory = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource.create({SERVICE_NAME: "tandem-test"}))
    provider.add_span_processor(SimpleSpanProcessor(memory))
    monkeypatch.setattr(tracing, "_provider", provider)
    yield memory
    provider.shutdown()


def finished(memory: InMemorySpanExporter, name: str) -> ReadableSpan:
    spans = [s for s in memory.get_finished_spans() if s.name == name]
    assert len(spans) == 1, [s.name for s in memory.get_finished_spans()]
    return spans[0]


def test_off_by_default_is_a_no_op(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(tracing.ENDPOINT_ENV, raising=False)
    monkeypatch.setattr(tracing, "_provider", None)
    assert not tracing.setup_tracing("tandem-test", "")
    assert not tracing.enabled()
    span = tracing.start_span("tandem.generate", tracing.remote_parent(FakeContext(None)))
    assert span is tracing.INVALID_SPAN and not span.is_recording()
    # No metadata read or written: a client's traceparent is not even parsed.
    assert tracing.remote_parent(FakeContext((("traceparent", CLIENT_TRACEPARENT),))) is None
    assert tracing.headers(span) is None
    with tracing.span("tandem.route", span) as child:
        assert not child.is_recording()
    tracing.recovery_step(span, "decode_failed", "migrate", "why")
    tracing.engine_phases(span, "q", "c", 0.0, 0.1)
    tracing.kv_plan(span, [1, 2], [3, 4])


def test_headers_and_remote_parent_round_trip(exporter: InMemorySpanExporter) -> None:
    root = tracing.start_span("tandem.generate")
    metadata = tracing.headers(root)
    assert metadata is not None and dict(metadata)["traceparent"].startswith("00-")
    # What the worker's handler sees: the router's metadata plus unrelated keys.
    incoming = FakeContext((("x-tandem-cluster-key", "k"), *metadata))
    child = tracing.start_span("tandem.decode", tracing.remote_parent(incoming))
    child.end()
    root.end()
    got, parent = finished(exporter, "tandem.decode"), finished(exporter, "tandem.generate")
    assert got.context.trace_id == parent.context.trace_id
    assert got.parent is not None and got.parent.span_id == parent.context.span_id
    assert got.resource.attributes[SERVICE_NAME] == "tandem-test"


def test_a_clients_traceparent_is_honoured(exporter: InMemorySpanExporter) -> None:
    incoming = FakeContext((("traceparent", CLIENT_TRACEPARENT),))
    span = tracing.start_span("tandem.generate", tracing.remote_parent(incoming))
    span.end()
    got = finished(exporter, "tandem.generate")
    assert got.context.trace_id == CLIENT_TRACE_ID
    assert got.parent is not None and got.parent.span_id == 0x00F067AA0BA902B7


def test_without_trace_metadata_a_span_starts_a_new_trace(
    exporter: InMemorySpanExporter,
) -> None:
    assert tracing.remote_parent(FakeContext((("authorization", "Bearer k"),))) is None
    with tracing.span("tandem.generate", None) as outer:
        inner = tracing.start_span("tandem.prefill", None)  # not a child of the open one
        inner.end()
    assert inner.get_span_context().trace_id != outer.get_span_context().trace_id


def test_an_exception_sets_the_error_status_and_attributes(
    exporter: InMemorySpanExporter,
) -> None:
    parent = tracing.start_span("tandem.decode")
    with pytest.raises(ServiceError):
        with tracing.span(
            "tandem.kv_transfer", parent, error_attributes={"tandem.kv.outcome": "refused"}
        ):
            raise unavailable("no decode worker")
    parent.end()
    got = finished(exporter, "tandem.kv_transfer")
    assert got.status.status_code is StatusCode.ERROR
    assert got.status.description is not None and "UNAVAILABLE" in got.status.description
    assert got.attributes is not None and got.attributes["tandem.kv.outcome"] == "refused"
    assert got.parent is not None and got.parent.span_id == parent.get_span_context().span_id


def test_a_failed_rpc_names_its_status_code(exporter: InMemorySpanExporter) -> None:
    span = tracing.start_span("tandem.generate")
    error = grpc.aio.AioRpcError(grpc.StatusCode.DEADLINE_EXCEEDED, None, None, "slow")
    tracing.fail(span, error)
    span.end()
    got = finished(exporter, "tandem.generate")
    assert got.status.description is not None
    assert got.status.description.startswith("DEADLINE_EXCEEDED")


def test_recovery_step_and_lease_spans(exporter: InMemorySpanExporter) -> None:
    root = tracing.start_span("tandem.generate")
    tracing.recovery_step(root, "kv_pull_failed", "reprefill", "prefill again on p1")
    tracing.recovery_step(root, "decode_failed", "fail", "budget spent")
    lease = tracing.start_lease(root, "lease-1", 10.0)
    tracing.end_lease(lease, "confirmed")
    tracing.end_lease(None, "expired")  # untraced lease: nothing to end
    root.end()
    steps = [s for s in exporter.get_finished_spans() if s.name == "tandem.recovery"]
    assert [s.attributes["tandem.recovery.action"] for s in steps if s.attributes] == [
        "reprefill",
        "fail",
    ]
    assert [s.status.status_code for s in steps] == [StatusCode.UNSET, StatusCode.ERROR]
    got = finished(exporter, "tandem.lease")
    assert got.attributes == {
        "tandem.lease.id": "lease-1",
        "tandem.lease.ttl_s": 10.0,
        "tandem.lease.outcome": "confirmed",
    }


class Pull(NamedTuple):
    committed: bool
    num_bytes: int
    transfer_ms: float
    failure: str = ""


def test_kv_transfer_attributes(exporter: InMemorySpanExporter) -> None:
    ok = tracing.start_span("tandem.kv_transfer")
    # Blocks 4,5,6 -> 0,1,2 are one run; 9 -> 7 another: two descriptors.
    tracing.kv_plan(ok, [4, 5, 6, 9], [0, 1, 2, 7])
    tracing.kv_result(ok, Pull(True, 2_000_000, 1.0), "lease-7", recompute=False)
    ok.end()
    attrs = exporter.get_finished_spans()[0].attributes
    assert attrs is not None
    assert attrs["tandem.kv.blocks"] == 4 and attrs["tandem.kv.descriptors"] == 2
    assert attrs["tandem.kv.bytes"] == 2_000_000 and attrs["tandem.kv.gbps"] == pytest.approx(2.0)
    assert attrs["tandem.kv.lease_id"] == "lease-7"
    assert attrs["tandem.kv.outcome"] == "committed"

    exporter.clear()
    bad = tracing.start_span("tandem.kv_transfer")
    bad.set_attribute("tandem.kv.outcome", "lapsed")  # as the pull sets it
    tracing.kv_result(bad, Pull(False, 0, 0.0, "lease lapsed"), "lease-8", recompute=True)
    bad.end()
    got = exporter.get_finished_spans()[0]
    assert got.attributes is not None and got.attributes["tandem.kv.outcome"] == "recomputed"
    assert got.attributes["tandem.kv.gbps"] == 0.0
    assert got.status.status_code is StatusCode.ERROR


def test_engine_phases_split_at_the_last_step(exporter: InMemorySpanExporter) -> None:
    parent = tracing.start_span("tandem.prefill")
    t_start = time.perf_counter() - 0.5
    tracing.engine_phases(parent, "tandem.prefill.queue", "tandem.prefill.compute", t_start, 0.2)
    parent.end()
    queue = finished(exporter, "tandem.prefill.queue")
    compute = finished(exporter, "tandem.prefill.compute")
    assert queue.end_time is not None and queue.start_time is not None
    assert compute.end_time is not None and compute.start_time is not None
    assert queue.end_time == compute.start_time
    assert abs((compute.end_time - compute.start_time) / 1e9 - 0.2) < 0.05
    assert abs((queue.end_time - queue.start_time) / 1e9 - 0.3) < 0.05


def test_route_candidates_score_what_choose_weighs() -> None:
    config = RoutingConfig(cache_weight=2.0, disagg_min_uncached_tokens=8)
    workers = [
        WorkerLoad(worker_id="p1", role="prefill", address="a:1", queued_prefill_tokens=10),
        WorkerLoad(
            worker_id="d1",
            role="decode",
            address="a:3",
            num_running=2,
            num_free_blocks=50,
            num_blocks=64,
        ),
        WorkerLoad(worker_id="p0", role="prefill", address="a:0", queued_prefill_tokens=0),
    ]
    request = RouteRequest(num_prompt_tokens=100, block_size=16, overlap={"p1": 4})
    placement = choose(request, workers, config)
    assert placement is not None
    assert placement.candidates == weigh(request, workers, config)
    candidates = tracing.route_candidates(placement.candidates)
    assert candidates == [
        {"worker": "d1", "role": "decode", "cached_tokens": 0, "load": 2, "free_blocks": 50},
        {"worker": "p0", "role": "prefill", "cached_tokens": 0, "queue": 0, "cost": 200.0},
        {"worker": "p1", "role": "prefill", "cached_tokens": 64, "queue": 10, "cost": 82.0},
    ]
    # The lowest cost is the policy's choice.
    assert placement.prefill is not None
    assert placement.prefill.worker_id == "p1"
    assert placement.kind is RouteKind.KV_AFFINITY


def test_annotate_route(exporter: InMemorySpanExporter) -> None:
    config = RoutingConfig()
    workers = [
        WorkerLoad(worker_id="d1", role="decode", address="a:3"),
        WorkerLoad(worker_id="p0", role="prefill", address="a:0"),
    ]
    request = RouteRequest(num_prompt_tokens=500, block_size=16)
    placement = choose(request, workers, config)
    span = tracing.start_span("tandem.route")
    assert placement is not None
    tracing.annotate_route(span, placement.candidates, placement, index_degraded=True)
    span.end()
    attrs = finished(exporter, "tandem.route").attributes
    assert attrs is not None
    assert attrs["tandem.route.reason"] == placement.reason
    assert attrs["tandem.route.kind"] == "kv_affinity"
    assert attrs["tandem.route.path"] == "disaggregated"
    assert attrs["tandem.index.degraded"] is True
    assert [c["worker"] for c in json.loads(str(attrs["tandem.route.candidates"]))] == ["d1", "p0"]


def test_annotate_route_without_a_placement_lists_what_was_weighed(
    exporter: InMemorySpanExporter,
) -> None:
    config = RoutingConfig()
    workers = [
        WorkerLoad(worker_id="d1", role="decode", address="a:3", draining=True),
        WorkerLoad(worker_id="p0", role="prefill", address="a:0"),
    ]
    request = RouteRequest(num_prompt_tokens=500, block_size=16)
    assert choose(request, workers, config) is None  # the only decode worker drains
    span = tracing.start_span("tandem.route")
    tracing.annotate_route(span, weigh(request, workers, config), None, index_degraded=False)
    span.end()
    attrs = finished(exporter, "tandem.route").attributes
    assert attrs is not None and "tandem.route.reason" not in attrs
    assert json.loads(str(attrs["tandem.route.candidates"])) == [
        {"worker": "d1", "role": "decode", "cached_tokens": 0, "draining": True, "load": 0,
         "free_blocks": 0},
        {"worker": "p0", "role": "prefill", "cached_tokens": 0, "queue": 0, "cost": 1000.0},
    ]  # fmt: skip
