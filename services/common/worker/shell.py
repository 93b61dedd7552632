"""What prefill and decode workers share: config, engine, gRPC server, heartbeat, drain."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from http.server import HTTPServer

import grpc
from grpc_health.v1 import health, health_pb2

from tandem.config import EngineRole
from tandem.engine.engine import WARMUP_REQUEST_ID, LLMEngine
from tandem.engine.footprint import StateSize, engine_footprint
from tandem.engine.orphans import OrphanTracker, RecentIds
from tandem.engine.request import RequestSpec, Resume
from tandem.gpus import check_device
from tandem.index import IndexUnavailable
from tandem.load import Load, load_fields
from tandem.services.common.observe import tracing
from tandem.services.common.observe.memory import MemoryCollector
from tandem.services.common.observe.metrics import (
    WorkerMetrics,
    start_metrics_server,
    stop_metrics_server,
)
from tandem.services.common.redis.index import RedisPrefixIndex
from tandem.services.common.redis.registry import Heartbeat, Registry, WorkerInfo
from tandem.services.common.rpc import convert
from tandem.services.common.rpc.errors import (
    aborted,
    already_exists,
    invalid_argument,
    resource_exhausted,
    rpc,
    unavailable,
)
from tandem.services.common.runtime.flags import parse_config
from tandem.services.common.runtime.process import (
    configure_native_libraries,
    run_until_signal,
    setup_logging,
    start_grpc_server,
)
from tandem.services.common.security import Internal, server_port_credentials
from tandem.services.common.worker.config import WorkerConfig
from tandem.services.common.worker.engine_loop import EngineLoop, OutputQueue
from tandem.services.common.worker.kv_events import KVEventPublisher
from tandem.transfer import KVTransport, make_transport
from tandem.v1 import router_pb2 as rpb
from tandem.v1 import worker_pb2 as wpb

log = logging.getLogger(__name__)
AUDIT_INTERVAL_S = 1.0
# Exit status of a worker whose device failed (tandem up and Kubernetes restart it).
DEVICE_ERROR_EXIT = 3
DEREGISTER_TIMEOUT_S = 5.0


def _exit_now(status: int) -> None:
    """End the process at once (exit's finalizers may hang in a broken CUDA context)."""
    logging.shutdown()
    sys.stdout.flush()
    os._exit(status)


@dataclasses.dataclass(slots=True)
class RpcCall:
    """A Prefill or Decode call in progress (`Worker.serving`)."""

    span: tracing.Span
    keep_request: bool = False  # on exit, leave the request in the engine (a lease holds it)


class Worker:
    """Base of PrefillServer and DecodeServer: owns engine loop, transport, server, heartbeat."""

    role: EngineRole
    service_names: tuple[str, ...] = ()
    # How the process ends after a device error (tests record the status instead).
    exit_process: Callable[[int], None] = staticmethod(_exit_now)

    def __init__(self, config: WorkerConfig, engine: LLMEngine | None = None) -> None:
        self.config = config
        self.worker_id = config.worker_id or f"{self.role.value}-{os.getpid()}"
        self.epoch = time.time_ns()
        if engine is None:
            # Before minutes of weight loading: CUDA there, and room for the budget.
            check_device(config.engine.device, config.engine.cache.gpu_memory_utilization)
            log.info("%s engine: %r", self.worker_id, config.engine)
            with _phase("model loaded and KV cache allocated"):
                engine = LLMEngine(
                    dataclasses.replace(config.engine, role=self.role), progress=_load_progress()
                )
        self.engine = engine
        # Gauges read what the engine thread last published (never the scheduler's queues).
        self.metrics = WorkerMetrics(self.role.value, self._published_stats)
        self.metrics.weights(self.engine.weight_bytes, config.engine.quantization)
        if config.engine.cache.kv_host_bytes or config.engine.cache.kv_disk_bytes:
            self.metrics.kv_tiers(self.engine.tier_stats)  # read under the tiers' lock
        if config.engine.speculative.enabled:
            self.metrics.speculation(self.engine.spec_stats)
        self.metrics.registry.register(MemoryCollector(self.role.value, self.footprint))
        self.metrics_address = ""  # host:port of /metrics, once started (metrics_port >= 0)
        self._metrics_server: HTTPServer | None = None
        with _phase(f"KV cache registered with the {config.transport} transport"):
            self.transport: KVTransport = make_transport(config.transport, self.worker_id)
            scales = self.engine.kv_scales
            # every rank's cache (mapped by rank 0 on a CPU): a hand-off moves each's heads
            self.transport.register(
                self.engine.kv_cache,
                (scales.k, scales.v) if scales else ((), ()),
                self.engine.rank_kv,
            )
        self.loop_runner: EngineLoop | None = None
        self._device_exit: asyncio.Task[None] | None = None  # after a device error
        self.server: grpc.aio.Server | None = None
        self.health = health.aio.HealthServicer()
        self.address = ""
        self.ready = False  # warmed up; health SERVING
        self.draining = False
        self.num_active_rpcs = 0
        self._heartbeat: Heartbeat | None = None
        self._index: RedisPrefixIndex | None = None
        self._publisher: KVEventPublisher | None = None
        self._registry: Registry | None = None
        self._orphans = OrphanTracker(config.orphan_grace_s)
        self._aborted = RecentIds()  # event loop only
        self._next_audit = 0.0
        self.num_aborts = 0
        self.num_reaped_blocks = 0
        self.num_audit_violations = 0

    def _published_stats(self) -> Load:
        runner = getattr(self, "loop_runner", None)  # None until start(), unset in __init__
        return runner.snapshot if runner is not None else self.engine.stats()

    @property
    def loop(self) -> EngineLoop:
        assert self.loop_runner is not None, "worker not started"
        return self.loop_runner

    def add_servicers(self, server: grpc.aio.Server) -> None:
        raise NotImplementedError

    def info(self, s: Load | None = None) -> WorkerInfo:
        """This worker's registry record. Without `s`, the engine's counters as its thread
        last published them (never waits for a step); the meter adds the rates."""
        runner = self.loop_runner
        s = s or self._published_stats()
        busy, tps, step_ms = runner.meter.read() if runner else (0, 0, 0)
        prefill_rate = runner.meter.prefill_tokens_per_s() if runner else 0.0
        load = dataclasses.replace(
            s,
            busy_frac=round(busy, 4),
            tokens_per_s=round(tps, 1),
            step_ms=round(step_ms, 2),
            prefill_tokens_per_s=round(prefill_rate, 1),
        )
        return WorkerInfo(
            **load_fields(load),
            worker_id=self.worker_id,
            role=self.role.value,
            address=self.address,
            model=self.engine.model_id,
            epoch=self.epoch,
            draining=self.draining,
            kv_format=self.engine.kv_format,
            tensor_parallel_size=self.engine.config.tensor_parallel_size,
            kv_handoff=self.engine.config.tensor_parallel_size == 1 or bool(self.engine.rank_kv),
            speculative=spec.method if (spec := self.engine.config.speculative).enabled else "",
            draft_format=self.engine.draft_format,
            updated_at=time.time(),
        )

    async def start(self) -> None:
        tracing.setup_tracing(f"tandem-{self.role.value}", self.config.otlp_endpoint)
        self.loop_runner = EngineLoop(
            self.engine, asyncio.get_running_loop(), self.metrics, self._device_failed
        )
        self.loop_runner.start()
        # Every worker RPC is internal (the router and other workers call them); health and
        # reflection stay open (the kubelet's gRPC probe sends no metadata).
        self.server, port = await start_grpc_server(
            self.config.host,
            self.config.port,
            self.service_names,
            self.add_servicers,
            self.health,
            options=[("grpc.so_reuseport", 0)],
            serving=False,
            auth_rules={name: Internal() for name in self.service_names},
            auth=self.config.auth,
            credentials=server_port_credentials(self.config.auth),
        )
        self.address = f"{self.config.advertise_host or self.config.host}:{port}"
        # Health says NOT_SERVING until the first requests would not pay for allocator
        # growth and kernel set-up; routers learn of the worker (registry) only after that.
        with _phase("warm-up prefill and decode steps"):
            await self.loop.call(lambda e: e.warm_up())
        # The router's admission estimate has a prefill rate from the first request on.
        self.loop.meter.seed_prefill_rate(self.engine.warmup_prefill_tokens_per_s)
        self.ready = True
        self.loop.add_hook(self._audit)
        for name in (*self.service_names, ""):
            await self.health.set(name, health_pb2.HealthCheckResponse.SERVING)
        if self.config.redis_url:
            self._index = RedisPrefixIndex(self.config.redis_url)
            self._publisher = KVEventPublisher(
                self._index, self.loop, self.worker_id, self.engine.model_id, self.epoch
            )
            self._publisher.start()
            self._registry = Registry(self.config.redis_url, ttl_s=self.config.registry_ttl_s)
            self._heartbeat = Heartbeat(
                self._registry, self.info, interval_s=self.config.heartbeat_interval_s
            )
            await self._heartbeat.start()
        log.info("%s %s serving on %s", self.role.value, self.worker_id, self.address)
        if self.config.metrics_port >= 0:
            self._metrics_server, port = start_metrics_server(
                self.config.host, self.config.metrics_port, self.metrics.registry
            )
            self.metrics_address = f"{self.config.host}:{port}"
            log.info("%s metrics on http://%s/metrics", self.worker_id, self.metrics_address)

    async def drain_and_stop(self) -> None:
        """Stop admitting, let in-flight work finish (`drain_step`; bounded), deregister, stop."""
        self.draining = True
        for name in (*self.service_names, ""):
            await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        deadline = time.monotonic() + self.config.drain_timeout_s
        while await self.drain_step() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await self.stop()

    async def drain_step(self) -> int:  # a drain's turn: work still pending (roles add theirs)
        return self.num_active_rpcs

    def _device_failed(self, exc: BaseException) -> None:
        """The engine loop's report of a device error (on the event loop): the CUDA context
        is unusable, so this process can never serve again. Its requests fail over when its
        connections drop (the router migrates them)."""
        self._device_exit = asyncio.create_task(self._exit_after_device_error(exc))

    async def _exit_after_device_error(self, exc: BaseException) -> None:
        self.draining = True  # admit() refuses from now on
        for name in (*self.service_names, ""):
            await self.health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        try:
            await asyncio.wait_for(self._deregister(), DEREGISTER_TIMEOUT_S)
        except Exception:  # exit anyway: the registry entry expires after registry_ttl_s
            log.exception("deregistering after the device error failed")
        log.critical(
            "%s: device error on %s (%s): health NOT_SERVING, deregistered; exiting with "
            "status %d to be restarted",
            self.worker_id, self.config.engine.device, exc, DEVICE_ERROR_EXIT,
        )  # fmt: skip
        self.exit_process(DEVICE_ERROR_EXIT)

    async def _deregister(self) -> None:
        """Leave the registry and the prefix index (our cache dies with us)."""
        if self._publisher is not None:
            await self._publisher.stop()
            self._publisher = None
        if self._index is not None:
            try:
                await self._index.remove_worker(self.worker_id)
            except IndexUnavailable:
                pass
            await self._index.close()
            self._index = None
        if self._heartbeat is not None:
            await self._heartbeat.stop(deregister=True)
            self._heartbeat = None
        if self._registry is not None:
            await self._registry.close()
            self._registry = None

    async def stop(self) -> None:
        stop_metrics_server(self._metrics_server)
        self._metrics_server = None
        await self._deregister()
        if self.server is not None:
            await self.server.stop(grace=1.0)
        if self.loop_runner is not None:
            self.loop_runner.stop()
        self.transport.close()

    @rpc
    async def GetStats(
        self, request: wpb.GetStatsRequest, context: grpc.aio.ServicerContext
    ) -> wpb.WorkerStats:
        # What the engine thread last published: consistent counters, no wait for a step.
        stats = convert.worker_stats_to_proto(self.info(self.loop.snapshot))
        stats.num_aborts = self.num_aborts
        stats.num_reaped_blocks = self.num_reaped_blocks
        stats.num_audit_violations = self.num_audit_violations
        return stats

    @rpc
    async def Abort(
        self, request: rpb.AbortRequest, context: grpc.aio.ServicerContext
    ) -> rpb.AbortResponse:
        """Answered at once, never behind an engine step: the abort itself is queued for the
        engine thread where no deadline can cancel it (`EngineLoop.abort`)."""
        return rpb.AbortResponse(found=self.abort(request.request_id))

    def abort(self, request_id: str) -> bool:
        """Stop `request_id` on this worker, now or when it arrives. True when it was known."""
        active = self.loop.has_stream(request_id)  # its call is running here
        found = active or self.owns(request_id) or self.engine.has_request(request_id)
        if active or not found:
            # Remembered for the call that is running (it ends aborted and forgets the id),
            # or for one this abort overtook on the wire (refused once when it arrives).
            self._aborted.add(request_id, time.monotonic())
        self.loop.abort(request_id)
        self.num_aborts += 1
        self.metrics.aborts.inc()
        log.info("abort %s (%s)", request_id, "running here" if found else "not known here")
        return found

    def footprint(self) -> dict[str, StateSize]:
        """Every structure of this worker that grows with traffic (tandem.engine.footprint):
        the engine's, the engine loop's and the worker's own. Any thread, as a hint."""
        sizes = engine_footprint(self.engine)
        if self.loop_runner is not None:
            sizes.update(self.loop_runner.footprint())
        sizes["aborted_ids"] = StateSize(len(self._aborted), self._aborted.max_ids)
        sizes["orphan_candidates"] = StateSize(len(self._orphans), None)
        return sizes

    def owns(self, request_id: str) -> bool:
        """Does a call (or, on a prefill worker, a lease) still hold `request_id`? Any
        thread: one dict lookup per holder."""
        return self.loop.has_stream(request_id)

    def _audit(self, engine: LLMEngine) -> None:
        """Engine-thread hook, every AUDIT_INTERVAL_S: reap requests no call or lease has
        held for orphan_grace_s; in strict mode also check the block accounting."""
        now = time.monotonic()
        if now < self._next_audit:
            return
        self._next_audit = now + AUDIT_INTERVAL_S
        if self.config.kv_audit_strict:
            try:
                engine.check_integrity()
            except AssertionError as exc:
                self._violation(f"KV block accounting: {exc}")
        live = [
            r.request_id for r in engine.scheduler.requests() if r.request_id != WARMUP_REQUEST_ID
        ]
        for rid in self._orphans.sweep(live, self.owns, now):
            num_blocks = len(engine.kv.held_blocks(rid))
            engine.abort(rid)
            self.num_reaped_blocks += num_blocks
            self.metrics.kv_blocks_reaped.inc(num_blocks)
            what = (
                f"reaped {num_blocks} KV blocks of {rid}: no call or lease held it for "
                f"{self.config.orphan_grace_s:g}s (orphan_grace_s)"
            )
            if self.config.kv_audit_strict:
                self._violation(what)
            else:
                log.warning(what)

    def _violation(self, what: str) -> None:
        self.num_audit_violations += 1
        self.metrics.kv_audit_violations.inc()
        log.error("KV audit: %s", what)

    def admit(
        self, msg: wpb.PrefillRequest | wpb.DecodeRequest, context: grpc.aio.ServicerContext
    ) -> tuple[RequestSpec, OutputQueue]:
        """Accept a new request as the core's `RequestSpec`, with the queue its outputs will
        arrive on. Synchronous, so the checks and the stream's registration are atomic on
        the event loop. The caller serves it inside `serving` at once, which counts it and
        closes the stream when done.

        Raises:
            ServiceError: UNAVAILABLE while draining or starting, RESOURCE_EXHAUSTED with a
                retry hint when max_queued_requests are waiting, ALREADY_EXISTS for an id
                that is running here, INVALID_ARGUMENT for bad sampling params.
        """
        if self.draining:
            raise unavailable(f"worker {self.worker_id} is draining")
        if not self.ready:
            raise unavailable(f"worker {self.worker_id} is starting (warm-up); retry", 1.0)
        queued = self.num_active_rpcs - len(self.engine.scheduler.running)  # racy read: a hint
        if queued >= self.config.max_queued_requests:
            _, _, step_ms = self.loop.meter.read()
            raise resource_exhausted(
                f"worker {self.worker_id} has {queued} requests queued "
                f"(max_queued_requests {self.config.max_queued_requests}); retry later",
                retry_after_s=max(0.05, min(5.0, 4 * step_ms / 1e3)),
            )
        try:
            spec = convert.spec_from_proto(
                msg, msg.request_id or uuid.uuid4().hex, context.time_remaining()
            )
        except ValueError as exc:
            raise invalid_argument(f"sampling.{exc}") from None
        if spec.request_id in self._aborted:
            self._aborted.discard(spec.request_id)
            # Its abort overtook it: the router has given up on this attempt already.
            raise aborted(spec.request_id)
        try:
            stream = self.loop.open_stream(spec.request_id)
        except KeyError:
            raise already_exists(
                f"request_id {spec.request_id!r} is already running on {self.worker_id}"
            ) from None
        return spec, stream

    @contextlib.contextmanager
    def serving(
        self, span_name: str, spec: RequestSpec, context: grpc.aio.ServicerContext
    ) -> Iterator[RpcCall]:
        """One Prefill or Decode call's life on this worker, after `admit`: its span (a child
        of the caller's trace), counted in `num_active_rpcs` while it runs, and on exit,
        however it ends (finished, failed, cancelled): the span failed on an exception and
        ended, the output stream closed, the request's abort (if any) forgotten, and the
        request aborted in the engine so nothing it holds stays, unless the call set
        `keep_request` (a prefill handed off under a lease, which the lease frees)."""
        span = tracing.start_span(span_name, tracing.remote_parent(context))
        span.set_attribute("tandem.prompt_tokens", spec.num_prompt_tokens)
        call = RpcCall(span)
        rid = spec.request_id
        self.num_active_rpcs += 1
        try:
            yield call
        except BaseException as exc:
            tracing.fail(span, exc)
            raise
        finally:
            span.end()
            self.num_active_rpcs -= 1
            self.loop.close_stream(rid)
            self._aborted.discard(rid)  # its abort, if any, has been seen
            if not call.keep_request:
                self.loop.abort(rid)

    async def add_request(self, spec: RequestSpec, resume: Resume | None = None) -> None:
        """Queue `spec` on the engine. Raises ServiceError(INVALID_ARGUMENT) when the engine
        refuses it (the message names the rule)."""
        self.metrics.admitted(spec.request_id)  # queue time and prefix-cache tokens
        try:
            await self.loop.call(lambda e: e.add_request(spec, resume))
        except ValueError as exc:
            raise invalid_argument(str(exc)) from None


def _load_progress() -> Callable[[int, int], None]:
    """A loader progress callback that logs every tenth of the tensors (a large model takes
    minutes to load; the log shows it is moving)."""
    logged = [-1]

    def report(done: int, total: int) -> None:
        decile = done * 10 // max(total, 1)
        if decile > logged[0]:
            logged[0] = decile
            log.info("loading weights: %d/%d tensors", done, total)

    return report


@contextlib.contextmanager
def _phase(what: str) -> Iterator[None]:
    """Log how long a start-up phase took."""
    t0 = time.perf_counter()
    yield
    log.info("%s in %.2fs", what, time.perf_counter() - t0)


def run_worker(server_cls: type[Worker], role: str) -> None:
    """Entry point of `python -m tandem.services.<role>`: flags -> WorkerConfig -> serve until
    stop."""
    config = parse_config(
        WorkerConfig, prog=f"python -m tandem.services.{role}", fixed={"role": role}
    )
    setup_logging(role)
    configure_native_libraries(device=config.engine.device)  # before the transport exists

    async def run() -> None:
        try:
            server = server_cls(config)
        except ValueError as exc:  # the device, the model or the KV budget: the message says
            log.error("%s cannot start: %s", role, exc)
            raise SystemExit(2) from None
        await run_until_signal(
            server.start, server.drain_and_stop, lambda: f"READY {role} {server.address}"
        )

    asyncio.run(run())
