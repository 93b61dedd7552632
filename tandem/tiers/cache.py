"""The tiers of one worker and the threads that fill and read them.

    engine thread                        tier threads
    -------------                        ------------
    device block evicted ->  offer() --> [offload queue] -> seal (digest) -> host store
      (its bytes copied first)                                   \\-> [disk queue] -> disk file
    request arrives      ->  onload() -> [onload queue]  -> read, verify -> Onload.payloads
    each step            <-  take_changes(): what became visible or went (for the index)

The engine thread only copies a block out (the device cache's bytes, before the block is
reused) and queues it: digests, memory and disk writes, reads and verification run on the
tier threads. A full queue pushes back: the block is not offered to that tier (counted as a
skipped offload), so a slow disk never stalls the engine, and never starves the host tier
(the disk has its own thread and queue). A record is visible (`tier_of`, `take_changes`)
only once it is complete in its tier (tandem.tiers.stores).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TypeVar

import torch

from tandem.engine.prefix_hash import DISK_TIER, HOST_TIER
from tandem.tiers import record
from tandem.tiers.stats import TierStats
from tandem.tiers.stores import DiskStore, HostEntry, HostStore

log = logging.getLogger(__name__)
T = TypeVar("T")
# A tier's onload rate starts from its probe and then follows what onloads measure.
RATE_EWMA = 0.3


def view_bytes(t: torch.Tensor) -> memoryview:
    """A contiguous CPU uint8 tensor's bytes, without a copy."""
    return memoryview(t.numpy())  # type: ignore[arg-type]


@dataclass(slots=True)
class Onload:
    """Blocks to bring back, in prefix order; filled by the tier thread. `payloads`: the
    verified bytes of the leading keys read (reading stops at the first that fails)."""

    keys: list[int]
    spare: set[int] = field(default_factory=set)  # keys whose miss does not stop the job
    payloads: dict[int, torch.Tensor] = field(default_factory=dict)
    flags: dict[int, int] = field(default_factory=dict)  # key -> its record's flags
    tiers: dict[int, int] = field(default_factory=dict)  # key -> the tier that served it
    done: threading.Event = field(default_factory=threading.Event)
    cancelled: bool = False


@dataclass(slots=True)
class _Offload:
    key: int
    flags: int
    payload: torch.Tensor  # uint8 on the CPU
    ready: Callable[[], None] | None  # waits for the copy into `payload` (a CUDA event)


class TierCache:
    """A host tier (`host_bytes` > 0) and a disk tier (`disk_dir`, `disk_bytes` > 0) of
    records of `block_bytes` bytes under identity `ident` (tandem.tiers.record)."""

    def __init__(
        self,
        ident: bytes,
        block_bytes: int,
        host_bytes: int = 0,
        disk_dir: str = "",
        disk_bytes: int = 0,
        max_pending: int = 64,
    ) -> None:
        self.ident = ident
        self.block_bytes = block_bytes
        self.max_pending = max_pending
        self.host = HostStore(host_bytes) if host_bytes > 0 else None
        self.disk = DiskStore(disk_dir, disk_bytes, ident) if disk_bytes > 0 else None
        self._stats: dict[int, TierStats] = {}
        if self.host is not None:
            self._stats[HOST_TIER] = TierStats("host", host_bytes)
        if self.disk is not None:
            self._stats[DISK_TIER] = TierStats("disk", disk_bytes)
        self._rates: dict[int, float] = {}  # tier -> onload bytes per second
        self._lock = threading.Lock()  # stats, rates, changes
        self._changes: list[tuple[int, int, bool, int]] = []  # key, tier, present, flags
        self.record_changes = False  # kept for `take_changes` only once someone takes them
        self._cv = threading.Condition()
        self._offloads: deque[_Offload] = deque()
        self._disk_writes: deque[tuple[int, record.Header, torch.Tensor]] = deque()
        self._onloads: deque[Onload] = deque()
        self._closing = False
        self._busy = 0  # tier threads between taking work and finishing it (`drain`)
        if self.host is not None:
            self._probe_host()
        self._threads = [
            threading.Thread(target=fn, name=f"tandem-kv-{name}", daemon=True)
            for name, fn in (("offload", self._offload_loop), ("onload", self._onload_loop))
        ]
        if self.disk is not None:
            self._threads.append(
                threading.Thread(target=self._disk_loop, name="tandem-kv-disk", daemon=True)
            )
        for t in self._threads:
            t.start()

    # -- the engine thread ---------------------------------------------------------------

    def tier_of(self, key: int) -> int | None:
        """The fastest tier holding a visible record of `key`; None: none does."""
        if self.host is not None and key in self.host:
            return HOST_TIER
        if self.disk is not None and key in self.disk:
            return DISK_TIER
        return None

    def wants(self, key: int) -> bool:
        """Would a tier take `key` now (some tier lacks it and the queue has room)? A
        False for want of room counts as a skipped offload."""
        lacking = [
            tier for tier, store in ((HOST_TIER, self.host), (DISK_TIER, self.disk))
            if store is not None and key not in store
        ]  # fmt: skip
        if not lacking:
            return False
        if len(self._offloads) >= self.max_pending:
            self._count(lacking[0], skipped_offloads=1)
            return False
        return True

    def offer(
        self, key: int, flags: int, payload: torch.Tensor, ready: Callable[[], None] | None = None
    ) -> None:
        """Queue an evicted block's bytes (`payload`, a copy the caller made, after `wants`
        said yes) for the tiers; `ready()` waits for that copy to land."""
        with self._cv:
            self._offloads.append(_Offload(key, flags, payload, ready))
            self._cv.notify_all()

    def onload(self, keys: list[int], spare: set[int] | None = None) -> Onload:
        """Start reading and verifying `keys`' records (in order) on the tier thread; the
        job stops at the first key no tier can serve, unless it is in `spare`."""
        job = Onload(list(keys), set(spare or ()))
        with self._cv:
            self._onloads.append(job)
            self._cv.notify_all()
        return job

    def take_changes(self) -> list[tuple[int, int, bool, int]]:
        """(key, tier, now held, record flags) for each record that became visible or went
        since the last call, in order."""
        with self._lock:
            changes, self._changes = self._changes, []
        return changes

    def held(self) -> list[tuple[int, int, int]]:
        """(key, tier, flags) of every visible record now."""
        return [
            (key, tier, flags)
            for tier, store in ((HOST_TIER, self.host), (DISK_TIER, self.disk))
            if store is not None
            for key, flags in store.held()
        ]

    def onload_rate(self, tier: int) -> float:
        """Bytes per second the tier has brought back (read and verified); 0 until known."""
        with self._lock:
            return self._rates.get(tier, 0.0)

    def count_hits(self, tier: int, tokens: int) -> None:
        self._count(tier, hit_tokens=tokens)

    def stats(self) -> list[TierStats]:
        with self._lock:
            out = []
            for tier, s in sorted(self._stats.items()):
                store = self.host if tier == HOST_TIER else self.disk
                assert store is not None
                out.append(replace(s, used_bytes=store.used, blocks=len(store)))
            return out

    def close(self) -> None:
        with self._cv:
            self._closing = True
            self._cv.notify_all()
        for t in self._threads:
            t.join(timeout=10)
        if self.disk is not None:
            self.disk.close()

    def drain(self, timeout: float = 10.0) -> bool:
        """Wait until every queued offload and onload is done (tests, shutdown)."""
        deadline = time.monotonic() + timeout
        with self._cv:
            while self._offloads or self._disk_writes or self._onloads or self._busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cv.wait(left)
        return True

    # -- tier threads ----------------------------------------------------------------------

    def _take(self, queue: deque[T]) -> T | None:
        with self._cv:
            while not queue and not self._closing:
                self._cv.wait()
            if not queue:
                return None
            self._busy += 1
            return queue.popleft()

    def _done(self) -> None:
        with self._cv:
            self._busy -= 1
            self._cv.notify_all()

    def _offload_loop(self) -> None:
        while (item := self._take(self._offloads)) is not None:
            try:
                self._offload(item)
            except Exception:
                log.exception("KV tier offload failed")
            finally:
                self._done()

    def _offload(self, item: _Offload) -> None:
        t0 = time.perf_counter()
        if item.ready is not None:
            item.ready()
        view = view_bytes(item.payload)
        header = record.seal(self.ident, item.key, item.flags, view)
        if self.host is not None and item.key not in self.host:
            evicted = self.host.put(item.key, HostEntry(item.payload, item.flags, header.digest))
            if evicted is not None:
                self._visible(HOST_TIER, item.key, item.flags, evicted)
                self._count(HOST_TIER, offload_bytes=len(view), evictions=len(evicted),
                            offload_seconds=time.perf_counter() - t0)  # fmt: skip
        if self.disk is not None and item.key not in self.disk:
            with self._cv:
                if len(self._disk_writes) >= self.max_pending:
                    skipped = True
                else:
                    skipped = False
                    self._disk_writes.append((item.key, header, item.payload))
                    self._cv.notify_all()
            if skipped:
                self._count(DISK_TIER, skipped_offloads=1)

    def _disk_loop(self) -> None:
        assert self.disk is not None
        with self._cv:
            self._busy += 1
        try:
            self._probe_disk()
            self._scan()
        finally:
            self._done()
        while (item := self._take(self._disk_writes)) is not None:
            try:
                key, header, payload = item
                t0 = time.perf_counter()
                try:
                    evicted = self.disk.put(key, header, view_bytes(payload))
                except OSError as exc:
                    log.warning("KV disk tier: writing block %016x failed: %s", key, exc)
                    self._count(DISK_TIER, failed_writes=1)
                    continue
                if evicted is not None:
                    self._visible(DISK_TIER, key, header.flags, evicted)
                    self._count(DISK_TIER, offload_bytes=header.payload_bytes,
                                offload_seconds=time.perf_counter() - t0,
                                evictions=len(evicted))  # fmt: skip
            except Exception:
                log.exception("KV disk tier write failed")
            finally:
                self._done()

    def _scan(self) -> None:
        """A restarted worker's disk records: verified, then visible again."""
        assert self.disk is not None
        t0, admitted = time.perf_counter(), 0
        for key, flags, why in self.disk.scan():
            if why:
                self._count(DISK_TIER, digest_mismatches=1)
                log.warning("KV disk tier: dropped block %016x at start: %s", key, why)
                continue
            admitted += 1
            self._visible(DISK_TIER, key, flags, [])
        if admitted:
            log.info("KV disk tier %s: %d blocks verified in %.1fs and served again",
                     self.disk.dir, admitted, time.perf_counter() - t0)  # fmt: skip

    def _probe_host(self) -> None:
        """A first host onload rate: verifying one block's digest (the copy back is the
        engine's, and faster)."""
        probe = torch.zeros(self.block_bytes, dtype=torch.uint8, device="cpu")
        view = view_bytes(probe)
        t0 = time.perf_counter()
        record.digest(self.ident, 0, 0, view)
        self._observe_rate(HOST_TIER, self.block_bytes, time.perf_counter() - t0)

    def _probe_disk(self) -> None:
        """A first disk onload rate: one block's record written, read back and verified."""
        assert self.disk is not None
        probe = self.disk.dir / ".probe.tmp"
        payload = memoryview(bytes(self.block_bytes))
        header = record.seal(self.ident, 0, 0, payload)
        try:
            self.disk._write(probe, header.pack(), payload)
            t0 = time.perf_counter()
            raw = probe.read_bytes()
            record.check(header, self.ident, memoryview(raw)[record.HEADER_BYTES :])
            self._observe_rate(DISK_TIER, self.block_bytes, time.perf_counter() - t0)
        except OSError as exc:
            log.warning("KV disk tier %s: probe failed: %s", self.disk.dir, exc)
        finally:
            probe.unlink(missing_ok=True)

    def _onload_loop(self) -> None:
        while (job := self._take(self._onloads)) is not None:
            try:
                if not job.cancelled:
                    self._read(job)
            except Exception:
                log.exception("KV tier onload failed")
            finally:
                job.done.set()
                self._done()

    def _read(self, job: Onload) -> None:
        """Each key from the fastest tier whose record checks out (a bad host record falls
        back to the disk's); the job stops at the first key no tier can serve."""
        for key in job.keys:
            for tier in (HOST_TIER, DISK_TIER):
                t0 = time.perf_counter()
                got = self._read_one(tier, key)
                if got is not None:
                    payload, flags = got
                    seconds = time.perf_counter() - t0
                    self._count(tier, onload_bytes=payload.numel(), onload_seconds=seconds)
                    self._observe_rate(tier, payload.numel(), seconds)
                    job.payloads[key], job.flags[key], job.tiers[key] = payload, flags, tier
                    break
            else:
                if key not in job.spare:
                    return

    def _read_one(self, tier: int, key: int) -> tuple[torch.Tensor, int] | None:
        """`key`'s verified bytes and flags from `tier`; None when it holds no good record
        (a bad one is dropped, counted and logged)."""
        why = ""
        if tier == HOST_TIER and self.host is not None and key in self.host:
            entry = self.host.get(key)
            if entry is None:
                return None
            if (
                record.digest(self.ident, key, entry.flags, view_bytes(entry.payload))
                == entry.digest
            ):
                return entry.payload, entry.flags
            why = "its bytes do not match their digest"
            self.host.drop(key)
        elif tier == DISK_TIER and self.disk is not None and key in self.disk:
            raw, flags, why = self.disk.read(key)
            if not why:
                return raw, flags
            if why == "not held":
                return None
        else:
            return None
        self._visible(tier, key, 0, [], gone=True)
        self._count(tier, digest_mismatches=1)
        log.warning("KV tier %s: block %016x not served: %s", self._stats[tier].tier, key, why)
        return None

    # -- bookkeeping -----------------------------------------------------------------------

    def _visible(
        self, tier: int, key: int, flags: int, evicted: list[int], gone: bool = False
    ) -> None:
        if not self.record_changes:
            return
        with self._lock:
            self._changes.append((key, tier, not gone, flags))
            self._changes += [(old, tier, False, 0) for old in evicted]

    def _count(self, tier: int, **add: float) -> None:
        with self._lock:
            s = self._stats.get(tier)
            if s is not None:
                self._stats[tier] = replace(s, **{k: getattr(s, k) + v for k, v in add.items()})

    def _observe_rate(self, tier: int, nbytes: int, seconds: float) -> None:
        rate = nbytes / max(seconds, 1e-9)
        with self._lock:
            old = self._rates.get(tier)
            self._rates[tier] = rate if old is None else old + RATE_EWMA * (rate - old)
