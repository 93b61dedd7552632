"""The discrete-event cluster: router, workers and (optionally) the ratio controller.

`simulate(trace, cost, config)` replays a trace:

  arrival   the router places the request with the real `tandem.routing.choose` on its view
            of the workers (a snapshot refreshed every `router_refresh_s`, plus its own
            in-flight counts, as the router service keeps them)
  prefill   FCFS chunked prefill on the chosen prefill worker; token 1 when it finishes
  decode    KV blocks reserved on the decode worker (FIFO wait when short), KV transfer
            (bytes / link bandwidth + latency), then the continuous batch until the last token
  colocated (choose() said the decode worker prefills): blocks, then the batch directly

Every `stats_period_s` each started worker reports a `WorkerSample`; with `autoscale` the
controller keeps the last `window_s` of samples and finished requests, and every
`interval_s` calls the real `tandem.control.decide`. Scale-up starts workers that serve
after `startup_s` (model load); scale-down first cancels a starting worker, else marks the
least loaded live worker draining (routers skip it at once) and removes it when empty.
Without `autoscale` the (P, D) counts are static.

Measurement: requests that arrive in [warmup_s, duration_s) and GPU-seconds over the same
span, counting every allocated worker (starting, live, draining). The run goes on after the
trace until every request has finished or `drain_grace_s` passed; by default that is the
longest time a request of the trace could take and still meet the SLA (TTFT target + ITL
target * output tokens), so a request still unfinished then is certain to have missed it.
Given the same trace, cost model and config, the run is identical (ties in the event queue
break by insertion order).

Left out on purpose: prefix caching (routing sees no overlap, every prompt is computed),
the prefill worker's own KV capacity and lease, preemption on decode (admission reserves a
sequence's blocks up front), failures, and the network beyond one hand-off's bytes/latency.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from tandem.control import (
    SLA,
    ControlConfig,
    ControlState,
    Decision,
    Observation,
    RequestSample,
    SampleWindow,
    WorkerSample,
    decide,
)
from tandem.routing import RouteRequest, RoutingConfig, WorkerLoad, choose
from tandem.sim.cost import CostModel
from tandem.sim.results import (
    FINISHED,
    REJECTED,
    UNFINISHED,
    RequestRecord,
    SeriesPoint,
    SimResult,
)
from tandem.sim.trace import TraceRequest
from tandem.sim.workers import (
    DRAINING,
    LIVE,
    REMOVED,
    STARTING,
    DecodeWorker,
    PrefillWorker,
    SimRequest,
    Worker,
)
from tandem.types import Role

Policy = Callable[[Observation, ControlConfig, ControlState], tuple[Decision, ControlState]]


@dataclass(frozen=True, slots=True)
class SimConfig:
    """One run. `num_prefill`/`num_decode` are the static counts, or the controller's
    starting counts with `autoscale`; `control` bounds apply only with `autoscale`."""

    duration_s: float = 1800.0
    num_prefill: int = 1
    num_decode: int = 1
    autoscale: bool = False
    control: ControlConfig = field(default_factory=ControlConfig)
    sla: SLA = field(default_factory=SLA)
    routing: RoutingConfig = field(default_factory=RoutingConfig)
    interval_s: float = 5.0
    window_s: float = 60.0
    stats_period_s: float = 1.0
    router_refresh_s: float = 0.5
    startup_s: float = 60.0
    warmup_s: float = 0.0
    drain_grace_s: float | None = None
    label: str = ""

    def __post_init__(self) -> None:
        if self.duration_s <= 0:
            raise ValueError(f"duration_s must be positive, got {self.duration_s}")
        if self.num_prefill < 0 or self.num_decode < 1:
            raise ValueError(
                f"need num_prefill >= 0 and num_decode >= 1, got {self.num_prefill}, "
                f"{self.num_decode}"
            )
        for name in ("interval_s", "stats_period_s", "router_refresh_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.window_s < self.interval_s:
            raise ValueError(f"window_s {self.window_s} < interval_s {self.interval_s}")
        if self.startup_s < 0 or (self.drain_grace_s is not None and self.drain_grace_s < 0):
            raise ValueError("startup_s and drain_grace_s must be >= 0")
        if not 0 <= self.warmup_s < self.duration_s:
            raise ValueError(f"need 0 <= warmup_s < duration_s, got {self.warmup_s}")


class Cluster:
    """The event loop and everything on it; `simulate()` is the entry point."""

    def __init__(self, cost: CostModel, config: SimConfig, policy: Policy = decide) -> None:
        self.cost = cost
        self.config = config
        self.policy = policy
        self._num_kv_blocks = cost.num_kv_blocks
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable[[Any], None], Any]] = []
        self._seq = itertools.count()
        self.num_events = 0
        self.workers: dict[str, Worker] = {}  # every worker ever, by id
        self._next_id: dict[str, int] = {role: 0 for role in Role}
        self.target: dict[str, int] = {
            Role.PREFILL: config.num_prefill,
            Role.DECODE: config.num_decode,
        }
        # Router state: the registry snapshot and its own in-flight counts.
        self._view: dict[str, WorkerLoad] = {}
        self._inflight_reqs: dict[str, int] = {}
        self._inflight_tokens: dict[str, int] = {}
        self._sequence = 0
        self._dirty: set[str] = set()  # workers whose in-flight counts changed
        # Controller state.
        self._samples = SampleWindow[WorkerSample](config.window_s)
        self._finished = SampleWindow[RequestSample](config.window_s)
        self._control_state = ControlState()
        self.decisions: list[Decision] = []
        self.series: list[SeriesPoint] = []
        # GPU-seconds: allocated workers per role, integrated up to duration_s.
        self._allocated: dict[str, int] = {role: 0 for role in Role}
        self._gpu_s: dict[str, float] = {role: 0.0 for role in Role}
        self._gpu_t = 0.0
        self.requests: list[SimRequest] = []
        self.rejected: set[int] = set()
        self.outstanding = 0
        self.removed_nonempty = 0  # invariant counter: must stay 0

    # -- event queue ----------------------------------------------------------------------

    def schedule(self, t: float, fn: Callable[[Any], None], arg: Any = None) -> None:
        heapq.heappush(self._heap, (t, next(self._seq), fn, arg))

    def run(self, trace: Sequence[TraceRequest]) -> None:
        cfg = self.config
        for role, n in ((Role.PREFILL, cfg.num_prefill), (Role.DECODE, cfg.num_decode)):
            for _ in range(n):
                self._add_worker(role, ready_s=0.0)
        self._refresh_view()
        self.requests = [
            SimRequest(r.request_id, r.arrival_s, r.prompt_tokens, r.output_tokens, r.phase)
            for r in trace
        ]
        for req in self.requests:
            self.schedule(req.arrival_s, self._on_arrival, req)
        self.outstanding = len(self.requests)
        self.schedule(cfg.router_refresh_s, self._on_refresh)
        self.schedule(cfg.stats_period_s, self._on_stats)
        self.schedule(0.0, self._on_interval)
        grace = cfg.drain_grace_s
        if grace is None:
            longest = max((r.output_tokens for r in trace), default=0)
            grace = (cfg.sla.ttft_p90_ms + cfg.sla.itl_p90_ms * longest) / 1e3 + 1.0
        end = cfg.duration_s + grace
        heap = self._heap
        pop = heapq.heappop
        while heap:
            t, _, fn, arg = pop(heap)
            if t > end:
                break
            self.now = t
            fn(arg)
            self.num_events += 1
            if self.outstanding == 0 and t >= cfg.duration_s:
                break
        self._account_gpu(min(self.now, cfg.duration_s))

    # -- workers --------------------------------------------------------------------------

    def _add_worker(self, role: str, ready_s: float) -> Worker:
        wid = f"{role[0]}{self._next_id[role]}"
        self._next_id[role] += 1
        w: Worker
        if role == Role.PREFILL:
            w = PrefillWorker(wid, self.cost, self, self.now, self._on_prefilled, self._on_idle)
        else:
            w = DecodeWorker(wid, self.cost, self, self.now, self._on_decoded, self._on_idle)
        self.workers[wid] = w
        self._set_allocated(role, +1)
        if ready_s <= self.now:
            w.state = LIVE
        else:
            self.schedule(ready_s, self._on_ready, w)
        return w

    def _on_ready(self, w: Worker) -> None:
        if w.state == STARTING:  # not cancelled meanwhile
            w.state = LIVE

    def _remove(self, w: Worker) -> None:
        if not w.is_empty():
            self.removed_nonempty += 1
        w.state = REMOVED
        w.removed_s = self.now
        self._view.pop(w.worker_id, None)
        self._set_allocated(w.role, -1)

    def _on_idle(self, w: Worker) -> None:
        if w.state == DRAINING and w.is_empty():
            self._remove(w)

    def _set_allocated(self, role: str, delta: int) -> None:
        self._account_gpu(min(self.now, self.config.duration_s))
        self._allocated[role] += delta

    def _account_gpu(self, t: float) -> None:
        start = max(self._gpu_t, self.config.warmup_s)
        if t > start:
            for role in Role:
                self._gpu_s[role] += self._allocated[role] * (t - start)
        self._gpu_t = max(self._gpu_t, t)

    def _of(self, role: str, *states: str) -> list[Worker]:
        return [w for w in self.workers.values() if w.role == role and w.state in states]

    # -- router ---------------------------------------------------------------------------

    def _load(self, w: Worker) -> WorkerLoad:
        wid = w.worker_id
        if isinstance(w, PrefillWorker):
            return WorkerLoad(
                worker_id=wid, role=Role.PREFILL, address=wid,
                queued_prefill_tokens=w.queued_tokens,
                num_running=1 if w.queue else 0,
                num_waiting=max(0, len(w.queue) - 1),
                draining=w.state == DRAINING,
                inflight_prefill_tokens=self._inflight_tokens.get(wid, 0),
            )  # fmt: skip
        assert isinstance(w, DecodeWorker)
        return WorkerLoad(
            worker_id=wid, role=Role.DECODE, address=wid,
            num_running=w.batch_size,
            num_waiting=w.num_waiting,
            num_free_blocks=w.free_blocks,
            num_blocks=self._num_kv_blocks,
            draining=w.state == DRAINING,
            inflight_requests=self._inflight_reqs.get(wid, 0),
        )  # fmt: skip

    def _refresh_view(self) -> None:
        self._dirty.clear()
        self._view = {
            wid: self._load(w) for wid, w in self.workers.items() if w.state in (LIVE, DRAINING)
        }

    def _on_refresh(self, _: Any) -> None:
        self._refresh_view()
        self.schedule(self.now + self.config.router_refresh_s, self._on_refresh)

    def _bump(self, wid: str, reqs: int = 0, tokens: int = 0) -> None:
        if reqs:
            self._inflight_reqs[wid] = self._inflight_reqs.get(wid, 0) + reqs
        if tokens:
            self._inflight_tokens[wid] = max(0, self._inflight_tokens.get(wid, 0) + tokens)
        self._dirty.add(wid)

    def _current_view(self) -> Iterable[WorkerLoad]:
        """The snapshot with this router's in-flight counts as they are now."""
        view = self._view
        for wid in self._dirty:
            v = view.get(wid)
            if v is not None:
                # Constructed, not dataclasses.replace'd (3x as costly here).
                view[wid] = WorkerLoad(
                    worker_id=v.worker_id, role=v.role, address=v.address,
                    queued_prefill_tokens=v.queued_prefill_tokens, num_running=v.num_running,
                    num_waiting=v.num_waiting, num_free_blocks=v.num_free_blocks,
                    num_blocks=v.num_blocks, draining=v.draining,
                    inflight_requests=self._inflight_reqs.get(wid, 0),
                    inflight_prefill_tokens=self._inflight_tokens.get(wid, 0),
                )  # fmt: skip
        self._dirty.clear()
        return view.values()

    def _on_arrival(self, req: SimRequest) -> None:
        block_size = self.cost.block_size
        if -(-req.total_tokens // block_size) > self._num_kv_blocks:
            self._reject(req)  # can never fit a decode worker's KV cache
            return
        self._sequence += 1
        route = RouteRequest(req.prompt_tokens, block_size, sequence=self._sequence)
        placement = choose(route, self._current_view(), self.config.routing)
        if placement is None:
            self._reject(req)
            return
        decode = self.workers[placement.decode.worker_id]
        assert isinstance(decode, DecodeWorker)
        req.decode_id = decode.worker_id
        self._bump(decode.worker_id, reqs=1)
        if placement.prefill is None:
            decode.admit(req)
            return
        prefill = self.workers[placement.prefill.worker_id]
        assert isinstance(prefill, PrefillWorker)
        req.prefill_id = prefill.worker_id
        req.disaggregated = True
        self._bump(prefill.worker_id, tokens=req.prompt_tokens)
        prefill.submit(req)

    def _reject(self, req: SimRequest) -> None:
        self.rejected.add(req.request_id)
        self.outstanding -= 1

    def _on_prefilled(self, req: SimRequest, now: float) -> None:
        req.first_token_s = now
        assert req.prefill_id is not None and req.decode_id is not None
        self._bump(req.prefill_id, tokens=-req.prompt_tokens)
        if req.output_tokens == 1:  # done at token 1: nothing to decode
            req.finish_s = now
            self._on_decoded(req, now)
            return
        decode = self.workers[req.decode_id]
        assert isinstance(decode, DecodeWorker)
        decode.admit(req)

    def _on_decoded(self, req: SimRequest, now: float) -> None:
        assert req.decode_id is not None and req.first_token_s is not None
        self._bump(req.decode_id, reqs=-1)
        self.outstanding -= 1
        ttft_ms = 1e3 * (req.first_token_s - req.arrival_s)
        itl_ms = _itl_s(req) * 1e3
        self._finished.add(
            RequestSample(
                now, ttft_ms, itl_ms, req.prompt_tokens, req.output_tokens,
                disaggregated=req.disaggregated,
            )
        )  # fmt: skip

    # -- stats and control ----------------------------------------------------------------

    def _on_stats(self, _: Any) -> None:
        period = self.config.stats_period_s
        if self.config.autoscale:
            for w in self.workers.values():
                if w.state in (LIVE, DRAINING):
                    self._samples.add(w.report(self.now, period))
        self.schedule(self.now + period, self._on_stats)

    def _on_interval(self, _: Any) -> None:
        cfg = self.config
        if cfg.autoscale and self.now > 0:
            self._samples.prune(self.now)
            self._finished.prune(self.now)
            obs = Observation(
                now=self.now,
                replicas=dict(self.target),
                workers=list(self._samples),
                requests=list(self._finished),
                sla=cfg.sla,
            )
            decision, self._control_state = self.policy(obs, cfg.control, self._control_state)
            self.decisions.append(decision)
            for role in Role:
                self._apply(role, decision.target[role])
        self._record_point()
        if self.now < cfg.duration_s:
            self.schedule(self.now + cfg.interval_s, self._on_interval)

    def _apply(self, role: str, target: int) -> None:
        cur = self.target[role]
        self.target[role] = target
        for _ in range(target - cur):
            self._add_worker(role, ready_s=self.now + self.config.startup_s)
        for _ in range(cur - target):
            starting = self._of(role, STARTING)
            if starting:  # cancel the newest start first
                w = starting[-1]
                w.state = DRAINING
                self._remove(w)
                continue
            live = self._of(role, LIVE)
            if not live:
                continue
            w = min(live, key=lambda w: (w.load, w.worker_id))
            w.state = DRAINING
            view = self._view.get(w.worker_id)
            if view is not None:  # routers skip it from now on
                self._view[w.worker_id] = replace(view, draining=True)
            self._on_idle(w)

    def _record_point(self) -> None:
        def count(role: str, *states: str) -> int:
            return len(self._of(role, *states))

        prefills = [w for w in self._of(Role.PREFILL, LIVE, DRAINING)]
        decodes = [w for w in self._of(Role.DECODE, LIVE, DRAINING)]
        self.series.append(
            SeriesPoint(
                t=self.now,
                target=dict(self.target),
                workers={r: self._allocated[r] for r in Role},
                starting={r: count(r, STARTING) for r in Role},
                draining={r: count(r, DRAINING) for r in Role},
                queued_prefill_tokens=sum(w.load for w in prefills),
                decode_running=sum(w.batch_size for w in decodes if isinstance(w, DecodeWorker)),
                decode_waiting=sum(w.num_waiting for w in decodes if isinstance(w, DecodeWorker)),
            )
        )

    # -- results --------------------------------------------------------------------------

    def check_integrity(self) -> None:
        for w in self.workers.values():
            if isinstance(w, (PrefillWorker, DecodeWorker)):
                w.check_integrity()
        assert self.removed_nonempty == 0, f"{self.removed_nonempty} workers removed non-empty"

    def result(self, trace_label: str, wall_s: float) -> SimResult:
        sla = self.config.sla
        records = []
        for req in self.requests:
            status = (
                REJECTED
                if req.request_id in self.rejected
                else FINISHED
                if req.finish_s is not None
                else UNFINISHED
            )
            ttft = req.first_token_s - req.arrival_s if req.first_token_s is not None else None
            itl = _itl_s(req) if status == FINISHED else None
            met = (
                status == FINISHED
                and ttft is not None
                and itl is not None
                and sla.met(ttft * 1e3, itl * 1e3)
            )
            records.append(
                RequestRecord(
                    req.request_id, req.arrival_s, req.phase, req.prompt_tokens,
                    req.output_tokens, status, req.disaggregated, req.prefill_id,
                    req.decode_id, ttft, itl, req.finish_s, met,
                )
            )  # fmt: skip
        return SimResult(
            label=trace_label,
            duration_s=self.config.duration_s,
            warmup_s=self.config.warmup_s,
            sla=sla,
            interval_s=self.config.interval_s,
            requests=records,
            series=self.series,
            decisions=self.decisions,
            gpu_s=dict(self._gpu_s),
            wall_s=wall_s,
            events=self.num_events,
        )


def _itl_s(req: SimRequest) -> float:
    """Mean gap between tokens after the first; 0 for a 1-token output."""
    assert req.finish_s is not None and req.first_token_s is not None
    if req.output_tokens <= 1:
        return 0.0
    return (req.finish_s - req.first_token_s) / (req.output_tokens - 1)


def simulate(
    trace: Sequence[TraceRequest],
    cost: CostModel,
    config: SimConfig,
    label: str = "",
    policy: Policy = decide,
) -> SimResult:
    """Replay `trace` on a cluster; see the module docstring. `policy` replaces
    `tandem.control.decide` (same signature) to study variants."""
    started = time.perf_counter()
    cluster = Cluster(cost, config, policy)
    cluster.run(trace)
    return cluster.result(label or config.label, time.perf_counter() - started)
