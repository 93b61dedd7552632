"""In-memory `PrefixIndex`: for unit tests and single-process deployments.

State is plain dicts: per model, block hash -> set of worker ids; per worker, its model,
epoch, last seq and set of hashes (so removing a worker or replacing its set costs its own
size, not the index's). Nothing is awaited, so every method is trivially atomic on one asyncio
loop.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from tandem.index.base import (
    MAX_WORKERS_PER_MODEL,
    ApplyResult,
    EventBatch,
    IndexFull,
    PrefixIndex,
    check_hashes,
    check_marks,
    check_name,
    check_snapshot,
    resumable_counts,
)


@dataclass(slots=True)
class _Worker:
    model: str
    epoch: int
    seq: int
    blocks: set[int] = field(default_factory=set)


class MemoryPrefixIndex(PrefixIndex):
    """`PrefixIndex` held in this process; see `tandem.index.base` for the contract."""

    def __init__(self) -> None:
        self._holders: dict[str, dict[int, set[str]]] = {}  # model -> hash -> worker ids
        self._workers: dict[str, _Worker] = {}
        self._model_workers: dict[str, set[str]] = {}  # model -> worker ids, for IndexFull

    async def apply(self, batch: EventBatch) -> ApplyResult:
        if not isinstance(batch, EventBatch):
            raise ValueError(f"batch must be an EventBatch, got {type(batch).__name__}")
        w = self._workers.get(batch.worker_id)
        if w is None or w.model != batch.model:
            return ApplyResult.NEED_SNAPSHOT
        if batch.epoch < w.epoch:
            return ApplyResult.DUPLICATE  # a delayed batch of a dead incarnation
        if batch.epoch > w.epoch:
            # The worker restarted: whatever the old process cached is gone.
            self._drop(batch.worker_id)
            return ApplyResult.NEED_SNAPSHOT
        if batch.seq <= w.seq:
            return ApplyResult.DUPLICATE
        if batch.seq > w.seq + 1:
            # Keep the (slightly stale) entries until the snapshot: better than nothing.
            return ApplyResult.NEED_SNAPSHOT
        holders = self._holders[batch.model]
        for h in batch.stored:
            if h not in w.blocks:
                w.blocks.add(h)
                holders.setdefault(h, set()).add(batch.worker_id)
        for h in batch.removed:
            if h in w.blocks:
                w.blocks.discard(h)
                self._unhold(holders, h, batch.worker_id)
        w.seq = batch.seq
        return ApplyResult.APPLIED

    async def snapshot(
        self, worker_id: str, model: str, epoch: int, seq: int, hashes: Iterable[int]
    ) -> ApplyResult:
        new = set(check_snapshot(worker_id, model, epoch, seq, hashes))
        w = self._workers.get(worker_id)
        if w is not None and (epoch, seq) < (w.epoch, w.seq):
            return ApplyResult.DUPLICATE  # the index already has a newer state
        if w is None or w.model != model:
            members = self._model_workers.setdefault(model, set())
            # Check before moving the worker out of its old model: IndexFull changes nothing.
            if len(members) >= MAX_WORKERS_PER_MODEL:
                raise IndexFull(
                    f"model {model!r} already has {len(members)} workers indexed, the maximum "
                    f"is {MAX_WORKERS_PER_MODEL}; cannot add worker {worker_id!r}"
                )
            self._drop(worker_id)
            members.add(worker_id)
            w = self._workers[worker_id] = _Worker(model, epoch, seq)
        holders = self._holders.setdefault(model, {})
        # Touch only the difference, as the Redis implementation does.
        for h in w.blocks - new:
            self._unhold(holders, h, worker_id)
        for h in new - w.blocks:
            holders.setdefault(h, set()).add(worker_id)
        w.blocks = new
        w.epoch, w.seq = epoch, seq
        return ApplyResult.APPLIED

    async def lookup(
        self,
        model: str,
        chain: Sequence[int],
        marks: Sequence[int] | None = None,
        marks_from: Sequence[int] | None = None,
    ) -> dict[str, int]:
        check_name("model", model)
        chain = check_hashes("chain", chain)
        checked = check_marks(chain, marks, marks_from)
        counts = self._leading(model, chain)
        if checked is None or not counts:
            return counts
        holders = self._holders[model]
        return resumable_counts(counts, [holders.get(m, set()) for m in checked[0]], checked[1])

    def _leading(self, model: str, chain: tuple[int, ...]) -> dict[str, int]:
        holders = self._holders.get(model)
        if not holders or not chain:
            return {}
        first = holders.get(chain[0])
        if not first:
            return {}
        alive = set(first)  # workers holding every block so far
        counts: dict[str, int] = {}
        for i in range(1, len(chain)):
            held = holders.get(chain[i], set())
            for worker_id in alive - held:
                counts[worker_id] = i  # first miss at i: it holds blocks 0..i-1
            alive &= held
            if not alive:
                return counts
        for worker_id in alive:
            counts[worker_id] = len(chain)
        return counts

    async def remove_worker(self, worker_id: str) -> None:
        check_name("worker_id", worker_id)
        self._drop(worker_id)

    async def workers(self) -> dict[str, tuple[int, int]]:
        return {wid: (w.epoch, w.seq) for wid, w in self._workers.items()}

    def _drop(self, worker_id: str) -> None:
        w = self._workers.pop(worker_id, None)
        if w is None:
            return
        holders = self._holders[w.model]
        for h in w.blocks:
            self._unhold(holders, h, worker_id)
        self._model_workers[w.model].discard(worker_id)

    @staticmethod
    def _unhold(holders: dict[int, set[str]], block_hash: int, worker_id: str) -> None:
        ids = holders.get(block_hash)
        if ids is None:
            return
        ids.discard(worker_id)
        if not ids:
            del holders[block_hash]  # keep the map as small as the set of cached blocks
