"""The router's placement side: which workers exist (Redis registry or static lists), which
of them this router saw fail (circuit breakers), what they cache (prefix index, with a
deadline), what this router already sent them (in-flight load), and the pure policy
`tandem.routing.choose` over all of it."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from tandem.engine.prefix_hash import (
    DISK_TIER,
    HOST_TIER,
    hash_blocks,
    hash_keys,
    kv_hash_format,
    state_mark,
    table_key,
    tier_mark,
)
from tandem.engine.request import RequestSpec
from tandem.index import IndexUnavailable
from tandem.model.config import ModelConfig
from tandem.model.layer_groups import window_marks_from
from tandem.routing import (
    InflightLoad,
    Placement,
    RouteRequest,
    TierOverlap,
    WorkerLoad,
    choose,
    prefix_key,
    weigh,
)
from tandem.routing.admission import Admission, estimate_delay_s, queued_tokens
from tandem.routing.health import CircuitBreakers
from tandem.routing.recovery import HOLD_POLL_S
from tandem.services.common.observe import tracing
from tandem.services.common.redis.index import RedisPrefixIndex
from tandem.services.common.redis.registry import Registry, WorkerInfo, WorkerWatcher
from tandem.services.common.rpc.errors import unavailable
from tandem.services.router.config import RouterConfig
from tandem.services.router.links import Background
from tandem.types import Role

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ResumeMarks:
    """What a worker must hold besides a prefix's blocks to resume it: the marks the router's
    index lookups carry (`PrefixIndex.lookup`), by `kind`:

        "none"     full attention only: the blocks are enough
        "state"    linear-attention layers: a state checkpoint right after the prefix's last
                   block (`state_mark` of its hash)
        "sliding"  sliding-window layers: KV table `table`'s key (`table_key`) of every block
                   the next token's `window` tokens read (`window_marks_from`)

    KV tiers (tandem.routing.tiers) are looked up for "none" alone: a tier's marks say a
    worker holds a block's KV, not the state checkpoint or window pages that resuming a
    "state" or "sliding" model also needs, so those count their device blocks only.
    """

    kind: Literal["none", "state", "sliding"] = "none"
    table: int = 0
    window: int = 0

    def __post_init__(self) -> None:
        if self.kind == "sliding" and self.window < 2:
            # window_marks_from's bound, checked when the router starts rather than per request
            raise ValueError(f"sliding marks need a window of 2 tokens or more, got {self.window}")

    @classmethod
    def of(cls, config: ModelConfig) -> ResumeMarks:
        """The marks of a model: state marks where it has linear-attention layers (whose
        checkpoints decide where it resumes), else its first sliding table's keys where it
        has one (the table workers publish), else none."""
        if config.features.linear_layers:
            return cls("state")
        layout = config.kv_layout
        if layout.sliding is None:
            return cls()
        return cls("sliding", layout.sliding, layout.tables[layout.sliding].window or 0)

    def lookup_args(
        self, hashes: Sequence[int], block_size: int
    ) -> tuple[list[int] | None, tuple[int, ...] | None]:
        """(marks, marks_from) for looking up the chain `hashes` of `block_size`-token
        blocks."""
        if self.kind == "state":
            return [state_mark(h) for h in hashes], None
        if self.kind == "sliding":
            marks = [table_key(h, self.table) for h in hashes]
            return marks, window_marks_from(len(hashes), self.window, block_size)
        return None, None


class Placer:
    """Chooses a (prefill, decode) pair per request. `place` never fails because the index
    is down: placement then uses load alone and `index_degraded` says so."""

    def __init__(
        self,
        config: RouterConfig,
        model_id: str,
        on_join: Callable[[WorkerInfo], None] | None = None,
        marks: ResumeMarks = ResumeMarks(),
    ) -> None:
        self.config = config
        self._on_join = on_join  # e.g. the router drops a connection from an earlier outage
        self.model_id = model_id
        # A model with linear-attention or sliding-window layers resumes a prefix only where
        # a worker holds more than its blocks: lookups count only what it can resume.
        self.marks = marks
        self.inflight = InflightLoad()
        self.breakers = CircuitBreakers(config.breaker)
        self.index_degraded = False
        self._index: RedisPrefixIndex | None = None
        self._registry: Registry | None = None
        self._watcher: WorkerWatcher | None = None
        self._sequence = 0
        self._background = Background()

    async def start(self) -> None:
        if not self.config.redis_url:
            return
        if self.config.routing.policy == "kv":
            self._index = RedisPrefixIndex(self.config.redis_url)
        self._registry = Registry(self.config.redis_url)
        self._watcher = WorkerWatcher(
            self._registry, self.config.worker_refresh_s, on_change=self._on_workers_change
        )
        await self._watcher.start()

    async def stop(self) -> None:
        if self._watcher is not None:
            await self._watcher.stop()
        if self._registry is not None:
            await self._registry.close()
        if self._index is not None:
            await self._index.close()

    async def place(
        self, spec: RequestSpec, span: tracing.Span = tracing.INVALID_SPAN
    ) -> Placement:
        """Raises ServiceError(UNAVAILABLE) when no decode worker is available. `span`
        (tandem.route) gets the decision, its reason and the candidates' scores."""
        workers = self.workers()
        hashes, overlap, tiers = await self._prefix_lookups(spec, workers)
        self._sequence += 1
        route = RouteRequest(
            spec.num_prompt_tokens,
            self.config.block_size,
            overlap,
            self._sequence,
            prefix_key(hashes, self.config.routing.affinity_blocks),
            tiers,
        )
        placement = choose(route, workers, self.config.routing)
        if placement is None and self._decode_expected():
            # Every decode worker is draining or out of rotation now (a rolling restart's
            # gap between one leaving and the next registering): wait for one, within the
            # stream hold (RecoveryConfig.hold_s), rather than refuse the request.
            deadline = time.monotonic() + self.config.recovery.hold_s
            while placement is None and time.monotonic() < deadline:
                await asyncio.sleep(HOLD_POLL_S)
                workers = self.workers()
                placement = choose(route, workers, self.config.routing)
        candidates = (
            placement.candidates
            if placement is not None
            else weigh(route, workers, self.config.routing)
        )
        tracing.annotate_route(span, candidates, placement, self.index_degraded)
        if placement is None:
            raise unavailable(self._no_decode_message(), retry_after_s=1.0)
        self.claim(placement.decode.worker_id)
        if placement.prefill is not None:
            self.claim(placement.prefill.worker_id)
        log.info(
            "route %s: %d tokens, %d blocks, overlap %s%s -> prefill %s, decode %s (%s)",
            spec.request_id,
            spec.num_prompt_tokens,
            len(hashes),
            overlap if overlap is not None else "n/a",
            f", tiers {_tier_counts(tiers)}" if tiers else "",
            placement.prefill.worker_id if placement.prefill else "-",
            placement.decode.worker_id,
            placement.reason,
        )
        return placement

    def admission(self, spec: RequestSpec, placement: Placement) -> Admission:
        """Whether `placement` would start `spec` within max_queue_delay_s, from the
        prefilling worker's queue and measured prefill rate (tandem.routing.admission).

        This router's in-flight tokens are read now, not from the placement's snapshot:
        requests of a burst are placed concurrently (placement awaits the prefix index), so
        every snapshot predates the others' dispatch; from here to dispatch nothing awaits."""
        worker = placement.prefill or placement.decode
        inflight = self.inflight.prefill_tokens.get(worker.worker_id, 0)
        queued = queued_tokens(worker.queued_prefill_tokens, inflight)
        uncached = spec.num_prompt_tokens - placement.cached_tokens
        estimate = estimate_delay_s(queued, uncached, worker.prefill_tokens_per_s)
        return Admission.decide(estimate, self.config.max_queue_delay_s, worker.worker_id)

    def workers(self) -> list[WorkerLoad]:
        """Every healthy worker of this model with its load, as the placement policy sees it:
        known to the registry (or listed) and not held out by its circuit breaker."""
        now = time.monotonic()
        return [
            self.inflight.with_inflight(w.load())
            for w in self._known()
            if self.breakers.allows(w.worker_id, now, w.epoch or None)
        ]

    def epoch_of(self, worker_id: str) -> int | None:
        """The registry epoch (incarnation) of `worker_id` now; None when it is not known."""
        return next((w.epoch for w in self._known() if w.worker_id == worker_id), None)

    def _known(self) -> list[WorkerInfo]:
        """Every worker of this model the registry knows (or the static lists name)."""
        if self._watcher is not None:
            return [w for w in self._watcher.snapshot().values() if w.model == self.model_id]
        return [
            WorkerInfo(worker_id=a, role=role, address=a, model=self.model_id, epoch=0)
            for role, addrs in (
                (Role.PREFILL, self.config.prefill_addresses),
                (Role.DECODE, self.config.decode_addresses),
            )
            for a in addrs
        ]

    def worker_states(self) -> dict[tuple[str, str], int]:
        """How many workers of this model per (role, "healthy" | "open_breaker"): whether
        placement may use them now (tandem_router_workers)."""
        counts: dict[tuple[str, str], int] = {}
        now = time.monotonic()
        for w in self._known():
            ok = self.breakers.allows(w.worker_id, now, w.epoch or None)
            key = (w.role, "healthy" if ok else "open_breaker")
            counts[key] = counts.get(key, 0) + 1
        return counts

    def claim(self, worker_id: str) -> None:
        """A request goes to the worker (its probe, if its breaker is half-open)."""
        self.breakers.claim(worker_id, time.monotonic())

    def worker_ok(self, worker_id: str) -> None:
        self.breakers.success(worker_id)

    def worker_failed(self, worker_id: str, why: str) -> bool:
        """A worker fault seen by this router: out of rotation until its breaker lets a
        probe through (or it re-registers as a new incarnation). True when this took it
        out of rotation."""
        if self.breakers.failure(worker_id, time.monotonic()):
            log.warning("worker %s out of rotation: %s", worker_id, why)
            return True
        return False

    def _decode_expected(self) -> bool:
        """Is a decode worker of this model registered, though none is placeable (draining,
        or held out by its breaker)? Then one is expected back shortly."""
        return any(w.role == Role.DECODE for w in self._known())

    def _no_decode_message(self) -> str:
        held = self.breakers.open_workers(time.monotonic())
        if held:
            return f"no healthy decode worker (recently failed: {', '.join(held)}); retry later"
        return "no decode worker available; retry later"

    async def _prefix_overlap(
        self, spec: RequestSpec, workers: list[WorkerLoad]
    ) -> tuple[list[int], dict[str, int] | None]:
        """`_prefix_lookups` without the tiers: the hashes and the device overlap."""
        hashes, overlap, _ = await self._prefix_lookups(spec, workers)
        return hashes, overlap

    async def _prefix_lookups(
        self, spec: RequestSpec, workers: list[WorkerLoad]
    ) -> tuple[list[int], dict[str, int] | None, dict[str, TierOverlap] | None]:
        """The prompt's block hashes, each worker's cached leading blocks and, for workers
        with KV tiers, their leading blocks per tier. The same chained hashes the workers
        publish (tandem.engine.prefix_hash): an fp8 cache hashes its KV format too, so each
        format's workers are looked up under their own hashes (one lookup per format in the
        fleet, usually one). The hashes returned (the prefix key's) are those of the format
        most workers have.

        Where a format's workers include one advertising a tier (an onload rate > 0) and the
        model's marks are "none" (`ResumeMarks`), the chains of the hashes' host and disk
        tier marks are looked up with it, concurrently: a `TierOverlap` per worker found in
        any of them. Otherwise one lookup, and tiers None."""
        by_format: dict[str, list[WorkerLoad]] = {}
        for w in workers:
            by_format.setdefault(kv_hash_format(w.kv_format), []).append(w)
        formats = sorted(by_format, key=lambda f: (-len(by_format[f]), f)) or [""]
        tokens = list(spec.prompt_token_ids)
        first: list[int] = []
        merged: dict[str, int] | None = None
        tiers: dict[str, TierOverlap] | None = None
        for i, fmt in enumerate(formats):
            keys = hash_keys(self.model_id, spec.cache_salt, fmt)
            hashes = hash_blocks(tokens, self.config.block_size, keys)
            if i == 0:
                first = hashes
            members = by_format.get(fmt, [])
            tiered = self.marks.kind == "none" and any(
                w.host_onload_tokens_per_s > 0 or w.disk_onload_tokens_per_s > 0 for w in members
            )
            chains = [hashes]
            if tiered:
                chains += [[tier_mark(h, t) for h in hashes] for t in (HOST_TIER, DISK_TIER)]
            found = await self._lookup(chains)
            if found is None:
                return first, None, None
            ids = {w.worker_id for w in members}
            mine = [
                {w: n for w, n in counts.items() if w in ids or len(formats) == 1}
                for counts in found
            ]
            merged = {**(merged or {}), **mine[0]}
            if tiered:
                dev, host, disk = mine
                fmt_tiers = {
                    w: TierOverlap.of(dev.get(w, 0), host.get(w, 0), disk.get(w, 0))
                    for w in sorted(dev.keys() | host.keys() | disk.keys())
                }
                tiers = {**(tiers or {}), **fmt_tiers}
        return first, merged, tiers

    async def _lookup(self, chains: list[list[int]]) -> list[dict[str, int]] | None:
        """Leading blocks per worker for each chain (the prompt's hashes first, with the
        model's resume marks; then any tier marks' chains, plain), looked up concurrently
        under one deadline; or None when the index cannot answer in time (then placement
        uses load alone: no request fails because the index is down)."""
        hashes = chains[0]
        if self._index is None or not hashes:
            return None
        marks, marks_from = self.marks.lookup_args(hashes, self.config.block_size)
        lookups = [self._index.lookup(self.model_id, hashes, marks, marks_from)]
        lookups += [self._index.lookup(self.model_id, chain) for chain in chains[1:]]
        try:
            found = await asyncio.wait_for(asyncio.gather(*lookups), self.config.index_timeout_s)
        except (IndexUnavailable, TimeoutError) as exc:
            if not self.index_degraded:
                log.warning("prefix index unavailable (%r): routing on load alone", exc)
                self.index_degraded = True
            return None
        if self.index_degraded:
            log.info("prefix index reachable again: cache-aware routing resumed")
            self.index_degraded = False
        return list(found)

    def _on_workers_change(self, joined: list[WorkerInfo], left: list[str]) -> None:
        for w in joined:
            log.info("worker joined: %s (%s) at %s", w.worker_id, w.role, w.address)
            if self._on_join is not None:
                self._on_join(w)
        for worker_id in left:
            log.info("worker left: %s", worker_id)
            self.breakers.forget(worker_id)
            if self._index is not None:  # its cache is gone; so are its index entries
                self._background.spawn(self._forget_worker(worker_id))

    async def _forget_worker(self, worker_id: str) -> None:
        assert self._index is not None
        try:
            await self._index.remove_worker(worker_id)
        except IndexUnavailable:
            pass  # a restarted index does not know the worker either


def _tier_counts(tiers: dict[str, TierOverlap]) -> dict[str, tuple[int, int, int]]:
    """Leading (device, host, disk) blocks per worker, for the log."""
    return {w: (t.device_blocks, t.host_blocks, t.disk_blocks) for w, t in tiers.items()}
