"""The prefix index's messages and its in-memory implementation (pure: no Redis, no I/O).

The behaviour shared with the Redis implementation is tested once for both in
tests/services/test_prefix_index_contract.py; this file covers validation, event coalescing
and the in-memory index on its own. Async methods run under `asyncio.run` (no pytest-asyncio).
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Coroutine
from typing import Any, TypeVar

import pytest

from tandem.engine.block_pool import KVEvent, KVEventKind
from tandem.index import (
    MAX_WORKERS_PER_MODEL,
    ApplyResult,
    EventBatch,
    IndexFull,
    MemoryPrefixIndex,
)
from tandem.index.base import check_marks, leading_counts_reference, resumable_counts

T = TypeVar("T")


def run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


# -- EventBatch ---------------------------------------------------------------------------


def test_event_batch_keeps_tuples_and_accepts_any_iterable() -> None:
    batch = EventBatch("w", "m", 3, 1, stored=[1, 2], removed=iter([3]))  # type: ignore[arg-type]
    assert batch.stored == (1, 2)
    assert batch.removed == (3,)
    assert hash(batch) == hash(EventBatch("w", "m", 3, 1, (1, 2), (3,)))


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        (dict(worker_id=""), "worker_id"),
        (dict(worker_id="a\nb"), "worker_id"),
        (dict(model=""), "model"),
        (dict(model=7), "model"),
        (dict(epoch=-1), "epoch"),
        (dict(epoch=2**63), "epoch"),
        (dict(epoch=True), "epoch"),
        (dict(seq=0), "seq"),
        (dict(seq=2**53), "seq"),
        (dict(seq=1.0), "seq"),
        (dict(stored=(1, -1)), r"stored\[1\]"),
        (dict(stored=(2**64,)), r"stored\[0\]"),
        (dict(removed=("1",)), r"removed\[0\]"),
        (dict(stored=(1, 2), removed=(2,)), "both stored and removed"),
    ],
)
def test_event_batch_rejects_misuse_naming_the_field(kwargs: dict[str, Any], needle: str) -> None:
    fields: dict[str, Any] = dict(worker_id="w", model="m", epoch=1, seq=1, stored=(), removed=())
    fields.update(kwargs)
    with pytest.raises(ValueError, match=needle):
        EventBatch(**fields)


def test_event_batch_accepts_the_extremes() -> None:
    batch = EventBatch("w", "m", 2**63 - 1, 2**53 - 1, (0, 2**64 - 1), ())
    assert batch.stored == (0, 2**64 - 1)


def test_from_events_last_event_of_a_hash_wins() -> None:
    events = [
        KVEvent(KVEventKind.STORED, 1),
        KVEvent(KVEventKind.STORED, 2),
        KVEvent(KVEventKind.REMOVED, 2),  # stored then evicted in one step: removed
        KVEvent(KVEventKind.REMOVED, 3),
        KVEvent(KVEventKind.STORED, 3),  # evicted then recomputed: stored
        KVEvent(KVEventKind.REMOVED, 4),
    ]
    batch = EventBatch.from_events("w", "m", 1, 5, events)
    assert batch == EventBatch("w", "m", 1, 5, stored=(1, 3), removed=(2, 4))


def test_from_events_rejects_unknown_kind() -> None:
    with pytest.raises(ValueError, match=r"events\[1\] has kind 'moved'"):
        EventBatch.from_events("w", "m", 1, 1, [("stored", 1), ("moved", 2)])


def test_leading_counts_reference_stops_at_first_miss() -> None:
    holdings = {"a": {1, 2, 4}, "b": {2, 3}, "c": {1, 2, 3}}
    assert leading_counts_reference(holdings, [1, 2, 3, 4]) == {"a": 2, "c": 3}
    assert leading_counts_reference(holdings, []) == {}
    # with marks: cut back to the last block whose mark each worker holds
    assert leading_counts_reference(holdings, [1, 2, 3, 4], [9, 1, 4, 9]) == {"a": 2, "c": 2}
    assert leading_counts_reference(holdings, [1, 2, 3, 4], [1, 9, 9, 9]) == {"c": 1, "a": 1}
    # with marks_from: every mark in range(marks_from[n - 1], n), not mark n - 1 alone
    marks = [1, 2, 3, 4]
    assert leading_counts_reference(holdings, [1, 2, 3], marks, [0, 1, 1]) == {"a": 2, "c": 3}
    assert leading_counts_reference(holdings, [1, 2, 3], marks, [0, 0, 0]) == {"a": 2, "c": 3}
    assert leading_counts_reference(holdings, [1, 2, 3], [9, 2, 3], [0, 0, 1]) == {"c": 3}
    assert leading_counts_reference(holdings, [1, 2, 3], [9, 2, 3], [0, 0, 0]) == {}


def test_resumable_counts_cut_each_count_back_to_a_fully_held_range() -> None:
    # marks 0..5: "a" lacks mark 4, "b" lacks marks 0 and 1, "c" holds only mark 5
    holders = [{"a", "c0"}, {"a", "c0"}, {"a", "b"}, {"a", "b"}, {"b"}, {"a", "b", "c"}]
    counts = {"a": 6, "b": 6, "c": 6, "c0": 2}
    window = [0, 0, 1, 2, 3, 4]  # the last two blocks, as a window of 2 blocks needs
    assert resumable_counts(counts, holders, window) == {"a": 4, "b": 6, "c0": 2}
    # mark n - 1 alone (the default): a gap below it does not matter
    assert resumable_counts(counts, holders, range(6)) == {"a": 6, "b": 6, "c": 6, "c0": 2}
    # every mark from 0: one gap anywhere below n cuts it back below the gap
    assert resumable_counts(counts, holders, [0] * 6) == {"a": 4, "c0": 2}
    assert resumable_counts({"a": 3}, holders, [0, 1, 2]) == {"a": 3}


def test_resumable_counts_match_the_reference_for_any_marks_from() -> None:
    """Random holdings and marks_from (windows and ranges that need not grow with n) against
    the plain rule: catches a walk that skips or re-reads a range wrongly."""
    rng = random.Random(7)
    for _ in range(500):
        size = rng.randint(1, 12)
        chain, marks = list(range(size)), list(range(100, 100 + size))
        holdings = {f"w{i}": set(rng.sample(chain + marks, rng.randint(0, 2 * size)))
                    for i in range(4)}  # fmt: skip
        for w in ("w0", "w1"):  # most hold the chain, so the marks decide
            holdings[w] |= set(chain)
        marks_from = [rng.randint(0, i) for i in range(size)]
        counts = leading_counts_reference(holdings, chain)
        holders = [{w for w, held in holdings.items() if m in held} for m in marks]
        expected = leading_counts_reference(holdings, chain, marks, marks_from)
        assert resumable_counts(counts, holders, marks_from) == expected, (holdings, marks_from)


def test_check_marks_fills_in_marks_from_and_rejects_misuse() -> None:
    assert check_marks([1, 2], None, None) is None
    assert check_marks([1, 2], [5, 6], None) == ((5, 6), (0, 1))
    assert check_marks([1, 2, 3], [5, 6, 7], [0, 0, 1]) == ((5, 6, 7), (0, 0, 1))
    assert check_marks([], [], []) == ((), ())
    for marks, marks_from, needle in [
        (None, [0, 0], "marks_from was given without marks"),
        ([5, 6], [0], r"marks_from must have one int per block of the chain \(2\), got 1"),
        ([5, 6], [0, 2], r"marks_from\[1\] must be an int in \[0, 1\], got 2"),
        ([5, 6], [-1, 0], r"marks_from\[0\] must be an int in \[0, 0\], got -1"),
        ([5, 6], [0, True], r"marks_from\[1\] .* got True"),
        ([5, 6], [0, 1.0], r"marks_from\[1\] .* got 1.0"),
        ([5], [0, 0], "marks must have one hash per block of the chain"),
    ]:
        with pytest.raises(ValueError, match=needle):
            check_marks([1, 2], marks, marks_from)


# -- MemoryPrefixIndex --------------------------------------------------------------------


async def _indexed(index: MemoryPrefixIndex, worker_id: str, hashes: list[int]) -> None:
    assert await index.snapshot(worker_id, "m", 1, 0, hashes) is ApplyResult.APPLIED


def test_memory_lookup_counts_leading_blocks_per_worker() -> None:
    async def body() -> None:
        index = MemoryPrefixIndex()
        await _indexed(index, "a", [10, 11, 12])
        await _indexed(index, "b", [10, 12, 13])  # misses 11: only block 0 counts
        await _indexed(index, "c", [11, 12])  # misses block 0: nothing counts
        assert await index.lookup("m", [10, 11, 12, 13]) == {"a": 3, "b": 1}
        assert await index.lookup("m", [10]) == {"a": 1, "b": 1}
        assert await index.lookup("m", [99, 10]) == {}
        assert await index.lookup("m", []) == {}
        assert await index.lookup("other", [10]) == {}

    run(body())


def test_memory_forgets_blocks_nobody_holds() -> None:
    async def body() -> None:
        index = MemoryPrefixIndex()
        await _indexed(index, "a", [1, 2])
        await _indexed(index, "b", [2, 3])
        assert await index.apply(EventBatch("a", "m", 1, 1, removed=(1, 2))) is ApplyResult.APPLIED
        await index.remove_worker("b")
        # White box: no empty holder sets linger after the last holder goes.
        assert index._holders["m"] == {}

    run(body())


def test_memory_index_full_changes_nothing() -> None:
    async def body() -> None:
        index = MemoryPrefixIndex()
        for i in range(MAX_WORKERS_PER_MODEL):
            await index.snapshot(f"w{i}", "m", 1, 0, [1])
        await index.snapshot("mover", "other", 1, 0, [1])
        with pytest.raises(IndexFull, match="'m' already has 64 workers"):
            await index.snapshot("mover", "m", 1, 1, [1])
        # The failed move left the worker where it was.
        assert await index.lookup("other", [1]) == {"mover": 1}
        assert (await index.workers())["mover"] == (1, 0)

    run(body())


def test_memory_rejects_misuse_naming_the_argument() -> None:
    async def body() -> None:
        index = MemoryPrefixIndex()
        with pytest.raises(ValueError, match=r"chain\[1\]"):
            await index.lookup("m", [1, -2])
        with pytest.raises(ValueError, match="model"):
            await index.lookup("", [1])
        with pytest.raises(ValueError, match="seq"):
            await index.snapshot("w", "m", 1, -1, [])
        with pytest.raises(ValueError, match=r"hashes\[0\]"):
            await index.snapshot("w", "m", 1, 0, [2**64])
        with pytest.raises(ValueError, match="worker_id"):
            await index.remove_worker("")
        with pytest.raises(ValueError, match="EventBatch"):
            await index.apply(("w", "m", 1, 1))  # type: ignore[arg-type]
        assert await index.workers() == {}

    run(body())
