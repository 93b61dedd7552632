"""OpenTelemetry traces: one trace per request, across the router and both workers.

Off unless an OTLP endpoint is configured (the `otlp_endpoint` config field, or the standard
OTEL_EXPORTER_OTLP_ENDPOINT): then spans go through a BatchSpanProcessor to an OTLP gRPC
exporter, tagged with the resource `service.name` (tandem-router, tandem-prefill,
tandem-decode). Off, every span is OpenTelemetry's non-recording span, no metadata is read
or written, and nothing is exported.

W3C trace context (`traceparent`, `tracestate`) travels in gRPC metadata: `remote_parent`
reads it from an incoming call (a client's traceparent is honoured by the router), and
`headers(span)` is the metadata an outgoing call passes to continue the trace (router ->
worker, decode -> prefill). Spans are passed explicitly, never made "current": the handlers
that hold them are async generators, which a context attached across a `yield` would leak.

The span and attribute names are documented in docs/architecture.md ("Traces"); per-token
work stays at zero (no span or event per token).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Protocol

import grpc
from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import INVALID_SPAN, Span, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from tandem.routing import Candidate, Placement
from tandem.services.common.worker.kv_pull import Pulled
from tandem.transfer import coalesce
from tandem.types import KVOutcome, Role

log = logging.getLogger(__name__)

TRACER_NAME = "tandem"
ENDPOINT_ENV = "OTEL_EXPORTER_OTLP_ENDPOINT"
TRACE_HEADERS = ("traceparent", "tracestate")
MAX_ROUTE_CANDIDATES = 32  # bounds the route span's candidates attribute on a large fleet

_PROPAGATOR = TraceContextTextMapPropagator()
# The process's exporting provider once set up. OpenTelemetry's own provider is
# process-global too; this mirrors it so that "off" costs one attribute read.
_provider: Any = None

__all__ = [
    "INVALID_SPAN",
    "Span",
    "enabled",
    "headers",
    "kv_plan",
    "kv_result",
    "remote_parent",
    "route_candidates",
    "setup_tracing",
    "span",
    "start_span",
]


def setup_tracing(service_name: str, endpoint: str = "") -> bool:
    """Export this process's spans to `endpoint` (or OTEL_EXPORTER_OTLP_ENDPOINT), as
    `service_name`. Returns whether tracing is on. Idempotent: the first call that turns it
    on wins (OpenTelemetry's provider can be set once per process).

    The endpoint is the collector's OTLP gRPC address, e.g. `http://collector:4317`
    (`http://`: plaintext; `https://`: TLS); the other OTEL_EXPORTER_OTLP_* and OTEL_BSP_*
    variables apply as usual.
    """
    global _provider
    if _provider is not None:
        return True
    endpoint = endpoint or os.environ.get(ENDPOINT_ENV, "")
    if not endpoint:
        return False
    # Imported only when on: the SDK and the exporter cost nothing to a process without.
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = TracerProvider(resource=Resource.create({SERVICE_NAME: service_name}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    trace.set_tracer_provider(provider)
    _provider = provider
    log.info("tracing on: %s exports spans to %s", service_name, endpoint)
    return True


def enabled() -> bool:
    return _provider is not None


class MetadataCarrier(Protocol):
    """A call's incoming metadata (grpc.aio.ServicerContext, or the HTTP API's headers)."""

    def invocation_metadata(self) -> Sequence[tuple[str, str | bytes]] | None: ...


def remote_parent(context: MetadataCarrier) -> otel_context.Context | None:
    """The caller's trace context from the call's metadata; None when tracing is off or the
    call carries none (the span then starts a trace)."""
    if _provider is None:
        return None
    carrier = {k: v for k, v in context.invocation_metadata() or () if k in TRACE_HEADERS}
    return _PROPAGATOR.extract(carrier) if carrier else None


def headers(span: Span) -> tuple[tuple[str, str], ...] | None:
    """Metadata continuing `span`'s trace in an outgoing call; None when off (no metadata)."""
    if _provider is None or not span.get_span_context().is_valid:
        return None
    carrier: dict[str, str] = {}
    _PROPAGATOR.inject(carrier, context=trace.set_span_in_context(span))
    return tuple(carrier.items())


def _context(parent: Span | otel_context.Context | None) -> otel_context.Context | None:
    if isinstance(parent, Span):
        return trace.set_span_in_context(parent)
    # No parent: a new trace (not whatever happens to be current in this task).
    return parent if parent is not None else otel_context.Context()


def start_span(
    name: str,
    parent: Span | otel_context.Context | None = None,
    attributes: Mapping[str, Any] | None = None,
    start_time_s: float | None = None,
) -> Span:
    """A started span (the caller ends it). `start_time_s`: a `time.perf_counter()` reading
    in the past, for a span whose start is known only afterwards."""
    if _provider is None:
        return INVALID_SPAN
    return _provider.get_tracer(TRACER_NAME).start_span(
        name,
        context=_context(parent),
        attributes=attributes,
        start_time=_epoch_ns(start_time_s) if start_time_s is not None else None,
    )


@contextlib.contextmanager
def span(
    name: str,
    parent: Span | otel_context.Context | None = None,
    attributes: Mapping[str, Any] | None = None,
    error_attributes: Mapping[str, Any] | None = None,
) -> Iterator[Span]:
    """A span around a block: an exception out of it sets the span's error status (and
    `error_attributes`); the span ends on exit."""
    s = start_span(name, parent, attributes)
    try:
        yield s
    except BaseException as exc:
        if error_attributes and s.is_recording():
            s.set_attributes(error_attributes)
        fail(s, exc)
        raise
    finally:
        s.end()


def fail(s: Span, exc: BaseException) -> None:
    """Mark `s` as failed by `exc` (a gRPC status code name when it has one). A generator
    closed by its consumer is not a failure."""
    if not s.is_recording() or isinstance(exc, GeneratorExit):
        return
    if isinstance(exc, asyncio.CancelledError):
        s.set_status(Status(StatusCode.ERROR, "cancelled"))
        return
    code = getattr(exc, "code", None)
    name = code.name if isinstance(code, grpc.StatusCode) else type(exc).__name__
    if isinstance(exc, grpc.aio.AioRpcError):
        name = exc.code().name
    s.set_status(Status(StatusCode.ERROR, f"{name}: {exc}"[:512]))
    s.record_exception(exc)


def timed_child(name: str, parent: Span, start_ns: int, end_ns: int) -> None:
    """A finished child span over [start_ns, end_ns] (wall-clock nanoseconds)."""
    if _provider is None or not parent.is_recording():
        return
    child = _provider.get_tracer(TRACER_NAME).start_span(
        name, context=_context(parent), start_time=start_ns
    )
    child.end(end_time=end_ns)


def _epoch_ns(perf_s: float) -> int:
    """A perf_counter() reading as wall-clock nanoseconds (what spans are stamped with)."""
    return time.time_ns() - int((time.perf_counter() - perf_s) * 1e9)


def recovery_step(parent: Span, fault: str, action: str, reason: str) -> None:
    """A `tandem.recovery` span for one recovery step of the request (`parent`'s)."""
    if not parent.is_recording():
        return
    attributes = {
        "tandem.recovery.fault": fault,
        "tandem.recovery.action": action,
        "tandem.recovery.reason": reason,
    }
    s = start_span("tandem.recovery", parent, attributes)
    if action == "fail":
        s.set_status(Status(StatusCode.ERROR, reason[:512]))
    s.end()


def engine_phases(
    parent: Span, queue_name: str, step_name: str, t_start: float, last_step_s: float
) -> None:
    """Two children of `parent`, called when a request's first output arrives: `queue_name`
    from `t_start` (the call's start) to the start of the engine step that produced the
    output, and `step_name` over that step (its length: the engine loop's `last_step_s`).
    The split is approximate: under load the engine may have finished another step before
    the output was read, and the earlier chunks of a chunked prefill count as queue."""
    if not parent.is_recording():
        return
    now_ns, now_s = time.time_ns(), time.perf_counter()
    start_ns = now_ns - int((now_s - t_start) * 1e9)
    step_ns = max(start_ns, now_ns - int(last_step_s * 1e9))
    timed_child(queue_name, parent, start_ns, step_ns)
    timed_child(step_name, parent, step_ns, now_ns)


def start_lease(parent: Span, lease_id: str, ttl_s: float) -> Span:
    """A `tandem.lease` span: from the grant until the lease is confirmed, lapses, expires
    or is revoked (`end_lease`)."""
    return start_span(
        "tandem.lease", parent, {"tandem.lease.id": lease_id, "tandem.lease.ttl_s": ttl_s}
    )


def end_lease(s: Span | None, outcome: str) -> None:
    """End a `tandem.lease` span: outcome confirmed | lapsed | expired | revoked."""
    if s is None:
        return
    s.set_attribute("tandem.lease.outcome", outcome)
    if outcome in ("lapsed", "expired"):
        s.set_status(Status(StatusCode.ERROR, f"lease {outcome}"))
    s.end()


# -- attributes computed from the services' state ----------------------------------------


def route_candidates(candidates: Sequence[Candidate]) -> list[dict[str, Any]]:
    """The workers `tandem.routing.choose` weighed, with its figures (`Candidate`): a decode
    worker's load, cached prompt tokens and free blocks (it takes the least loaded with
    headroom); a prefill worker's queue, cached tokens and cost (cache_weight x uncached
    tokens + queued tokens; the lowest within the imbalance band wins). Formats only: the
    figures come from the policy."""
    out: list[dict[str, Any]] = []
    for c in candidates[:MAX_ROUTE_CANDIDATES]:
        entry: dict[str, Any] = {
            "worker": c.worker_id, "role": c.role, "cached_tokens": c.cached_tokens,
        }  # fmt: skip
        if c.draining:
            entry["draining"] = True
        if c.role == Role.DECODE:
            entry["load"] = c.load
            entry["free_blocks"] = c.free_blocks
        else:
            entry["queue"] = c.queue
            entry["cost"] = round(c.cost or 0.0, 1)
        out.append(entry)
    return out


def annotate_route(
    s: Span,
    candidates: Sequence[Candidate],
    placement: Placement | None,
    index_degraded: bool,
) -> None:
    """The `tandem.route` span's attributes: the decision, its reason and the candidates
    (`placement.candidates`, or `tandem.routing.weigh`'s when nothing could be placed)."""
    if not s.is_recording():
        return
    s.set_attribute("tandem.index.degraded", index_degraded)
    s.set_attribute("tandem.route.candidates", json.dumps(route_candidates(candidates)))
    if placement is None:
        return
    path = "disaggregated" if placement.disaggregated else "colocated"
    s.set_attributes(
        {
            "tandem.route.reason": placement.reason,
            "tandem.route.kind": placement.kind.value,
            "tandem.route.path": path,
            "tandem.route.cached_tokens": placement.cached_tokens,
            "tandem.route.decode_worker": placement.decode.worker_id,
            "tandem.route.prefill_worker": placement.prefill.worker_id if placement.prefill else "",
        }
    )


def kv_plan(s: Span, remote_ids: Sequence[int], local_ids: Sequence[int]) -> None:
    """A KV read's size: blocks, and transfer descriptors (contiguous runs on both sides
    coalesce into one, as the transport does)."""
    if not s.is_recording():
        return
    s.set_attribute("tandem.kv.blocks", len(remote_ids))
    s.set_attribute("tandem.kv.descriptors", len(coalesce(remote_ids, local_ids)))


def kv_result(s: Span, pulled: Pulled, lease_id: str, recompute: bool) -> None:
    """A `tandem.kv_transfer` span's outcome: committed, or (set by the pull) lapsed or
    failed, which becomes recomputed when the decode worker then prefills the prompt."""
    if not s.is_recording():
        return
    seconds = pulled.transfer_ms / 1e3
    s.set_attributes(
        {
            "tandem.kv.bytes": pulled.num_bytes,
            "tandem.kv.gbps": pulled.num_bytes / seconds / 1e9 if seconds > 0 else 0.0,
            "tandem.kv.lease_id": lease_id,
        }
    )
    if pulled.committed:
        s.set_attribute("tandem.kv.outcome", KVOutcome.COMMITTED.value)
        return
    s.set_attribute("tandem.kv.failure", pulled.failure[:512])
    if recompute:
        s.set_attribute("tandem.kv.outcome", KVOutcome.RECOMPUTED.value)
    s.set_status(Status(StatusCode.ERROR, pulled.failure[:512]))
