"""The `PrefixIndex` contract, run against every implementation: in-memory, and Redis with
lookups through its lean MGET client (the default) or through redis-py.

Each test body is an async function taking a fresh, empty index; `check` creates the index
inside the test's own event loop (the Redis client binds to it) and closes it afterwards. The
Redis flavour runs on the session's shared server with its keyspace flushed per test; tests
that restart or kill Redis start their own server.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field

import pytest
import redis

from tandem.index import (
    MAX_WORKERS_PER_MODEL,
    ApplyResult,
    EventBatch,
    IndexFull,
    IndexUnavailable,
    MemoryPrefixIndex,
    PrefixIndex,
)
from tandem.index.base import leading_counts_reference
from tandem.services.common.redis.index import RedisPrefixIndex, _leading_counts
from tandem.services.common.redis.resp import encode_command, parse_reply
from tandem.services.common.redis.server import RedisServer
from tests.services.processes import free_port

APPLIED, DUPLICATE, NEED_SNAPSHOT = (
    ApplyResult.APPLIED,
    ApplyResult.DUPLICATE,
    ApplyResult.NEED_SNAPSHOT,
)
Body = Callable[[PrefixIndex], Awaitable[None]]
Check = Callable[[Body], None]


@pytest.fixture(params=["memory", "redis", "redis-py-lookup"])
def check(request: pytest.FixtureRequest) -> Iterator[Check]:
    """Runs a test body against a fresh index of the parametrized kind: in-memory, Redis
    with its lean lookup client (the default), or Redis with lookups through redis-py."""
    if request.param == "memory":
        make: Callable[[], PrefixIndex] = MemoryPrefixIndex
    else:
        url: str = request.getfixturevalue("redis_url")
        fast = request.param == "redis"

        def make() -> PrefixIndex:
            index = RedisPrefixIndex(url, fast_lookup=fast)
            assert index.fast_lookup is fast
            return index

    yield runner(make)


def runner(make: Callable[[], PrefixIndex]) -> Check:
    """Runs a test body against a fresh index from `make`, closed afterwards."""

    def run(body: Body) -> None:
        async def main() -> None:
            index = make()
            try:
                await body(index)
            finally:
                await index.close()

        asyncio.run(main())

    return run


async def _join(index: PrefixIndex, worker: str, hashes: list[int], model: str = "m") -> None:
    """First contact: a worker's first batch asks for a snapshot, which it sends."""
    assert await index.apply(EventBatch(worker, model, 1, 1, tuple(hashes))) is NEED_SNAPSHOT
    assert await index.snapshot(worker, model, 1, 1, hashes) is APPLIED


# -- events -> index -> lookup ------------------------------------------------------------


def test_lookup_counts_leading_blocks_and_stops_at_first_miss(check: Check) -> None:
    async def body(index: PrefixIndex) -> None:
        await _join(index, "a", [10, 11, 12, 13])
        await _join(index, "b", [10, 11, 13])  # holds block 3 but misses block 2
        await _join(index, "c", [11, 12, 13])  # misses block 0: nothing counts
        chain = [10, 11, 12, 13, 14]
        assert await index.lookup("m", chain) == {"a": 4, "b": 2}
        assert await index.lookup("m", chain[:1]) == {"a": 1, "b": 1}
        assert await index.lookup("m", [14, 10]) == {}
        assert await index.lookup("m", []) == {}
        assert await index.lookup("unknown-model", chain) == {}

        # Batches move the counts: b gains block 2, a loses block 1.
        assert await index.apply(EventBatch("b", "m", 1, 2, stored=(12,))) is APPLIED
        assert await index.apply(EventBatch("a", "m", 1, 2, removed=(11,))) is APPLIED
        assert await index.lookup("m", chain) == {"a": 1, "b": 4}
        assert await index.workers() == {"a": (1, 2), "b": (1, 2), "c": (1, 1)}

    check(body)


def test_lookup_with_marks_stops_where_a_worker_can_resume(check: Check) -> None:
    """A model that resumes a prefix only where it also holds a state (linear attention):
    each count is cut back to the last block whose mark the worker holds, a worker holding
    pages but no mark is a miss, and a mark without its pages counts for nothing."""

    async def body(index: PrefixIndex) -> None:
        await _join(index, "a", [10, 11, 12, 13, 20, 22])  # resumes after blocks 0 and 2
        await _join(index, "b", [10, 11, 21, 23])  # a mark past its pages (23) is no use
        await _join(index, "c", [10, 11, 12, 13])  # pages, no state
        chain, marks = [10, 11, 12, 13], [20, 21, 22, 23]
        assert await index.lookup("m", chain) == {"a": 4, "b": 2, "c": 4}
        assert await index.lookup("m", chain, marks) == {"a": 3, "b": 2}
        assert await index.lookup("m", chain[:2], marks[:2]) == {"a": 1, "b": 2}
        assert await index.apply(EventBatch("a", "m", 1, 2, removed=(22,))) is APPLIED
        assert await index.lookup("m", chain, marks) == {"a": 1, "b": 2}
        with pytest.raises(ValueError, match="marks must have one hash per block"):
            await index.lookup("m", chain, marks[:3])

    check(body)


def test_lookup_with_marks_from_needs_every_mark_the_window_reads(check: Check) -> None:
    """A sliding-window model: marks are a sliding table's keys, and a count n needs those of
    blocks [marks_from[n - 1], n), the blocks the next token's window reads (here window 8,
    blocks of 4: the last two blocks). A key missing inside that range cuts the count back;
    one missing before it (fallen out of the window, freed) does not."""

    async def body(index: PrefixIndex) -> None:
        chain, keys = [10, 11, 12, 13, 14, 15], [20, 21, 22, 23, 24, 25]
        window = [0, 0, 1, 2, 3, 4]
        await _join(index, "all", chain + keys)
        await _join(index, "gap", chain + [20, 21, 22, 23, 25])  # lacks block 4's key
        await _join(index, "slid", chain + [24, 25])  # blocks 0-3 fell out of the window
        await _join(index, "short", chain[:3] + [21, 22])  # block 0 out of the window at 3
        await _join(index, "last", chain + [25])  # only the last block's key
        assert await index.lookup("m", chain, keys, window) == {
            "all": 6, "gap": 4, "slid": 6, "short": 3
        }  # fmt: skip
        # mark n - 1 alone (no marks_from, or its default spelled out): no gap matters
        default = {"all": 6, "gap": 6, "slid": 6, "short": 3, "last": 6}
        assert await index.lookup("m", chain, keys) == default
        assert await index.lookup("m", chain, keys, range(6)) == default
        # every key from block 0: a worker that freed out-of-window pages is cut back
        assert await index.lookup("m", chain, keys, [0] * 6) == {"all": 6, "gap": 4}
        # a shorter prompt's window: blocks [1, 3) for 3 blocks
        assert await index.lookup("m", chain[:3], keys[:3], window[:3]) == {
            "all": 3, "gap": 3, "short": 3
        }  # fmt: skip
        # a batch that frees an in-window key moves the count back; storing it restores it
        assert await index.apply(EventBatch("all", "m", 1, 2, removed=(25,))) is APPLIED
        assert (await index.lookup("m", chain, keys, window))["all"] == 5
        assert await index.apply(EventBatch("all", "m", 1, 3, stored=(25,))) is APPLIED
        assert (await index.lookup("m", chain, keys, window))["all"] == 6

    check(body)


def test_models_are_isolated(check: Check) -> None:
    async def body(index: PrefixIndex) -> None:
        await _join(index, "a", [1, 2], model="llama")
        await _join(index, "b", [1, 2, 3], model="qwen")
        assert await index.lookup("llama", [1, 2, 3]) == {"a": 2}
        assert await index.lookup("qwen", [1, 2, 3]) == {"b": 3}
        # A batch naming the wrong model is not applied to either.
        assert await index.apply(EventBatch("a", "qwen", 1, 2, stored=(1,))) is NEED_SNAPSHOT
        assert await index.lookup("qwen", [1]) == {"b": 1}

    check(body)


def test_store_and_remove_are_idempotent_per_block(check: Check) -> None:
    async def body(index: PrefixIndex) -> None:
        await _join(index, "a", [1, 2])
        await _join(index, "b", [1])
        # Storing a held block, removing one not held, and repeats within a tuple: no-ops.
        batch = EventBatch("a", "m", 1, 2, stored=(1, 3, 3), removed=(7, 7))
        assert await index.apply(batch) is APPLIED
        assert await index.lookup("m", [1, 2, 3]) == {"a": 3, "b": 1}
        assert await index.apply(EventBatch("a", "m", 1, 3, removed=(1,))) is APPLIED
        assert await index.lookup("m", [1, 2, 3]) == {"b": 1}
        # An empty batch only advances seq.
        assert await index.apply(EventBatch("a", "m", 1, 4)) is APPLIED
        assert (await index.workers())["a"] == (1, 4)

    check(body)


def test_from_events_batch_applies_net_changes(check: Check) -> None:
    async def body(index: PrefixIndex) -> None:
        await _join(index, "a", [1, 2])
        events = [("stored", 3), ("removed", 3), ("removed", 2), ("stored", 2), ("removed", 1)]
        batch = EventBatch.from_events("a", "m", 1, 2, events)
        assert await index.apply(batch) is APPLIED
        assert await index.lookup("m", [2]) == {"a": 1}
        assert await index.lookup("m", [1]) == {}
        assert await index.lookup("m", [3]) == {}

    check(body)


# -- sequence numbers, snapshots, epochs ---------------------------------------------------


def test_duplicate_batch_is_ignored(check: Check) -> None:
    async def body(index: PrefixIndex) -> None:
        await _join(index, "a", [1])
        batch = EventBatch("a", "m", 1, 2, stored=(2,))
        assert await index.apply(batch) is APPLIED
        assert await index.apply(EventBatch("a", "m", 1, 3, removed=(2,))) is APPLIED
        # Resending seq 2 (or anything older) must not store block 2 again.
        assert await index.apply(batch) is DUPLICATE
        assert await index.apply(EventBatch("a", "m", 1, 1, stored=(5,))) is DUPLICATE
        assert await index.lookup("m", [1, 2]) == {"a": 1}
        assert await index.lookup("m", [5]) == {}
        assert await index.workers() == {"a": (1, 3)}

    check(body)


def test_gap_needs_snapshot_and_snapshot_makes_it_consistent(check: Check) -> None:
    async def body(index: PrefixIndex) -> None:
        await _join(index, "a", [1, 2])
        # Batch 2 (storing 3) is lost; batch 3 removes 2 and stores 4.
        assert await index.apply(EventBatch("a", "m", 1, 3, (4,), (2,))) is NEED_SNAPSHOT
        # Nothing applied; the old entries stay until the snapshot.
        assert await index.lookup("m", [1, 2]) == {"a": 2}
        assert await index.workers() == {"a": (1, 1)}
        # The worker answers with its whole set as of batch 3 and continues with 4.
        assert await index.snapshot("a", "m", 1, 3, [1, 3, 4]) is APPLIED
        assert await index.lookup("m", [1, 2]) == {"a": 1}
        assert await index.lookup("m", [1, 3, 4]) == {"a": 3}
        assert await index.apply(EventBatch("a", "m", 1, 4, removed=(4,))) is APPLIED
        assert await index.lookup("m", [1, 3, 4]) == {"a": 2}
        assert await index.workers() == {"a": (1, 4)}

    check(body)


def test_stale_snapshot_is_ignored(check: Check) -> None:
    async def body(index: PrefixIndex) -> None:
        await _join(index, "a", [1])
        assert await index.apply(EventBatch("a", "m", 1, 2, stored=(2,))) is APPLIED
        # A snapshot older than the applied batch (same epoch, smaller seq), or from an
        # older epoch, would roll the index back: ignored.
        assert await index.snapshot("a", "m", 1, 1, [9]) is DUPLICATE
        assert await index.snapshot("a", "m", 0, 50, [9]) is DUPLICATE
        assert await index.lookup("m", [1, 2]) == {"a": 2}
        # Re-sending the current state (same seq) is fine.
        assert await index.snapshot("a", "m", 1, 2, [1, 2, 3]) is APPLIED
        assert await index.lookup("m", [1, 2, 3]) == {"a": 3}

    check(body)


def test_unknown_worker_needs_snapshot(check: Check) -> None:
    async def body(index: PrefixIndex) -> None:
        assert await index.apply(EventBatch("new", "m", 5, 7, stored=(1,))) is NEED_SNAPSHOT
        assert await index.lookup("m", [1]) == {}
        assert await index.workers() == {}
        # A worker may also announce itself before its first batch (seq 0).
        assert await index.snapshot("new", "m", 5, 0, []) is APPLIED
        assert await index.apply(EventBatch("new", "m", 5, 1, stored=(1,))) is APPLIED
        assert await index.lookup("m", [1]) == {"new": 1}

    check(body)


def test_worker_restart_new_epoch_needs_snapshot_and_voids_old_entries(check: Check) -> None:
    async def body(index: PrefixIndex) -> None:
        await _join(index, "a", [1, 2])
        await _join(index, "b", [1])
        # The worker restarted (epoch 2): its old cache is gone, whatever seq it sends.
        assert await index.apply(EventBatch("a", "m", 2, 1, stored=(5,))) is NEED_SNAPSHOT
        assert await index.lookup("m", [1, 2]) == {"b": 1}
        assert "a" not in await index.workers()
        # A delayed batch of the dead incarnation changes nothing (and asks for nothing
        # the live one could answer wrongly: the worker is unknown until it snapshots).
        assert await index.snapshot("a", "m", 2, 1, [5]) is APPLIED
        assert await index.apply(EventBatch("a", "m", 1, 2, stored=(1,))) is DUPLICATE
        assert await index.lookup("m", [1]) == {"b": 1}
        assert await index.lookup("m", [5]) == {"a": 1}
        assert await index.workers() == {"a": (2, 1), "b": (1, 1)}

    check(body)


def test_epochs_beyond_double_precision_compare_exactly(check: Check) -> None:
    # Nanosecond timestamps exceed 2**53: epoch and epoch + 1 round to the same double.
    epoch = 2**62 + 2**40

    async def body(index: PrefixIndex) -> None:
        assert await index.snapshot("a", "m", epoch, 0, [1]) is APPLIED
        assert await index.apply(EventBatch("a", "m", epoch + 1, 1)) is NEED_SNAPSHOT
        assert await index.lookup("m", [1]) == {}
        assert await index.snapshot("a", "m", epoch + 1, 1, [2]) is APPLIED
        assert await index.apply(EventBatch("a", "m", epoch, 2, stored=(1,))) is DUPLICATE
        assert await index.workers() == {"a": (epoch + 1, 1)}
        seq = 2**53 - 2
        assert await index.snapshot("a", "m", epoch + 1, seq, [2]) is APPLIED
        assert await index.apply(EventBatch("a", "m", epoch + 1, seq + 1, (3,))) is APPLIED
        assert await index.workers() == {"a": (epoch + 1, seq + 1)}

    check(body)


def test_snapshot_under_another_model_moves_the_worker(check: Check) -> None:
    async def body(index: PrefixIndex) -> None:
        await _join(index, "a", [1, 2], model="llama")
        assert await index.snapshot("a", "qwen", 2, 0, [1]) is APPLIED
        assert await index.lookup("llama", [1]) == {}
        assert await index.lookup("qwen", [1, 2]) == {"a": 1}
        assert await index.workers() == {"a": (2, 0)}

    check(body)


def test_large_snapshot_and_replacement(check: Check) -> None:
    async def body(index: PrefixIndex) -> None:
        first = list(range(1, 5001))
        await _join(index, "a", first)
        assert await index.lookup("m", first[:256]) == {"a": 256}
        # Replace with an overlapping set: kept blocks stay, dropped ones go.
        second = list(range(2501, 8001))
        assert await index.snapshot("a", "m", 1, 2, second) is APPLIED
        assert await index.lookup("m", first[:10]) == {}
        assert await index.lookup("m", second) == {"a": len(second)}
        assert await index.snapshot("a", "m", 1, 3, []) is APPLIED
        assert await index.lookup("m", second[:5]) == {}
        assert await index.workers() == {"a": (1, 3)}

    check(body)


# -- workers come and go -------------------------------------------------------------------


def test_remove_worker_drops_its_entries(check: Check) -> None:
    async def body(index: PrefixIndex) -> None:
        await _join(index, "a", [1, 2, 3])
        await _join(index, "b", [1, 2])
        await index.remove_worker("a")
        assert await index.lookup("m", [1, 2, 3]) == {"b": 2}
        assert await index.workers() == {"b": (1, 1)}
        # It is forgotten: if it comes back, its next batch asks for a snapshot.
        assert await index.apply(EventBatch("a", "m", 1, 2, stored=(4,))) is NEED_SNAPSHOT
        await index.remove_worker("a")  # unknown: a no-op
        await index.remove_worker("never-seen")
        assert await index.lookup("m", [1, 2, 3]) == {"b": 2}

    check(body)


def test_sixty_four_workers_per_model_and_slot_reuse(check: Check) -> None:
    async def body(index: PrefixIndex) -> None:
        n = MAX_WORKERS_PER_MODEL
        chain = list(range(1000, 1000 + n))
        # Worker i holds the first i + 1 blocks, so every slot (0 and 63 included) gets its
        # own distinct count.
        for i in range(n):
            assert await index.snapshot(f"w{i}", "m", 1, 0, chain[: i + 1]) is APPLIED
        expected = {f"w{i}": i + 1 for i in range(n)}
        assert await index.lookup("m", chain) == expected

        with pytest.raises(IndexFull, match="64"):
            await index.snapshot("extra", "m", 1, 0, chain)
        assert "extra" not in await index.workers()
        assert await index.snapshot("extra", "other-model", 1, 0, chain) is APPLIED

        # A removed worker's slot is reused; its blocks do not leak to the newcomer.
        await index.remove_worker("w0")
        await index.remove_worker("w40")
        assert await index.snapshot("new", "m", 1, 0, chain[:3]) is APPLIED
        del expected["w0"], expected["w40"]
        expected["new"] = 3
        assert await index.lookup("m", chain) == expected
        assert await index.lookup("other-model", chain) == {"extra": n}

    check(body)


def test_concurrent_publishers_and_lookups(check: Check) -> None:
    async def body(index: PrefixIndex) -> None:
        workers = [f"w{i}" for i in range(16)]
        chain = list(range(1, 33))

        async def publish(worker: str) -> None:
            await _join(index, worker, [])
            for seq in range(2, 2 + len(chain)):
                batch = EventBatch(worker, "m", 1, seq, stored=(chain[seq - 2],))
                assert await index.apply(batch) is APPLIED

        async def look() -> None:
            for _ in range(20):
                counts = await index.lookup("m", chain)
                assert set(counts) <= set(workers)
                await asyncio.sleep(0)

        await asyncio.gather(*(publish(w) for w in workers), look(), look())
        assert await index.lookup("m", chain) == dict.fromkeys(workers, len(chain))

    check(body)


def test_misuse_raises_value_error_naming_the_argument(check: Check) -> None:
    async def body(index: PrefixIndex) -> None:
        with pytest.raises(ValueError, match=r"chain\[2\]"):
            await index.lookup("m", [1, 2, 2**64])
        with pytest.raises(ValueError, match="model"):
            await index.lookup("bad\nmodel", [1])
        with pytest.raises(ValueError, match="epoch"):
            await index.snapshot("w", "m", -1, 0, [])
        with pytest.raises(ValueError, match=r"hashes\[1\]"):
            await index.snapshot("w", "m", 1, 0, [1, -1])
        with pytest.raises(ValueError, match="worker_id"):
            await index.snapshot("", "m", 1, 0, [])
        with pytest.raises(ValueError, match="worker_id"):
            await index.remove_worker("a\tb")
        with pytest.raises(ValueError, match="EventBatch"):
            await index.apply(None)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="marks_from was given without marks"):
            await index.lookup("m", [1, 2], None, [0, 0])
        with pytest.raises(ValueError, match=r"marks_from must have one int per block"):
            await index.lookup("m", [1, 2], [3, 4], [0])
        with pytest.raises(ValueError, match=r"marks_from\[1\] must be an int in \[0, 1\]"):
            await index.lookup("m", [1, 2], [3, 4], [0, 2])
        with pytest.raises(ValueError, match=r"marks must have one hash per block"):
            await index.lookup("m", [], [3])  # an empty chain is checked too
        assert await index.workers() == {}

    check(body)


# -- randomized, against a plain model -----------------------------------------------------


@dataclass
class _Known:
    model: str
    epoch: int
    seq: int
    blocks: set[int] = field(default_factory=set)


class _Oracle:
    """The contract written as plainly as possible: worker -> (model, epoch, seq, set)."""

    def __init__(self) -> None:
        self.known: dict[str, _Known] = {}

    def apply(self, b: EventBatch) -> ApplyResult:
        k = self.known.get(b.worker_id)
        if k is None or k.model != b.model:
            return NEED_SNAPSHOT
        if b.epoch < k.epoch:
            return DUPLICATE
        if b.epoch > k.epoch:
            del self.known[b.worker_id]
            return NEED_SNAPSHOT
        if b.seq <= k.seq:
            return DUPLICATE
        if b.seq > k.seq + 1:
            return NEED_SNAPSHOT
        k.blocks = (k.blocks | set(b.stored)) - set(b.removed)
        k.seq = b.seq
        return APPLIED

    def snapshot(self, worker: str, model: str, epoch: int, seq: int, hashes: set[int]) -> bool:
        k = self.known.get(worker)
        if k is not None and (epoch, seq) < (k.epoch, k.seq):
            return False
        self.known[worker] = _Known(model, epoch, seq, set(hashes))
        return True

    def lookup(
        self,
        model: str,
        chain: list[int],
        marks: list[int] | None = None,
        marks_from: list[int] | None = None,
    ) -> dict[str, int]:
        holdings = {w: k.blocks for w, k in self.known.items() if k.model == model}
        return leading_counts_reference(holdings, chain, marks, marks_from)


@dataclass
class _Publisher:
    """A simulated worker: what it really caches, and where its batches are."""

    worker_id: str
    model: str
    epoch: int = 1
    seq: int = 0
    blocks: set[int] = field(default_factory=set)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_operations_match_a_plain_model(check: Check, seed: int) -> None:
    rng = random.Random(seed)
    models = ["m1", "m2"]
    # Requests share prefixes: a few base chains, each worker caching prefixes of them.
    bases = [[rng.getrandbits(64) for _ in range(12)] for _ in range(4)]
    universe = sorted({h for chain in bases for h in chain})
    pubs = [_Publisher(f"w{i}", models[i % 2]) for i in range(8)]

    def some_chain() -> list[int]:
        chain = list(rng.choice(bases))
        if rng.random() < 0.3:  # diverge somewhere: a partial hit
            chain[rng.randrange(len(chain))] = rng.getrandbits(64)
        return chain[: rng.randint(1, len(chain))]

    async def body(index: PrefixIndex) -> None:
        oracle = _Oracle()
        for step in range(300):
            p = rng.choice(pubs)
            op = rng.random()
            if op < 0.6:  # a scheduler step: net changes, sometimes lost or resent
                if rng.random() < 0.6:  # extend a cached prefix, as requests do
                    base = rng.choice(bases)
                    n = leading_counts_reference({"p": p.blocks}, base).get("p", 0)
                    stored = set(base[n : n + rng.randint(1, 3)])
                else:
                    stored = set(rng.sample(universe, rng.randint(0, 4)))
                removed = set(rng.sample(sorted(p.blocks), min(len(p.blocks), rng.randint(0, 3))))
                removed -= stored
                p.blocks = (p.blocks | stored) - removed
                p.seq += 1
                batch = EventBatch(p.worker_id, p.model, p.epoch, p.seq, tuple(stored),
                                   tuple(removed))  # fmt: skip
                fate = rng.random()
                if fate < 0.1:
                    continue  # lost in transit: the next batch meets a gap
                result = await index.apply(batch)
                assert result is oracle.apply(batch), f"step {step}: {batch}"
                if result is NEED_SNAPSHOT:
                    assert (
                        await index.snapshot(p.worker_id, p.model, p.epoch, p.seq, p.blocks)
                        is APPLIED
                    )
                    assert oracle.snapshot(p.worker_id, p.model, p.epoch, p.seq, p.blocks)
                if fate < 0.2:  # resent after it was applied
                    assert await index.apply(batch) is oracle.apply(batch) is DUPLICATE
            elif op < 0.7:  # the worker restarts with an empty cache
                p.epoch += 1
                p.seq = 0
                p.blocks = set()
            elif op < 0.77:  # the worker is declared dead (and may come back later)
                await index.remove_worker(p.worker_id)
                oracle.known.pop(p.worker_id, None)
            elif op < 0.82:  # a stale snapshot arrives late
                k = oracle.known.get(p.worker_id)
                if k is not None and k.seq > 0:
                    old = rng.sample(universe, 3)
                    result = await index.snapshot(p.worker_id, p.model, k.epoch, k.seq - 1, old)
                    assert result is DUPLICATE
            for _ in range(3):
                model = rng.choice(models)
                chain = some_chain()
                assert await index.lookup(model, chain) == oracle.lookup(model, chain), (
                    f"step {step}: lookup {model} {chain}"
                )
                marks = [rng.choice(universe) for _ in chain]  # held by some, here and there
                assert await index.lookup(model, chain, marks) == oracle.lookup(
                    model, chain, marks
                ), f"step {step}: lookup {model} {chain} marks {marks}"
                # any valid marks_from: windows, and ranges that need not grow with n
                first = [rng.randint(0, i) for i in range(len(chain))]
                assert await index.lookup(model, chain, marks, first) == oracle.lookup(
                    model, chain, marks, first
                ), f"step {step}: lookup {model} {chain} marks {marks} from {first}"
        expected = {w: (k.epoch, k.seq) for w, k in oracle.known.items()}
        assert await index.workers() == expected

    check(body)


# -- Redis only ----------------------------------------------------------------------------


def test_redis_leading_counts_decoding() -> None:
    names = ["s0", "", "s2"] + [f"s{i}" for i in range(3, 64)]
    full = b"\xff" * 8
    # SETBIT writes only as many bytes as the highest slot needs: slot 0 alone is b"\x80".
    assert _leading_counts([b"\x80", b"\x80\x00"], names) == {"s0": 2}
    # Slot 1 has a bit but no worker name (which the scripts never leave behind): skipped.
    assert _leading_counts([full, None, full], names) == {n: 1 for n in names if n}
    assert _leading_counts([b"\x00\x00\x00\x00\x00\x00\x00\x01", b"\x00" * 7 + b"\x01"], names) == {
        "s63": 2
    }
    assert _leading_counts([None, full], names) == {}


def test_redis_reply_parser_handles_every_split() -> None:
    reply = b"*4\r\n$2\r\nab\r\n$-1\r\n$0\r\n\r\n$3\r\n\r\n\n\r\n"
    # A reply cut anywhere is incomplete (None), never misparsed.
    for cut in range(len(reply)):
        assert parse_reply(reply[:cut]) is None, cut
    assert parse_reply(reply) == ([b"ab", None, b"", b"\r\n\n"], len(reply))
    assert parse_reply(b"+OK\r\n") == (b"OK", 5)
    assert parse_reply(b":-7\r\n") == (-7, 5)
    error = parse_reply(b"-ERR nope\r\n")
    assert error is not None and isinstance(error[0], redis.ResponseError)
    assert encode_command([b"GET", b"k"]) == b"*2\r\n$3\r\nGET\r\n$1\r\nk\r\n"


def test_redis_lookup_client_speaks_auth_and_db() -> None:
    with RedisServer(port=free_port()) as server:
        admin = redis.Redis.from_url(server.url)
        admin.config_set("requirepass", "s3cret")
        admin.close()
        url = server.url.replace("redis://", "redis://:s3cret@") + "/3"

        async def body() -> None:
            index = RedisPrefixIndex(url)
            assert index.fast_lookup
            try:
                await _join(index, "a", [1, 2])
                assert await index.lookup("m", [1, 2]) == {"a": 2}
            finally:
                await index.close()
            bad = RedisPrefixIndex(url.replace("s3cret", "wrong"))
            try:
                with pytest.raises(IndexUnavailable):
                    await bad.lookup("m", [1])
            finally:
                await bad.close()

        asyncio.run(body())
        client = redis.Redis.from_url(url)
        try:
            assert client.dbsize() > 0  # everything landed in db 3
            client.select(0)
            assert client.dbsize() == 0
        finally:
            client.close()


def test_redis_tls_urls_keep_the_fast_lookup_unless_it_cannot_speak_them() -> None:
    """The lean lookup client speaks TLS (tests/services/test_redis_auth.py checks it against
    a TLS proxy); a URL parameter it does not know sends lookups through redis-py."""

    async def body() -> None:
        index = RedisPrefixIndex("rediss://localhost:1")  # connects lazily
        assert index.fast_lookup
        await index.close()
        index = RedisPrefixIndex("redis://localhost:1?client_name=x")
        assert not index.fast_lookup
        await index.close()

    asyncio.run(body())


def test_redis_cancelled_lookup_leaves_the_client_usable(redis_url: str) -> None:
    async def body() -> None:
        index = RedisPrefixIndex(redis_url)
        try:
            await _join(index, "a", list(range(1, 257)))
            for delay in (0, 0, 0.0001, 0.001):
                task = asyncio.create_task(index.lookup("m", list(range(1, 257))))
                await asyncio.sleep(delay)
                task.cancel()
                try:
                    await task
                except asyncio.CancelledError:
                    pass
                # A connection cancelled mid-reply is dropped, so no stale reply is read.
                assert await index.lookup("m", [1, 2, 3]) == {"a": 3}
        finally:
            await index.close()

    asyncio.run(body())


def test_redis_leaves_no_keys_behind(redis_url: str) -> None:
    async def body() -> None:
        index = RedisPrefixIndex(redis_url)
        try:
            await _join(index, "a", [1, 2, 3])
            await _join(index, "b", [2, 3, 4], model="other")
            assert await index.apply(EventBatch("a", "m", 1, 2, (5,), (1,))) is APPLIED
            await index.remove_worker("a")
            await index.snapshot("b", "other", 1, 2, [])
            await index.remove_worker("b")
        finally:
            await index.close()

    asyncio.run(body())
    client = redis.Redis.from_url(redis_url)
    try:
        assert client.keys("*") == []
    finally:
        client.close()


def test_redis_restart_needs_snapshot_and_snapshot_restores() -> None:
    with RedisServer() as server:

        async def body() -> None:
            index = RedisPrefixIndex(server.url)
            try:
                await _join(index, "a", [1, 2, 3])
                await _join(index, "b", [1, 2])
                assert await index.apply(EventBatch("a", "m", 1, 2, stored=(4,))) is APPLIED
                # Several pooled lookup connections, all of which the restart kills.
                many = await asyncio.gather(*(index.lookup("m", [1, 2]) for _ in range(8)))
                assert many == [{"a": 2, "b": 2}] * 8

                server.restart()  # comes back empty, and without our scripts

                # The same client reconnects by itself; the index is simply empty.
                assert await index.lookup("m", [1, 2, 3, 4]) == {}
                assert await index.workers() == {}
                # Each worker's next batch asks for a snapshot; snapshots restore lookups.
                assert await index.apply(EventBatch("a", "m", 1, 3, stored=(5,))) is NEED_SNAPSHOT
                assert await index.snapshot("a", "m", 1, 3, [1, 2, 3, 4, 5]) is APPLIED
                assert await index.apply(EventBatch("b", "m", 1, 2)) is NEED_SNAPSHOT
                assert await index.snapshot("b", "m", 1, 2, [1, 2]) is APPLIED
                assert await index.lookup("m", [1, 2, 3, 4, 5]) == {"a": 5, "b": 2}
                assert await index.apply(EventBatch("a", "m", 1, 4, removed=(5,))) is APPLIED
                assert await index.lookup("m", [1, 2, 3, 4, 5]) == {"a": 4, "b": 2}
            finally:
                await index.close()

        asyncio.run(body())


@pytest.mark.deadline
def test_redis_down_raises_index_unavailable() -> None:
    with RedisServer() as server:

        async def body() -> None:
            index = RedisPrefixIndex(server.url, socket_timeout_s=0.5)
            try:
                await _join(index, "a", [1, 2])
                server.kill()
                calls: list[Callable[[], Awaitable[object]]] = [
                    lambda: index.lookup("m", [1, 2]),
                    lambda: index.apply(EventBatch("a", "m", 1, 2, stored=(3,))),
                    lambda: index.snapshot("a", "m", 1, 2, [1]),
                    lambda: index.remove_worker("a"),
                    lambda: index.workers(),
                ]
                for call in calls:
                    started = time.monotonic()
                    with pytest.raises(IndexUnavailable, match="prefix index") as info:
                        await call()
                    assert isinstance(info.value.__cause__, redis.RedisError | OSError)
                    # Fails fast, so a router can fall back within its request budget.
                    assert time.monotonic() - started < 5.0
                # Once Redis is back (empty), the same client works again.
                server.start()
                assert await index.lookup("m", [1, 2]) == {}
                assert await index.apply(EventBatch("a", "m", 1, 2)) is NEED_SNAPSHOT
            finally:
                await index.close()

        asyncio.run(body())
