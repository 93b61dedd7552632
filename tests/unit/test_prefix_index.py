"""The prefix index's messages and its in-memory implementation (pure: no Redis, no I/O).

The behaviour shared with the Redis implementation is tested once for both in
tests/services/test_prefix_index_contract.py; this file covers validation, event coalescing
and the in-memory index on its own. Async methods run under `asyncio.run` (no pytest-asyncio).
"""

from __future__ import annotations

import asyncio
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
from tandem.index.base import leading_counts_reference

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
