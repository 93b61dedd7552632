"""The ratio controller service: observe, decide, act, explain.

Every `interval_s`:
  1. read the workers' heartbeats (load stats) from the registry and the request timings the
     routers appended to the Redis stream since the last tick; keep the last `window_s`
     (tandem.control.SampleWindow, the same window the simulator keeps);
  2. ask the actuator how many replicas each role has been given, how many of them serve
     (a starting worker, or a Pending pod, is neither capacity nor a failure), and how many
     workers the host holds (the local actuator);
  3. run tandem.control.decide() on that window;
  4. apply a changed target through the actuator (a failure is logged, kept in the status,
     and retried on the next tick).
The admin gRPC API (tandem.v1.Admin) shows status and the last decisions with their reasons,
pins a manual ratio, changes the SLA targets, and returns to automatic control. Settings an
operator changes are kept in Redis, so a restarted controller keeps them.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import grpc
import redis.asyncio as aioredis
from grpc_health.v1 import health
from redis.exceptions import RedisError

from tandem.control import (
    SLA,
    ControlState,
    Decision,
    HostCapacity,
    Observation,
    RequestSample,
    SampleWindow,
    WorkerSample,
    decide,
    percentile,
)
from tandem.load import load_fields
from tandem.services.common.redis.registry import Registry, WorkerInfo
from tandem.services.common.redis.request_log import RequestLogReader
from tandem.services.common.redis.url import RedisAuthError, is_auth_error
from tandem.services.common.rpc.errors import invalid_argument, rpc
from tandem.services.common.runtime.process import start_grpc_server
from tandem.services.common.security import Bearer, KeyRing, Rule
from tandem.services.controller.actuators import Actuator, ActuatorError
from tandem.services.controller.config import ControllerConfig
from tandem.services.controller.metrics import ControllerMetrics
from tandem.types import Role
from tandem.v1 import admin_pb2 as apb
from tandem.v1 import admin_pb2_grpc as agrpc

log = logging.getLogger(__name__)
SERVICE_NAME = "tandem.v1.Admin"
# Changing the controller's behaviour takes an "admin" key; watching it a "read" key too.
# Without admin_keys_file, every call is let through (security module: development mode).
ADMIN_RULES: dict[str, Rule] = {
    SERVICE_NAME: Bearer("admin"),
    f"/{SERVICE_NAME}/Status": Bearer("admin", "read"),
    f"/{SERVICE_NAME}/Explain": Bearer("admin", "read"),
}
# `tandem ctl top` shows request latency over the last minute.
RECENT_S = 60.0
SETTINGS_PREFIX = "tandem:control:settings:"
_REDIS_DOWN = (RedisError, OSError)


@dataclass(frozen=True, slots=True)
class Record:
    """A decision as taken, and whether the actuator managed to apply it."""

    decision: Decision
    applied: bool
    error: str = ""


def sample_of(info: WorkerInfo, t: float) -> WorkerSample:
    return WorkerSample(
        **load_fields(info), t=t, worker_id=info.worker_id, role=info.role, draining=info.draining
    )


class Controller(agrpc.AdminServicer):
    """`clock`: wall-clock seconds (the routers' request timings are wall-clock too)."""

    def __init__(
        self, config: ControllerConfig, actuator: Actuator, clock: Callable[[], float] = time.time
    ) -> None:
        self.config = config
        self._clock = clock
        self.control = config.control
        self.actuator = actuator
        self.sla = config.sla
        self.state = ControlState()
        self.decisions: deque[Record] = deque(maxlen=100)
        self.last_error = ""
        self.address = ""
        self.model_id = config.model_id
        self._workers = SampleWindow[WorkerSample](config.window_s)
        self._requests = SampleWindow[RequestSample](config.window_s)
        self._latest: list[WorkerInfo] = []
        self._observed_at = 0.0
        self._first_observed: float | None = None  # the samples reach back to here
        self._current: dict[str, int] = {}
        self._ready: dict[str, int] = {}
        self.capacity: HostCapacity | None = None
        self._tick_lock = asyncio.Lock()
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._server: grpc.aio.Server | None = None
        self._health = health.aio.HealthServicer()
        self._redis: aioredis.Redis | None = None
        self._registry: Registry | None = None
        self._reader: RequestLogReader | None = None
        self._metrics: ControllerMetrics | None = None

    # -- lifecycle -------------------------------------------------------------------------

    async def start(self, run_loop: bool = True) -> None:
        keyring = KeyRing.load(self.config.admin_keys_file) if self.config.admin_keys_file else None
        if self.config.redis_url:
            self._redis = aioredis.Redis.from_url(self.config.redis_url, socket_timeout=2.0)
            self._registry = Registry(self.config.redis_url)
            await self._load_settings()
        self._server, port = await start_grpc_server(
            self.config.host,
            self.config.port,
            (SERVICE_NAME,),
            lambda server: agrpc.add_AdminServicer_to_server(self, server),
            self._health,
            auth_rules=ADMIN_RULES,
            keyring=keyring,
        )
        self.address = f"{self.config.host}:{port}"
        if self.config.metrics_port:
            self._metrics = ControllerMetrics(self.config.host, self.config.metrics_port)
        if run_loop:
            self._task = asyncio.create_task(self._run(), name="controller")
        log.info(
            "controller on %s (actuator %s, every %.1f s, window %.0f s)",
            self.address, self.actuator.name, self.config.interval_s, self.config.window_s,
        )  # fmt: skip

    async def stop(self) -> None:
        self._stop.set()
        if self._task is not None:
            await self._task
        if self._server is not None:
            await self._server.stop(grace=1.0)
        if self._metrics is not None:
            self._metrics.close()
        if self._registry is not None:
            await self._registry.close()
        if self._redis is not None:
            await self._redis.aclose()

    async def _run(self) -> None:
        while True:
            try:
                await self.tick()
            except Exception:
                log.exception("controller tick failed")
            try:
                await asyncio.wait_for(self._stop.wait(), self.config.interval_s)
                return
            except TimeoutError:
                pass

    # -- one decision ------------------------------------------------------------------------

    async def tick(self) -> Record | None:
        """Observe, decide and act once. None when there was nothing to decide on (Redis or
        the actuator unreachable: the error is in the status)."""
        async with self._tick_lock:
            now = self._clock()
            try:
                await self._observe(now)
                live = self._live_counts()
                self._current = await self.actuator.current(live)
                self._ready = await self.actuator.ready(live)
                self.capacity = await self.actuator.capacity()
            except (ActuatorError, *_REDIS_DOWN) as exc:
                self._fail(f"observe: {exc}")
                return None
            if self._first_observed is None:
                self._first_observed = now
            obs = Observation(
                now=now,
                replicas=dict(self._current),
                workers=list(self._workers),
                requests=list(self._requests),
                sla=self.sla,
                ready=dict(self._ready),
                capacity=self.capacity,
                since=max(self._first_observed, now - self.config.window_s),
            )
            before = self.state
            decision, self.state = decide(obs, self.control, before)
            record = Record(decision, applied=True)
            if decision.changed:
                log.info("decision: %s", decision.summary())
                try:
                    await self.actuator.scale(decision.target)
                    self._current = dict(decision.target)
                except ActuatorError as exc:
                    self._fail(f"scale: {exc}")
                    record = Record(decision, applied=False, error=str(exc))
                    # Not applied: forget the change (and the trial it opened or ended) so
                    # the next tick retries at once.
                    self.state = replace(
                        self.state,
                        last_change=before.last_change,
                        low_since=before.low_since,
                        trials=before.trials,
                        holds=before.holds,
                    )
            if record.applied:
                self.last_error = ""
            self.decisions.appendleft(record)
            if self._metrics is not None:
                self._metrics.update(self.status(), record.decision, record.applied)
            return record

    async def _observe(self, now: float) -> None:
        if self._registry is None:
            return
        infos = await self._registry.list_workers(model=self.model_id or None)
        if not self.model_id and infos:
            self.model_id = infos[0].model
        self._latest = [w for w in infos if w.model == self.model_id]
        self._observed_at = now
        self._workers.extend(sample_of(w, now) for w in self._latest)
        if self._reader is None and self.model_id and self._redis is not None:
            self._reader = RequestLogReader(self._redis, self.model_id)
        if self._reader is not None:
            self._requests.extend(await self._reader.read_new())
        self._workers.prune(now)
        self._requests.prune(now)

    def _live_counts(self) -> dict[str, int]:
        return {r: sum(1 for w in self._latest if w.role == r and not w.draining) for r in Role}

    def _fail(self, message: str) -> None:
        if message != self.last_error:
            log.warning("controller: %s", message)
        self.last_error = message

    # -- settings (kept in Redis so a restarted controller keeps them) ---------------------

    def _settings_key(self) -> str:
        return SETTINGS_PREFIX + (self.model_id or "_")

    async def _load_settings(self) -> None:
        assert self._redis is not None
        try:
            raw: Any = await self._redis.hgetall(self._settings_key())
        except _REDIS_DOWN as exc:
            if is_auth_error(exc):  # not an outage: retrying would never help
                raise RedisAuthError.of(self.config.redis_url, exc) from None
            log.warning("cannot load operator settings from Redis (%s); using flags", exc)
            return
        f = {k.decode(): v.decode() for k, v in raw.items()}
        try:
            if "ttft_p90_ms" in f:
                self.sla = SLA(float(f["ttft_p90_ms"]), float(f["itl_p90_ms"]))
            if f.get("pinned"):
                p, d = (int(x) for x in f["pinned"].split(":"))
                self.state = replace(self.state, pinned=(p, d))
        except (ValueError, KeyError) as exc:
            log.warning("ignoring malformed operator settings %r: %s", f, exc)
            return
        if f:
            log.info("operator settings from Redis: SLA %s, pinned %s", self.sla, self.state.pinned)

    async def _save_settings(self) -> None:
        if self._redis is None:
            return
        pinned = self.state.pinned
        mapping = {
            "ttft_p90_ms": repr(self.sla.ttft_p90_ms),
            "itl_p90_ms": repr(self.sla.itl_p90_ms),
            "pinned": f"{pinned[0]}:{pinned[1]}" if pinned else "",
        }
        try:
            await self._redis.hset(self._settings_key(), mapping=mapping)  # type: ignore[arg-type]
        except _REDIS_DOWN as exc:
            self._fail(f"could not save operator settings to Redis: {exc}")

    # -- admin API -----------------------------------------------------------------------

    def status(self) -> apb.StatusResponse:
        last = self.decisions[0] if self.decisions else None
        reqs = list(self._requests)
        itls = [r.itl_ms for r in reqs if r.output_tokens > 1]
        enough = self.control.min_requests
        live = self._live_counts()
        roles = []
        for role in Role:
            lo, hi = self.control.bounds(role)
            roles.append(
                apb.RoleStatus(
                    role=role,
                    current=self._current.get(role, 0),
                    desired=last.decision.target[role] if last else self._current.get(role, 0),
                    live=live[role],
                    ready=self._ready.get(role, 0),
                    draining=sum(1 for w in self._latest if w.role == role and w.draining),
                    min=lo,
                    max=hi,
                    reason=last.decision.reasons[role] if last else "no decision yet",
                )
            )
        return apb.StatusResponse(
            mode="manual" if self.state.pinned else "auto",
            roles=roles,
            sla=apb.Sla(ttft_p90_ms=self.sla.ttft_p90_ms, itl_p90_ms=self.sla.itl_p90_ms),
            window_requests=len(reqs),
            sla_attainment=(
                sum(self.sla.met(r.ttft_ms, r.itl_ms if r.output_tokens > 1 else 0.0) for r in reqs)
                / len(reqs)
                if reqs
                else math.nan
            ),
            ttft_p90_ms=(
                percentile([r.ttft_ms for r in reqs], 90) if len(reqs) >= enough else math.nan
            ),
            itl_p90_ms=percentile(itls, 90) if len(itls) >= enough else math.nan,
            actuator=self.actuator.name,
            last_error=self.last_error,
            last_decision_unix=last.decision.t if last else 0.0,
            workers=[
                apb.WorkerStatus(
                    worker_id=w.worker_id,
                    role=w.role,
                    address=w.address,
                    num_running=w.num_running,
                    num_waiting=w.num_waiting,
                    num_blocks=w.num_blocks,
                    num_free_blocks=w.num_free_blocks,
                    step_ms=w.step_ms,
                    tokens_per_s=w.tokens_per_s,
                    busy_frac=w.busy_frac,
                    draining=w.draining,
                    updated_unix=w.updated_at,
                    kv_format=w.kv_format,
                    speculative=w.speculative,
                    draft_format=w.draft_format,
                    host_onload_tokens_per_s=w.host_onload_tokens_per_s,
                    disk_onload_tokens_per_s=w.disk_onload_tokens_per_s,
                    host_tier_blocks=w.host_tier_blocks,
                    disk_tier_blocks=w.disk_tier_blocks,
                    tier_hit_tokens=w.tier_hit_tokens,
                )
                for w in sorted(self._latest, key=lambda w: (Role(w.role).rank, w.worker_id))
            ],
            recent=self._recent_latency(self._clock()),
            observed_unix=self._observed_at,
            capacity=(
                apb.HostCapacity(
                    max_workers=self.capacity.max_workers,
                    num_workers=self.capacity.num_workers,
                    reason=self.capacity.why,
                )
                if self.capacity is not None
                else None
            ),
        )

    def _recent_latency(self, now: float) -> apb.LatencySummary:
        """p50/p90 of the requests finished in the last RECENT_S (as much of it as the
        window holds): what an operator watching `tandem ctl top` sees."""
        window_s = min(RECENT_S, self.config.window_s)
        reqs = [r for r in self._requests if r.t >= now - window_s]
        ttfts = [r.ttft_ms for r in reqs]
        itls = [r.itl_ms for r in reqs if r.output_tokens > 1]

        def pct(values: list[float], q: float) -> float:
            return percentile(values, q) if values else math.nan

        return apb.LatencySummary(
            window_s=window_s,
            requests=len(reqs),
            ttft_p50_ms=pct(ttfts, 50),
            ttft_p90_ms=pct(ttfts, 90),
            itl_p50_ms=pct(itls, 50),
            itl_p90_ms=pct(itls, 90),
        )

    @rpc
    async def Status(
        self, request: apb.StatusRequest, context: grpc.aio.ServicerContext
    ) -> apb.StatusResponse:
        return self.status()

    @rpc
    async def Explain(
        self, request: apb.ExplainRequest, context: grpc.aio.ServicerContext
    ) -> apb.ExplainResponse:
        if request.limit < 0:
            raise invalid_argument(f"limit: must be >= 0, got {request.limit}")
        limit = request.limit or 5
        return apb.ExplainResponse(
            decisions=[
                apb.DecisionRecord(
                    unix_time=r.decision.t,
                    current=r.decision.current,
                    target=r.decision.target,
                    reasons=r.decision.reasons,
                    figures=r.decision.figures,
                    applied=r.applied,
                    error=r.error,
                )
                for r in list(self.decisions)[:limit]
            ]
        )

    @rpc
    async def SetRatio(
        self, request: apb.SetRatioRequest, context: grpc.aio.ServicerContext
    ) -> apb.StatusResponse:
        for role, value in ((Role.PREFILL, request.prefill), (Role.DECODE, request.decode)):
            lo, hi = self.control.bounds(role)
            if not lo <= value <= hi:
                raise invalid_argument(
                    f"{role}: {value} is outside [{lo}, {hi}] (the controller's min_{role} "
                    f"and max_{role})",
                )
        self.state = replace(self.state, pinned=(request.prefill, request.decode))
        log.info("operator pinned prefill:decode at %d:%d", request.prefill, request.decode)
        await self._save_settings()
        await self.tick()
        return self.status()

    @rpc
    async def SetSla(
        self, request: apb.SetSlaRequest, context: grpc.aio.ServicerContext
    ) -> apb.StatusResponse:
        sla = request.sla
        if not sla.HasField("ttft_p90_ms") and not sla.HasField("itl_p90_ms"):
            raise invalid_argument("sla: set ttft_p90_ms and/or itl_p90_ms")
        try:
            self.sla = SLA(
                ttft_p90_ms=sla.ttft_p90_ms
                if sla.HasField("ttft_p90_ms")
                else self.sla.ttft_p90_ms,
                itl_p90_ms=sla.itl_p90_ms if sla.HasField("itl_p90_ms") else self.sla.itl_p90_ms,
            )
        except ValueError as exc:
            raise invalid_argument(f"sla.{exc}") from None
        log.info("operator set SLA targets: %s", self.sla)
        await self._save_settings()
        return self.status()

    @rpc
    async def Auto(
        self, request: apb.AutoRequest, context: grpc.aio.ServicerContext
    ) -> apb.StatusResponse:
        self.state = replace(self.state, pinned=None)
        log.info("operator returned the controller to automatic control")
        await self._save_settings()
        await self.tick()
        return self.status()
