"""Prometheus metrics of the router and the workers: every metric object they maintain.

Names, labels and units are a contract with the Grafana dashboard and `tandem ctl top`
(`metric_names` lists them). Conventions: prefix `tandem_`, base units (`_seconds`,
`_bytes`), counters end in `_total`, no label takes unbounded values (no request or worker
ids). Each process keeps its metrics on a `CollectorRegistry` of its own, served by
`start_metrics_server` on the service's host at `metrics_port` (-1: off; 0: any free port).

Cost on the hot path: one `observe()` per streamed chunk (the router's inter-token latency,
`observe_many`), one per engine step (the workers' step time), and a check of the requests
not yet scheduled after each step (queue time, prefix-cache tokens). Gauges of engine state
(running, waiting, KV blocks) are read when scraped, not maintained: those collectors live in
tandem.services.common.observe.collectors.
"""

from __future__ import annotations

import bisect
import collections
import logging
import threading
from collections.abc import Callable, Iterable, Iterator
from http.server import HTTPServer
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import Metric

from tandem.routing import Placement, RouteKind
from tandem.services.common.observe.collectors import (
    EngineGauges,
    ExpertRouting,
    KVTiers,
    Speculation,
)
from tandem.services.common.rpc.errors import ServiceError
from tandem.services.common.worker.kv_pull import Pulled
from tandem.types import KVOutcome, Role

if TYPE_CHECKING:
    from tandem.engine.engine import LLMEngine
    from tandem.load import Load
    from tandem.speculative.stats import SpecStats
    from tandem.tiers.stats import TierStats

log = logging.getLogger(__name__)

# Seconds. TTFT and end-to-end: 5 ms .. 60 s.
LATENCY_BUCKETS = (
    0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75,
    1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 15.0, 20.0, 30.0, 45.0, 60.0,
)  # fmt: skip
# Queueing before the first token: up to minutes (max_queue_delay_s defaults to 120 s).
QUEUE_DELAY_BUCKETS = (
    0.1, 0.5, 1.0, 2.0, 5.0, 10.0, 15.0, 20.0, 30.0, 45.0, 60.0, 90.0, 120.0, 180.0, 300.0, 600.0,
)  # fmt: skip
# Inter-token latency and engine steps: 0.5 ms .. 2 s.
STEP_BUCKETS = (
    0.0005, 0.001, 0.002, 0.003, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.04, 0.05,
    0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.0,
)  # fmt: skip
# One KV hand-off read: 0.1 ms .. 10 s.
# A token's KV over every layer: a few KiB (small models, MLA's latent) to MiBs (large dense).
WIRE_BYTES_BUCKETS = tuple(float(1 << n) for n in range(8, 25))
TRANSFER_BUCKETS = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5,
    1.0, 2.5, 5.0, 10.0,
)  # fmt: skip

COMPONENTS = ("router", *Role, "controller")
PATHS = ("disaggregated", "colocated")
FAULTS = ("prefill_failed", "kv_pull_failed", "decode_failed", "decode_moved")
ACTIONS = ("reprefill", "recompute", "migrate", "hold", "fail")
WORKER_STATES = ("healthy", "open_breaker")
# A hand-off's outcome on the decode worker (RECOMPUTED is a trace value, not a count).
TRANSFER_OUTCOMES: tuple[KVOutcome, ...] = tuple(
    o for o in KVOutcome if o is not KVOutcome.RECOMPUTED
)
EJECTIONS = ("unreachable", "stalled", "error")  # why a router took a worker out of rotation
ABORT_OUTCOMES = ("answered", "late", "failed")  # late: answered after ABORT_LATE_S
ABORT_LATE_S = 0.1
ABORT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0)
REFUSALS = ("queue_delay", "inflight")
# Defined in services/controller/server.py (its own registry and port).
CONTROLLER_METRICS = frozenset(
    {"tandem_controller_replicas", "tandem_controller_sla_attainment",
     "tandem_controller_decisions_total"}
)  # fmt: skip


def path_of(disaggregated: bool) -> str:
    return "disaggregated" if disaggregated else "colocated"


def observe_many(histogram: Histogram, value: float, count: int) -> None:
    """`count` observations of `value` at the cost of one: the chunk of k tokens after a gap
    g is k inter-token gaps of g/k (prometheus_client observes one value per call)."""
    if count == 1:
        histogram.observe(value)
        return
    try:
        bounds, buckets, total = histogram._upper_bounds, histogram._buckets, histogram._sum
    except AttributeError:  # another prometheus_client layout: the slow, certain way
        for _ in range(count):
            histogram.observe(value)
        return
    total.inc(value * count)
    buckets[bisect.bisect_left(bounds, value)].inc(count)


def build_info(registry: CollectorRegistry, component: str) -> Gauge:
    """tandem_build_info{version, component} = 1."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        v = version("tandem")
    except PackageNotFoundError:
        v = "unknown"
    info = Gauge(
        "tandem_build_info", "Tandem version of this process (value 1).",
        ["version", "component"], registry=registry,
    )  # fmt: skip
    info.labels(v, component).set(1)
    return info


class RouterMetrics:
    """The router's metrics. Thread-safe (prometheus_client); the event loop writes them, the
    HTTP server thread reads them."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = r = registry or CollectorRegistry(auto_describe=True)
        build_info(r, "router")
        ttft = Histogram(
            "tandem_router_time_to_first_token_seconds",
            "Admission to the first token sent to the client.",
            ["path"], buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        itl = Histogram(
            "tandem_router_inter_token_latency_seconds",
            "Gap between streamed tokens (a chunk of k tokens after a gap g: k gaps of g/k).",
            ["path"], buckets=STEP_BUCKETS, registry=r,
        )  # fmt: skip
        e2e = Histogram(
            "tandem_router_e2e_request_latency_seconds",
            "Admission to the final message of a finished request.",
            ["path"], buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        # Children resolved once: no label lookup per chunk.
        self.ttft = {p: ttft.labels(p) for p in PATHS}
        self.itl = {p: itl.labels(p) for p in PATHS}
        self.e2e = {p: e2e.labels(p) for p in PATHS}
        self.queue = Histogram(
            "tandem_router_queue_seconds", "Admission to placement (tokenize, index lookup).",
            buckets=LATENCY_BUCKETS, registry=r,
        )  # fmt: skip
        self.running = Gauge(
            "tandem_router_requests_running", "Requests admitted and not finished.", registry=r
        )
        self.requests = Counter(
            "tandem_router_requests", "Generate calls by outcome and gRPC status.",
            ["outcome", "code"], registry=r,
        )  # fmt: skip
        self.prompt_tokens = Counter(
            "tandem_router_prompt_tokens", "Prompt tokens of placed requests.", registry=r
        )
        self.generation_tokens = Counter(
            "tandem_router_generation_tokens", "Tokens streamed to clients.", registry=r
        )
        self.cached_prompt_tokens = Counter(
            "tandem_router_cached_prompt_tokens",
            "Prompt tokens the prefilling worker found in its prefix cache.", registry=r,
        )  # fmt: skip
        self.decisions = Counter(
            "tandem_router_routing_decisions", "Placements by path and reason category.",
            ["path", "reason"], registry=r,
        )  # fmt: skip
        self.recoveries = Counter(
            "tandem_router_recoveries", "Recovery steps after a worker failed a request.",
            ["fault", "action"], registry=r,
        )  # fmt: skip
        self.index_degraded = Gauge(
            "tandem_router_prefix_index_degraded",
            "1 while the prefix index cannot answer (placement on load alone), else 0.",
            registry=r,
        )  # fmt: skip
        self.workers = Gauge(
            "tandem_router_workers", "Workers this router knows, by role and breaker state.",
            ["role", "state"], registry=r,
        )  # fmt: skip
        ejections = Counter(
            "tandem_router_ejections", "Workers taken out of rotation, by reason.",
            ["reason"], registry=r,
        )  # fmt: skip
        self.ejections = {e: ejections.labels(e) for e in EJECTIONS}
        aborts = Counter(
            "tandem_router_worker_aborts",
            f"Abort calls to workers: answered, late (after {ABORT_LATE_S:g}s) or failed.",
            ["role", "outcome"], registry=r,
        )  # fmt: skip
        self.worker_aborts = {(w, o): aborts.labels(w, o) for w in Role for o in ABORT_OUTCOMES}
        abort_s = Histogram(
            "tandem_router_worker_abort_seconds", "Round trip of an answered Abort call.",
            ["role"], buckets=ABORT_BUCKETS, registry=r,
        )  # fmt: skip
        self.worker_abort_s = {w: abort_s.labels(w) for w in Role}
        refusals = Counter(
            "tandem_router_admission_refusals",
            "Requests refused at admission: expected queue delay over the limit, or "
            "max_inflight reached.", ["reason"], registry=r,
        )  # fmt: skip
        self.refusals = {x: refusals.labels(x) for x in REFUSALS}
        self.queue_delay_estimate = Histogram(
            "tandem_router_queue_delay_estimate_seconds",
            "Expected delay to the first token at admission (tandem.routing.admission).",
            buckets=QUEUE_DELAY_BUCKETS, registry=r,
        )  # fmt: skip
        self.queue_delay = Histogram(
            "tandem_router_queue_delay_seconds",
            "Actual admission to first token of requests that had an estimate.",
            buckets=QUEUE_DELAY_BUCKETS, registry=r,
        )  # fmt: skip
        for kind in RouteKind:  # every series exists from the start
            for path in PATHS:
                self.decisions.labels(path, kind)
        for outcome in ("finished", "aborted"):
            self.requests.labels(outcome, "OK")
        self.set_workers({})

    # -- per request -----------------------------------------------------------------------

    def placed(self, placement: Placement, queue_s: float) -> None:
        self.queue.observe(queue_s)
        self.decisions.labels(path_of(placement.disaggregated), placement.kind).inc()

    def streamed(
        self, disaggregated: bool, t_start: float, t_last: float, n: int, now: float
    ) -> float:
        """A chunk of `n` tokens reached the client at `now` (perf_counter); `t_last`: when
        the previous one did (0: none yet). Returns the new `t_last`."""
        if not n:
            return t_last
        path = path_of(disaggregated)
        if t_last:
            observe_many(self.itl[path], (now - t_last) / n, n)
        else:
            self.ttft[path].observe(now - t_start)
        return now

    def completed(self, disaggregated: bool, aborted: bool, elapsed_s: float) -> None:
        """The client got its final message (finished, or aborted by Router.Abort)."""
        if aborted:
            self.requests.labels("aborted", "OK").inc()
            return
        self.e2e[path_of(disaggregated)].observe(elapsed_s)
        self.requests.labels("finished", "OK").inc()

    def raised(self, exc: BaseException, completed: bool) -> None:
        """Generate ended with `exc`: an error status, or the client left (aborted).
        `completed`: the client already had its final message (counted then)."""
        if isinstance(exc, ServiceError):
            self.requests.labels("error", exc.code.name).inc()
        elif completed:
            return
        elif isinstance(exc, Exception):
            self.requests.labels("error", "UNKNOWN").inc()  # grpc's status for a bug
        else:  # CancelledError, GeneratorExit: cancelled or past the client's deadline
            self.requests.labels("aborted", "OK").inc()

    def tokens(self, prompt: int, generated: int, cached: int) -> None:
        self.prompt_tokens.inc(prompt)
        self.generation_tokens.inc(generated)
        self.cached_prompt_tokens.inc(cached)

    def recovery(self, fault: str, action: str) -> None:
        self.recoveries.labels(fault, action).inc()

    def worker_abort(self, role: Role, seconds: float | None) -> None:
        """An Abort call to a worker of `role` answered after `seconds` (None: it failed)."""
        if seconds is None:
            self.worker_aborts[(role, "failed")].inc()
            return
        self.worker_abort_s[role].observe(seconds)
        self.worker_aborts[(role, "late" if seconds > ABORT_LATE_S else "answered")].inc()

    # -- state -----------------------------------------------------------------------------

    def set_workers(self, counts: dict[tuple[str, str], int]) -> None:
        """Workers per (role, state); every pair is set (0 when absent)."""
        for role in Role:
            for state in WORKER_STATES:
                self.workers.labels(role, state).set(counts.get((role, state), 0))


class WorkerMetrics:
    """A prefill or decode worker's metrics. `stats` reads the engine's load (scrape time).

    The queue time and prefix-cache tokens of a request are taken when the engine first
    schedules it: `admitted(request_id)` (any thread) before it is added, `after_step` (the
    engine thread) after every step."""

    def __init__(self, role: str, stats: Callable[[], Load] | None = None,
                 registry: CollectorRegistry | None = None) -> None:  # fmt: skip
        if role not in tuple(Role):
            raise ValueError(f"role must be one of {tuple(map(str, Role))}, got {role!r}")
        self.role = role = Role(role)
        self.registry = r = registry or CollectorRegistry(auto_describe=True)
        build_info(r, role)
        r.register(EngineGauges(role, stats))
        self.step = Histogram(
            "tandem_worker_step_seconds", "Engine step time (schedule, forward, sample).",
            ["role"], buckets=STEP_BUCKETS, registry=r,
        ).labels(role)  # fmt: skip
        self.queue = Histogram(
            "tandem_worker_queue_seconds", "Request added to the engine -> first scheduled.",
            ["role"], buckets=LATENCY_BUCKETS, registry=r,
        ).labels(role)  # fmt: skip
        self.queried_tokens = Counter(
            "tandem_worker_prefix_cache_queried_tokens",
            "Prompt tokens looked up in the prefix cache.", ["role"], registry=r,
        ).labels(role)  # fmt: skip
        self.hit_tokens = Counter(
            "tandem_worker_prefix_cache_hit_tokens",
            "Prompt tokens found in the prefix cache.", ["role"], registry=r,
        ).labels(role)  # fmt: skip
        if role == Role.DECODE:
            self.transfer_bytes = Counter(
                "tandem_worker_kv_transfer_bytes", "KV bytes pulled from prefill workers.",
                registry=r,
            )  # fmt: skip
            self.transfer_seconds = Histogram(
                "tandem_worker_kv_transfer_seconds", "Duration of one KV hand-off read.",
                buckets=TRANSFER_BUCKETS, registry=r,
            )  # fmt: skip
            self.wire_bytes_per_token = Histogram(
                "tandem_worker_kv_wire_bytes_per_token",
                "Bytes one hand-off read over the transport per token of the blocks it read "
                "(every layer; replicated heads such as MLA's latent count once).",
                buckets=WIRE_BYTES_BUCKETS, registry=r,
            )  # fmt: skip
            transfers = Counter(
                "tandem_worker_kv_transfers", "KV hand-offs by outcome.", ["outcome"],
                registry=r,
            )  # fmt: skip
            self.transfers = {o: transfers.labels(o) for o in TRANSFER_OUTCOMES}
            self.recomputed = Counter(
                "tandem_worker_kv_recomputed",
                "Prompts recomputed here after a failed hand-off.", registry=r,
            )  # fmt: skip
        else:
            self.lease_expired = Counter(
                "tandem_worker_lease_expired", "Hand-off leases that lapsed unconfirmed.",
                registry=r,
            )  # fmt: skip
        self.aborts = Counter(
            "tandem_worker_aborts", "Abort calls answered (found or not).", ["role"],
            registry=r,
        ).labels(role)  # fmt: skip
        self.kv_blocks_reaped = Counter(
            "tandem_worker_kv_blocks_reaped",
            "KV blocks freed because no call or lease held their request (a lost abort).",
            ["role"], registry=r,
        ).labels(role)  # fmt: skip
        self.kv_audit_violations = Counter(
            "tandem_worker_kv_audit_violations",
            "Strict KV audit: block accounting errors and reaped requests.", ["role"],
            registry=r,
        ).labels(role)  # fmt: skip
        self._admitted: collections.deque[str] = collections.deque()  # thread-safe appends
        self._pending: dict[str, bool] = {}  # engine thread only: id -> missed once
        self._experts_seen = False  # the first step registered a MoE model's routing counts

    def weights(self, num_bytes: int, quantization: str) -> None:
        """tandem_worker_weight_bytes{role, quantization}: the loaded weights' bytes (quantized
        matrices as held), set once at load."""
        Gauge(
            "tandem_worker_weight_bytes", "Bytes of the model's weights as loaded.",
            ["role", "quantization"], registry=self.registry,
        ).labels(self.role, quantization).set(num_bytes)  # fmt: skip

    def expert_routing(
        self, layers: tuple[int, ...], counts: Callable[[], list[list[int]]]
    ) -> None:
        """tandem_worker_moe_routed_tokens_total{role, layer, expert}: tokens a mixture-of-
        experts model routed to each expert of each sparse layer (`layers`), read from the
        model at scrape time (`counts()`: one row per layer). The labels are bounded by the
        model's shape: sparse layers x experts series (48 x 128 for Qwen3-30B-A3B)."""
        self.registry.register(ExpertRouting(self.role, layers, counts))

    def kv_tiers(self, read: Callable[[], list[TierStats]]) -> None:
        """tandem_worker_kv_tier_*{role, tier}: a worker with KV tiers registers them (read
        when scraped: tandem.services.common.observe.collectors.tier_families names them)."""
        self.registry.register(KVTiers(self.role, read))

    def speculation(self, read: Callable[[], list[SpecStats]]) -> None:
        """tandem_worker_spec_*_total{role, proposer}: a worker with speculative decoding
        registers them (read when scraped: collectors.spec_families names them)."""
        self.registry.register(Speculation(self.role, read))

    def admitted(self, request_id: str) -> None:
        """`request_id` is about to be added to the engine (any thread)."""
        self._admitted.append(request_id)

    def after_step(self, engine: LLMEngine, step_s: float) -> None:
        """On the engine thread, after each step: step time, and the requests this step
        scheduled for the first time. Never raises (it runs in the engine's loop)."""
        self.step.observe(step_s)
        if not self._experts_seen:
            self._experts_seen = True
            counts, moe = engine.model.expert_counts, engine.model.config.moe
            if counts is not None and moe is not None:
                self.expert_routing(moe.sparse_layers, counts.tolist)
        while self._admitted:
            self._pending[self._admitted.popleft()] = False
        if not self._pending:
            return
        try:
            self._first_scheduled(engine, engine.clock() - step_s)
        except Exception:
            log.exception("queue-time metrics failed; dropped")
            self._pending.clear()

    def _first_scheduled(self, engine: LLMEngine, started: float) -> None:
        for rid, missed in list(self._pending.items()):
            request = engine.get_request(rid)
            if request is None:
                # Not added yet (its command runs before the next step), or aborted or
                # refused before it was scheduled: missing twice, it is not coming.
                if missed:
                    del self._pending[rid]
                else:
                    self._pending[rid] = True
            elif request.num_cached_tokens is not None:  # set when first scheduled
                del self._pending[rid]
                self.queue.observe(max(0.0, started - request.arrival_time))
                self.prefix_cache(request.num_prompt_tokens, request.num_cached_tokens)

    def prefix_cache(self, queried: int, hit: int) -> None:
        self.queried_tokens.inc(queried)
        self.hit_tokens.inc(hit)

    def kv_pulled(self, pulled: Pulled, num_prompt_tokens: int) -> None:
        """Decode: a hand-off read and confirmed (or not). A committed one joined the batch
        with its first `num_cached_tokens` prompt tokens from this worker's prefix cache."""
        self.kv_transfer(pulled.outcome, pulled.num_bytes, pulled.transfer_ms / 1e3)
        if pulled.num_bytes and pulled.num_tokens:
            self.wire_bytes_per_token.observe(pulled.num_bytes / pulled.num_tokens)
        if pulled.committed:
            self.prefix_cache(num_prompt_tokens, pulled.num_cached_tokens)

    def kv_transfer(self, outcome: KVOutcome, num_bytes: int = 0, seconds: float = 0.0) -> None:
        """Decode: one hand-off's outcome (committed, lapsed, failed, refused) and read."""
        self.transfers[outcome].inc()
        if num_bytes:
            self.transfer_bytes.inc(num_bytes)
            self.transfer_seconds.observe(seconds)


def start_metrics_server(
    host: str, port: int, registry: CollectorRegistry
) -> tuple[HTTPServer, int]:
    """Serve `registry` at http://host:port/metrics on a daemon thread; port 0: any free
    port. Returns the server (`shutdown()` it) and the bound port."""
    server, _thread = start_http_server(port, addr=host, registry=registry)
    return server, int(server.server_address[1])


def stop_metrics_server(server: HTTPServer | None) -> None:
    if server is not None:
        threading.Thread(target=_close, args=(server,), daemon=True).start()


def _close(server: HTTPServer) -> None:
    server.shutdown()
    server.server_close()


def metric_names(component: str) -> set[str]:
    """Every sample name `component` exposes ("router", a `Role`, or "controller"),
    suffixed as in the exposition: histograms as _bucket/_sum/_count, counters as _total."""
    if component not in COMPONENTS:
        raise ValueError(f"component must be one of {COMPONENTS}, got {component!r}")
    if component == "controller":
        return set(CONTROLLER_METRICS)
    metrics: Any = RouterMetrics() if component == "router" else WorkerMetrics(component)
    return set(_sample_names(metrics.registry.collect()))


def _sample_names(families: Iterable[Metric]) -> Iterator[str]:
    for family in families:
        if family.type == "histogram":
            yield from (family.name + s for s in ("_bucket", "_sum", "_count"))
        elif family.type == "counter":
            yield family.name + "_total"
        else:
            yield family.name
