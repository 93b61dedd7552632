"""The engine's side of the KV tiers (tandem.tiers): blocks out on eviction, back on arrival.

    cached block freed or evicted              ->  its bytes copied out -> TierCache.offer
      (BlockPool.on_evict)                         (unless every tier has it already)
    request arrives (`park`)                   ->  tier_plan: the lower tiers' part of its
                                                   prefix, if bringing it back beats
                                                   recomputing it -> TierCache.onload
    each step (`ready`)                        <-  read and verified: the request joins the
                                                   scheduler; as it is admitted (`admit`),
                                                   the bytes go into fresh device blocks,
                                                   cached under their keys, and its lookup
                                                   finds them

A cached block goes down as soon as no request holds it (write-through: the tiers hold
what a killed worker's device cache held, and an eviction later finds it there already),
and again when evicted if a tier still lacks it (it was pushed back before).

A request waits outside the scheduler only while its blocks are read (other requests step
meanwhile), at most `max_wait_s`: then it goes on without them. Only verified bytes enter
the device cache, so a record that fails its check costs a recompute, never wrong KV.

A block's record holds every head once: a tensor-parallel worker on a CPU reads its ranks'
caches (mapped here) and writes each rank its heads back; ranks that replicate heads (MLA's
latent) share one copy.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

# modules, not their names: tandem.tiers imports tandem.engine's modules, so either may
# load first
import tandem.tiers.cache as tier_cache
import tandem.tiers.marks as tier_marks
from tandem.config import CacheConfig, EngineConfig
from tandem.engine.block_pool import Block, KVEvent, KVEventKind
from tandem.engine.kv_manager import KVCacheManager
from tandem.engine.prefix_hash import DISK_TIER, HOST_TIER
from tandem.engine.request import Request, RequestStatus
from tandem.engine.scheduler import Scheduler
from tandem.tiers import record
from tandem.tiers.stats import TierStats


class BlockIO:
    """One block's bytes out of and into the KV cache of every rank, each head once.

    `caches`: (cache, its first KV head) per rank, rank 0's first; a single-rank engine
    passes its one cache."""

    def __init__(self, caches: Sequence[tuple[torch.Tensor, int]]) -> None:
        self.caches = list(caches)
        distinct: dict[int, torch.Tensor] = {}
        for cache, first in self.caches:
            distinct.setdefault(first, cache)
        self.parts = sorted(distinct.items())  # (first head, cache), heads ascending
        one = self.caches[0][0]
        self.block_shape = list(one.shape[1:])
        self.block_shape[3] = sum(c.shape[4] for _, c in self.parts)
        self.dtype, self.device = one.dtype, one.device
        self.nbytes = self.dtype.itemsize * int(torch.Size(self.block_shape).numel())

    def read(self, block_id: int) -> tuple[torch.Tensor, Callable[[], None] | None]:
        """A copy of the block as uint8 on the CPU, and what waits for it to land."""
        blocks = [cache[block_id] for _, cache in self.parts]
        if self.device.type == "cpu":
            whole = blocks[0].clone() if len(blocks) == 1 else torch.cat(blocks, dim=3)
            return whole.view(torch.uint8).reshape(-1), None
        host = torch.empty(self.block_shape, dtype=self.dtype, device="cpu", pin_memory=True)
        host.copy_(blocks[0], non_blocking=True)  # one rank on a GPU (others are refused)
        done = torch.cuda.Event()
        done.record()
        return host.view(torch.uint8).reshape(-1), done.synchronize

    def write(self, block_id: int, payload: torch.Tensor) -> None:
        """Put a record's bytes into the block, each rank its heads."""
        whole = payload.view(self.dtype).view(self.block_shape)
        for cache, first in self.caches:
            heads = cache.shape[4]
            cache[block_id].copy_(whole[:, :, :, first : first + heads], non_blocking=True)


def tier_identity(engine_fields: Mapping[str, object], model_dir: Path) -> bytes:
    """The identity of an engine's records: its fields plus digests of the model's config
    and tokenizer files (tandem.tiers.record.identity)."""
    files = {}
    for name in ("config.json", "tokenizer.json"):
        path = model_dir / name
        data = path.read_bytes() if path.is_file() else b""
        files[name] = hashlib.blake2b(data, digest_size=16).hexdigest()
    return record.identity({**engine_fields, **files})


@dataclass(slots=True)
class _Parked:
    request: Request
    job: tier_cache.Onload
    plan: list[tuple[int, int, int, bool]]  # (key, tier, table, the device lacks it)
    since: float


class EngineTiers:
    """The tiers of one engine's KV manager; every method runs on the engine thread."""

    def __init__(
        self,
        cache: CacheConfig,
        kv: KVCacheManager,
        scheduler: Scheduler,
        io: BlockIO,
        ident: bytes,
        max_wait_s: float = 2.0,
    ) -> None:
        self.kv, self.io = kv, io
        self.tiers = tier_cache.TierCache(
            ident, io.nbytes, cache.kv_host_bytes, cache.kv_disk_dir, cache.kv_disk_bytes
        )
        self.max_wait_s = max_wait_s
        self.paused = False  # warm-up: nothing goes down
        self.prefill_tokens_per_s = 0.0  # the engine's, for `pays`
        # bytes of one logical block across its tables: a prefix token's share of the tiers
        self.bytes_per_token = io.nbytes * kv.num_tables / kv.block_size
        self._parked: dict[str, _Parked] = {}  # blocks being read
        self._staged: dict[str, _Parked] = {}  # read, waiting to be admitted
        self._marks: tier_marks.TierMarks | None = None  # while the index hears of changes
        kv.pool.on_evict = self._evicted
        scheduler.before_admit = self.admit

    # -- down --------------------------------------------------------------------------------

    def _evicted(self, block: Block) -> None:
        assert block.block_hash is not None
        if self.paused or not self.tiers.wants(block.block_hash):
            return
        payload, ready = self.io.read(block.block_id)
        flags = record.FLAG_PUBLISHED if block.published else 0
        self.tiers.offer(block.block_hash, flags, payload, ready)

    # -- back up -----------------------------------------------------------------------------

    def onload_tokens_per_s(self, tier: int) -> float:
        return self.tiers.onload_rate(tier) / self.bytes_per_token

    def pays(self, tier: int) -> bool:
        """Does bringing a block back from `tier` beat recomputing it? (Yes while the
        engine's prefill rate is unknown.)"""
        rate = self.onload_tokens_per_s(tier)
        return rate > 0 and rate > self.prefill_tokens_per_s

    def park(self, request: Request) -> bool:
        """Start bringing back the blocks lower tiers add to the request's cached prefix,
        when they do and it pays; True: the request waits here (`ready`) meanwhile."""
        paying = {t for t in (HOST_TIER, DISK_TIER) if self.pays(t)}
        if not paying:
            return False

        def tier_of(key: int) -> int | None:
            tier = self.tiers.tier_of(key)
            return tier if tier in paying else None

        plan, _ = self.kv.tier_plan(request, tier_of)
        if not plan:
            return False
        spare = {key for key, _, _, needed in plan if not needed}
        job = self.tiers.onload([key for key, _, _, _ in plan], spare)
        self._parked[request.request_id] = _Parked(request, job, plan, time.monotonic())
        return True

    @property
    def num_parked(self) -> int:
        return len(self._parked)

    def wait(self, timeout: float) -> None:
        """Block until a parked request's blocks are read, or `timeout` seconds."""
        for parked in list(self._parked.values())[:1]:
            parked.job.done.wait(timeout)

    def ready(self) -> list[Request]:
        """Parked requests whose blocks are read (staged: `admit` puts them into the cache
        as the scheduler admits the request) or that waited too long (they go without)."""
        for rid, staged in list(self._staged.items()):
            if staged.request.status is not RequestStatus.WAITING:  # admitted, or gone
                del self._staged[rid]
        now, out = time.monotonic(), []
        for rid, parked in list(self._parked.items()):
            if parked.job.done.is_set():
                self._staged[rid] = parked
            elif now - parked.since < self.max_wait_s:
                continue
            parked.job.cancelled = True
            del self._parked[rid]
            out.append(parked.request)
        return out

    def admit(self, request: Request) -> None:
        """The scheduler is about to look up `request`'s prefix (`Scheduler.before_admit`):
        its staged blocks go into the device cache now, where nothing can evict them before
        the lookup takes them. They stay staged until the request is admitted (an attempt
        that finds too few free blocks is retried, and its blocks may be evicted by then)."""
        staged = self._staged.get(request.request_id)
        if staged is not None:
            self._install(staged)

    def abort(self, request_id: str) -> Request | None:
        self._staged.pop(request_id, None)
        parked = self._parked.pop(request_id, None)
        if parked is None:
            return None
        parked.job.cancelled = True
        return parked.request

    def _install(self, parked: _Parked) -> None:
        """Verified records into free device blocks, cached under their keys (and free:
        the request's lookup takes them as prefix hits). Every block of the prefix is held
        until the end, so that a block taken here never evicts the device's part of the
        prefix or a block just installed (either would be the first to go); what does not
        fit stays staged for the next attempt."""
        pool, tokens = self.kv.pool, {HOST_TIER: 0, DISK_TIER: 0}
        held = [b for b in self.kv.get_computed_blocks(parked.request)[0] if b >= 0]
        pool.touch(held)
        try:
            for key, _, table, _ in parked.plan:
                if pool.get_cached_block(key) is not None:
                    continue
                payload = parked.job.payloads.get(key)
                if payload is None:
                    break  # not read or not verified: the prefix stops here
                ids = pool.allocate(1)
                if ids is None:
                    break
                held += ids
                self.io.write(ids[0], payload)
                pool.cache_block(ids[0], key, bool(parked.job.flags[key] & record.FLAG_PUBLISHED))
                if table == 0:
                    tokens[parked.job.tiers[key]] += self.kv.block_size
        finally:
            pool.free(reversed(held))  # the prefix's end is evicted first, as always
        for tier, n in tokens.items():
            if n:
                self.tiers.count_hits(tier, n)

    # -- what the index hears ------------------------------------------------------------

    def enable_events(self, device_hashes: list[int]) -> None:
        """Track the tier marks from now on, starting from what the tiers hold (a change
        between the snapshot and the first `events` is applied twice, which marks allow)."""
        self.tiers.record_changes = True
        self.tiers.take_changes()  # from before: the snapshot below has them
        self._marks = tier_marks.TierMarks()
        self._marks.reset(self._held(device_hashes))

    def events(self, device: list[KVEvent]) -> list[KVEvent]:
        """The device's events followed by the tier marks they and the tiers changed."""
        if self._marks is None:
            return device
        out = list(device)
        for ev in device:
            out += self._marks.change(
                ev.block_hash, tier_marks.DEVICE, ev.kind is KVEventKind.STORED
            )
        for key, tier, held, flags in self.tiers.take_changes():
            if held and not flags & record.FLAG_PUBLISHED:
                continue
            out += self._marks.change(key, tier, held)
        return out

    def mark_hashes(self, device_hashes: list[int]) -> list[int]:
        """The tier marks a snapshot names, given what the device holds."""
        marks = tier_marks.TierMarks()
        marks.reset(self._held(device_hashes))
        return marks.hashes()

    def _held(self, device_hashes: list[int]) -> list[tuple[int, int]]:
        """(key, tier) of every published block the device and the tiers hold."""
        held = [(h, tier_marks.DEVICE) for h in device_hashes]
        held += [(key, tier) for key, tier, flags in self.tiers.held()
                 if flags & record.FLAG_PUBLISHED]  # fmt: skip
        return held

    def stats(self) -> list[TierStats]:
        return self.tiers.stats()

    def load_counts(self) -> dict[str, int]:
        """The tiers' counts a worker's `Load` carries (tandem.load): the verified blocks each
        tier holds now, and the prompt tokens all of them have served since start."""
        stats = self.tiers.stats()
        blocks = {s.tier: s.blocks for s in stats}
        return {
            "host_tier_blocks": blocks.get("host", 0),
            "disk_tier_blocks": blocks.get("disk", 0),
            "tier_hit_tokens": sum(s.hit_tokens for s in stats),
        }

    def close(self) -> None:
        for rid in list(self._parked):
            self.abort(rid)
        self.tiers.close()


def make_tiers(
    config: EngineConfig,
    kv: KVCacheManager,
    scheduler: Scheduler,
    caches: Sequence[tuple[torch.Tensor, int]],
    model_id: str,
    kv_format: str,
    model_dir: Path,
) -> EngineTiers | None:
    """The KV tiers `config.cache` asks for over `kv` and its `caches` (every rank's, with
    its first head); None without any."""
    cache = config.cache
    if not (cache.kv_host_bytes or cache.kv_disk_bytes):
        return None
    if config.tensor_parallel_size > 1 and len(caches) < config.tensor_parallel_size:
        raise ValueError(
            "KV tiers with tensor parallelism need the ranks' caches mapped here (a CPU "
            "worker); on GPUs run them at tensor_parallel_size 1"
        )
    io = BlockIO(caches)
    fields = {"model": model_id, "dtype": str(io.dtype), "kv_format": kv_format,
              "layout": kv.layout.describe(), "block": io.block_shape}  # fmt: skip
    return EngineTiers(cache, kv, scheduler, io, tier_identity(fields, model_dir))
