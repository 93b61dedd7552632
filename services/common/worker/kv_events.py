"""A worker's side of the prefix index: publish prefix-cache changes, one batch per step.

engine thread (hook, every loop turn)      asyncio loop (publisher task)
  events = engine.take_kv_events()  --->   pending += events (tagged with a generation)
                                           one EventBatch for everything pending
                                           (at most one round trip in flight: a slow
                                           index merges steps instead of queueing them)
  NEED_SNAPSHOT / index was unreachable ->
    engine thread: (all cached hashes, generation) captured atomically between steps
    index.snapshot(...); pending events from that generation or older are dropped
"""

from __future__ import annotations

import asyncio
import logging

from tandem.engine.engine import LLMEngine
from tandem.index import ApplyResult, EventBatch, IndexFull, IndexUnavailable, PrefixIndex
from tandem.services.common.runtime.process import cancel_and_wait
from tandem.services.common.worker.engine_loop import EngineLoop

log = logging.getLogger(__name__)


class KVEventPublisher:
    def __init__(
        self,
        index: PrefixIndex,
        engine_loop: EngineLoop,
        worker_id: str,
        model: str,
        epoch: int,
        retry_s: float = 1.0,
        keepalive_s: float = 1.0,
    ) -> None:
        self.index = index
        self.engine_loop = engine_loop
        self.worker_id = worker_id
        self.model = model
        self.epoch = epoch
        self.retry_s = retry_s
        self.keepalive_s = keepalive_s
        self.seq = 0
        self.num_snapshots = 0
        self.num_batches = 0
        self._generation = 0  # engine thread: +1 per hook call that found events
        self._pending: list[tuple[int, str, int]] = []  # (generation, kind, hash)
        self._wake = asyncio.Event()
        self._need_snapshot = True  # first contact: tell the index everything we hold
        self._task: asyncio.Task[None] | None = None
        self._warned = False

    def start(self) -> None:
        self.engine_loop.engine.enable_kv_events()
        self.engine_loop.add_hook(self._collect)
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        await cancel_and_wait(self._task)

    # engine thread
    def _collect(self, engine: LLMEngine) -> None:
        events = engine.take_kv_events()
        if not events:
            return
        self._generation += 1
        tagged = [(self._generation, e.kind.value, e.block_hash) for e in events]
        self.engine_loop.loop.call_soon_threadsafe(self._push, tagged)

    # asyncio loop
    def _push(self, tagged: list[tuple[int, str, int]]) -> None:
        self._pending.extend(tagged)
        self._wake.set()

    async def _run(self) -> None:
        while True:
            if not self._need_snapshot and not self._pending:
                # An idle worker still checks in: an empty batch is how it learns that the
                # index lost its state (e.g. Redis restarted) and needs a snapshot.
                try:
                    await asyncio.wait_for(self._wake.wait(), self.keepalive_s)
                except TimeoutError:
                    pass
            self._wake.clear()
            try:
                if self._need_snapshot:
                    await self._snapshot()
                else:
                    await self._publish()
                if self._warned:
                    log.info("prefix index reachable again")
                    self._warned = False
            except IndexFull as exc:
                # A 65th worker for one model: routers cannot see this cache, but serving
                # goes on; retry rarely in case a slot frees up.
                log.error("prefix index has no slot for %s (%s)", self.worker_id, exc)
                self._need_snapshot = True
                await asyncio.sleep(30 * self.retry_s)
            except IndexUnavailable as exc:
                if not self._warned:
                    log.warning("prefix index unreachable (%s); will resync when it returns", exc)
                    self._warned = True
                self._need_snapshot = True  # whatever happened meanwhile, resync in full
                await asyncio.sleep(self.retry_s)

    async def _publish(self) -> None:
        pending, self._pending = self._pending, []
        self.seq += 1
        batch = EventBatch.from_events(
            self.worker_id, self.model, self.epoch, self.seq, [(k, h) for _, k, h in pending]
        )
        result = await self.index.apply(batch)
        self.num_batches += 1
        if result == ApplyResult.NEED_SNAPSHOT:
            self._need_snapshot = True

    async def _snapshot(self) -> None:
        def capture(engine: LLMEngine) -> tuple[list[int], int]:
            # Between steps: the hashes reflect exactly the events up to this generation.
            self._collect(engine)
            return engine.cached_block_hashes(), self._generation

        hashes, generation = await self.engine_loop.call(capture)
        self.seq += 1
        await self.index.snapshot(self.worker_id, self.model, self.epoch, self.seq, hashes)
        # Events the snapshot already reflects must not be replayed on top of it.
        self._pending = [p for p in self._pending if p[0] > generation]
        self._need_snapshot = False
        self.num_snapshots += 1
