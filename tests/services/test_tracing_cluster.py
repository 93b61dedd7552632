"""Traces across real processes: a `tandem up` cluster (router, 1 prefill, 1 decode) exports
spans over OTLP/gRPC to an in-process collector (opentelemetry-proto's TraceService), and
each request is one trace whose spans come from all the processes it touched, parented
across them through the W3C `traceparent` in gRPC metadata."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2 as tspb
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc as tsgrpc
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

from tandem.services.up import Cluster
from tandem.v1 import router_pb2 as rpb
from tandem.v1 import router_pb2_grpc as rgrpc
from tandem.weights.tiny import make_tiny_model
from tests.services.conftest import up_cluster

CLIENT_TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN_ID = "00f067aa0ba902b7"
WAIT_S = 30.0


@dataclass(frozen=True)
class Span:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_id: str
    attributes: dict[str, Any]
    error: bool


def _value(v: AnyValue) -> Any:
    return getattr(v, v.WhichOneof("value")) if v.WhichOneof("value") else None


class Collector(tsgrpc.TraceServiceServicer):
    """An OTLP trace receiver: keeps every exported span."""

    def __init__(self) -> None:
        self.spans: list[Span] = []

    def Export(
        self, request: tspb.ExportTraceServiceRequest, context: grpc.ServicerContext
    ) -> tspb.ExportTraceServiceResponse:
        for rs in request.resource_spans:
            resource = {a.key: _value(a.value) for a in rs.resource.attributes}
            for ss in rs.scope_spans:
                for s in ss.spans:
                    self.spans.append(
                        Span(
                            service=str(resource.get("service.name", "")),
                            name=s.name,
                            trace_id=s.trace_id.hex(),
                            span_id=s.span_id.hex(),
                            parent_id=s.parent_span_id.hex(),
                            attributes={a.key: _value(a.value) for a in s.attributes},
                            error=s.status.code == s.status.STATUS_CODE_ERROR,
                        )
                    )
        return tspb.ExportTraceServiceResponse()

    def trace(self, trace_id: str, until: Any, what: str) -> list[Span]:
        """The spans of `trace_id` once `until(spans)` holds (bounded wait)."""
        deadline = time.monotonic() + WAIT_S
        while True:
            spans = [s for s in list(self.spans) if s.trace_id == trace_id]
            if until(spans):
                return spans
            if time.monotonic() > deadline:
                names = sorted((s.service, s.name) for s in spans)
                raise AssertionError(f"{what} within {WAIT_S:g}s; trace has {names}")
            time.sleep(0.05)


@pytest.fixture(scope="module")
def collector() -> Iterator[tuple[Collector, int]]:
    servicer = Collector()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    tsgrpc.add_TraceServiceServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield servicer, port
    finally:
        server.stop(grace=None)


@pytest.fixture(scope="module")
def cluster(collector, tmp_path_factory) -> Iterator[Cluster]:
    _, port = collector
    model_dir: Path = make_tiny_model(tmp_path_factory.mktemp("trace") / "tiny", preset="tiny")
    with pytest.MonkeyPatch.context() as env:
        # The children inherit these: the standard OpenTelemetry variables turn tracing on.
        env.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{port}")
        env.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")  # ms: spans arrive quickly
        cm = up_cluster(model_dir, tmp_path_factory.mktemp("run"))
        c = cm.__enter__()  # started while the variables are set
    try:
        yield c
    finally:
        cm.__exit__(None, None, None)


def generate(cluster: Cluster, prompt: list[int], metadata: tuple = ()) -> rpb.Complete:
    with grpc.insecure_channel(cluster.router_address) as channel:
        stub = rgrpc.RouterStub(channel)
        request = rpb.GenerateRequest(
            token_ids=rpb.TokenIds(ids=prompt),
            sampling=rpb.SamplingParams(max_tokens=6, ignore_eos=True),
        )
        messages = list(stub.Generate(request, metadata=metadata, timeout=60))
    assert messages[-1].WhichOneof("kind") == "complete", messages[-1]
    return messages[-1].complete


def one(spans: list[Span], name: str) -> Span:
    found = [s for s in spans if s.name == name]
    assert len(found) == 1, (name, [(s.service, s.name) for s in spans])
    return found[0]


def test_a_disaggregated_request_is_one_trace_across_three_processes(cluster, collector):
    spans_in, _ = collector
    traceparent = f"00-{CLIENT_TRACE_ID}-{CLIENT_SPAN_ID}-01"
    complete = generate(cluster, list(range(5, 205)), (("traceparent", traceparent),))
    assert complete.timings.disaggregated

    wanted = {"tandem.generate", "tandem.prefill", "tandem.decode", "tandem.kv_transfer"}
    spans = spans_in.trace(
        CLIENT_TRACE_ID,
        lambda ss: wanted <= {s.name for s in ss} and "tandem.lease" in {s.name for s in ss},
        "the router's, prefill's and decode's spans",
    )
    # Exactly one trace: nothing of this request was exported under another trace id.
    rid = one(spans, "tandem.generate").attributes["tandem.request_id"]
    others = [s for s in spans_in.spans if s.attributes.get("tandem.request_id") == rid]
    assert {s.trace_id for s in others} == {CLIENT_TRACE_ID}

    by_id = {s.span_id: s for s in spans}
    generate_span = one(spans, "tandem.generate")
    assert generate_span.service == "tandem-router"
    assert generate_span.parent_id == CLIENT_SPAN_ID  # the client's span is its parent
    assert generate_span.attributes["tandem.output_tokens"] == 6
    for name in ("tandem.tokenize", "tandem.route"):
        assert one(spans, name).parent_id == generate_span.span_id

    route = one(spans, "tandem.route")
    assert route.attributes["tandem.route.path"] == "disaggregated"
    assert route.attributes["tandem.route.reason"] == complete.timings.route_reason
    assert '"role": "prefill"' in route.attributes["tandem.route.candidates"]

    prefill = one(spans, "tandem.prefill")
    decode = one(spans, "tandem.decode")
    assert prefill.service == "tandem-prefill" and decode.service == "tandem-decode"
    # Parented across processes: the router's span is the workers' parent.
    assert prefill.parent_id == generate_span.span_id
    assert decode.parent_id == generate_span.span_id
    assert prefill.attributes["tandem.prompt_tokens"] == 200
    assert decode.attributes["tandem.output_tokens"] == 5  # token 1 came from prefill
    for name in ("tandem.prefill.queue", "tandem.prefill.compute", "tandem.lease"):
        assert one(spans, name).parent_id == prefill.span_id
    for name in ("tandem.kv_transfer", "tandem.decode.queue", "tandem.decode.first_step"):
        assert one(spans, name).parent_id == decode.span_id

    kv = one(spans, "tandem.kv_transfer").attributes
    assert kv["tandem.kv.outcome"] == "committed"
    assert kv["tandem.kv.bytes"] > 0
    assert kv["tandem.kv.blocks"] > 0 and kv["tandem.kv.descriptors"] >= 1
    assert kv["tandem.kv.gbps"] > 0
    lease = one(spans, "tandem.lease").attributes
    assert kv["tandem.kv.lease_id"] == lease["tandem.lease.id"]
    assert lease["tandem.lease.outcome"] == "confirmed"
    assert not any(s.error for s in spans), [s.name for s in spans if s.error]
    assert all(s.parent_id in by_id for s in spans if s is not generate_span)


def test_a_short_request_is_a_separate_trace_without_prefill_spans(cluster, collector):
    spans_in, _ = collector
    complete = generate(cluster, list(range(5, 25)))
    assert not complete.timings.disaggregated

    def generate_spans() -> list[Span]:
        return [
            s
            for s in list(spans_in.spans)
            if s.name == "tandem.generate" and s.trace_id != CLIENT_TRACE_ID
            and s.attributes.get("tandem.prompt_tokens") == 20
        ]  # fmt: skip

    deadline = time.monotonic() + WAIT_S
    while not generate_spans() and time.monotonic() < deadline:
        time.sleep(0.05)
    [root] = generate_spans()
    assert root.parent_id == ""  # no client context: the router starts the trace
    spans = spans_in.trace(
        root.trace_id, lambda ss: "tandem.decode" in {s.name for s in ss}, "the decode span"
    )
    names = {s.name for s in spans}
    assert "tandem.prefill" not in names and "tandem.kv_transfer" not in names
    assert one(spans, "tandem.route").attributes["tandem.route.path"] == "colocated"
    assert one(spans, "tandem.decode").parent_id == root.span_id
