"""The router's tier lookups (services/router/placer.py) against a real prefix index: workers
publish their plain block hashes and tier marks (`tier_mark`) with `EventBatch`/`snapshot`
as the worker side does, the placer looks up the prompt's three chains and builds each
worker's `TierOverlap`, and the kv policy weighs it (tandem.routing.tiers). Run against the
in-memory index and Redis alike."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator, Sequence

import pytest

from tandem.engine.prefix_hash import DISK_TIER, HOST_TIER, hash_blocks, hash_keys, tier_mark
from tandem.engine.request import RequestSpec
from tandem.index import ApplyResult, EventBatch, IndexUnavailable, MemoryPrefixIndex, PrefixIndex
from tandem.routing import RoutingConfig, TierOverlap, WorkerLoad
from tandem.services.common.redis.index import RedisPrefixIndex
from tandem.services.router.config import RouterConfig
from tandem.services.router.placer import Placer, ResumeMarks
from tests.services.test_prefix_index_contract import runner

Body = Callable[[PrefixIndex], Awaitable[None]]

TOKENS = tuple(range(5, 30))  # 25 tokens: 6 full blocks of 4 and one token more
HASHES = hash_blocks(list(TOKENS), 4, hash_keys("m"))
HOST = [tier_mark(h, HOST_TIER) for h in HASHES]
DISK = [tier_mark(h, DISK_TIER) for h in HASHES]
TIER_RATES = {
    "prefill_tokens_per_s": 1000.0,
    "host_onload_tokens_per_s": 4000.0,
    "disk_onload_tokens_per_s": 2000.0,
}


@pytest.fixture(params=["memory", "redis"])
def check(request: pytest.FixtureRequest) -> Iterator[Callable[[Body], None]]:
    """Runs a test body against a fresh index: in-memory, or Redis (the shared server,
    flushed)."""
    make: Callable[[], PrefixIndex] = MemoryPrefixIndex
    if request.param == "redis":
        url: str = request.getfixturevalue("redis_url")

        def make() -> PrefixIndex:
            return RedisPrefixIndex(url)

    yield runner(make)


class Counting(PrefixIndex):
    """An index that counts the lookups it passes on, and fails those `fail` picks."""

    def __init__(self, inner: PrefixIndex, fail: Callable[[Sequence[int]], bool] | None = None):
        self.inner = inner
        self.fail = fail
        self.chains: list[list[int]] = []

    async def lookup(self, model, chain, marks=None, marks_from=None):  # type: ignore[no-untyped-def]
        self.chains.append(list(chain))
        if self.fail is not None and self.fail(chain):
            raise IndexUnavailable("test: down")
        return await self.inner.lookup(model, chain, marks, marks_from)

    async def apply(self, batch):  # type: ignore[no-untyped-def]
        return await self.inner.apply(batch)

    async def snapshot(self, worker_id, model, epoch, seq, hashes):  # type: ignore[no-untyped-def]
        return await self.inner.snapshot(worker_id, model, epoch, seq, hashes)

    async def remove_worker(self, worker_id):  # type: ignore[no-untyped-def]
        await self.inner.remove_worker(worker_id)

    async def workers(self):  # type: ignore[no-untyped-def]
        return await self.inner.workers()


def _load(worker_id: str, role: str, **rates: float) -> WorkerLoad:
    return WorkerLoad(
        worker_id=worker_id, role=role, address=f"{worker_id}:1", num_blocks=100,
        num_free_blocks=100, **rates,
    )  # fmt: skip


def _placer(index: PrefixIndex, workers: list[WorkerLoad], **kw: object) -> Placer:
    routing = RoutingConfig(disagg_min_uncached_tokens=0)
    config = RouterConfig(
        model_dir="m", block_size=4, decode_addresses=("d:1",), index_timeout_s=5.0,
        routing=routing,
    )  # fmt: skip
    placer = Placer(config, "m", **kw)  # type: ignore[arg-type]
    placer._index = index  # type: ignore[assignment]
    placer.workers = lambda: workers  # type: ignore[method-assign]
    return placer


async def _join(index: PrefixIndex, worker: str, hashes: list[int]) -> None:
    """First contact, as a worker's publisher makes it: its first batch asks for a
    snapshot of everything it holds."""
    assert await index.apply(EventBatch(worker, "m", 1, 1, tuple(hashes))) is (
        ApplyResult.NEED_SNAPSHOT
    )
    assert await index.snapshot(worker, "m", 1, 1, hashes) is ApplyResult.APPLIED


def test_the_placer_builds_tier_overlaps_and_places_on_them(check: Callable[[Body], None]) -> None:
    """p-tier holds the prompt's 6 blocks on its device, then evicts blocks 2-5 to host
    memory, then blocks 4-5 on to disk; p-dev (no tiers) holds blocks 0-2 on its device.
    Costs (cache_weight 2, 25 tokens, the last always computed, no queues):
        p-dev:  2 x (25 - 12)                                    = 26
        p-tier: host: 8 device, 16 host at 4x (4), 1 computed    -> 2 x 5 = 10
                disk: 8 device, 8 host (2), 8 disk at 2x (4), 1  -> 2 x 7 = 14"""
    workers = [
        _load("d0", "decode"),
        _load("p-dev", "prefill"),
        _load("p-tier", "prefill", **TIER_RATES),
    ]

    async def body(index: PrefixIndex) -> None:
        await _join(index, "p-tier", HASHES + HOST + DISK)
        await _join(index, "p-dev", HASHES[:3])
        counting = Counting(index)
        placer = _placer(counting, workers)
        spec = RequestSpec("r", TOKENS)

        hashes, overlap, tiers = await placer._prefix_lookups(spec, workers)
        assert hashes == HASHES and overlap == {"p-dev": 3, "p-tier": 6}
        assert tiers == {"p-dev": TierOverlap(3, 3, 3), "p-tier": TierOverlap(6, 6, 6)}
        assert counting.chains == [HASHES, HOST, DISK]

        # the device evicts blocks 2-5 to host memory: their hashes go, their marks stay
        evict = EventBatch("p-tier", "m", 1, 2, removed=tuple(HASHES[2:]))
        assert await index.apply(evict) is ApplyResult.APPLIED
        _, overlap, tiers = await placer._prefix_lookups(spec, workers)
        assert overlap == {"p-dev": 3, "p-tier": 2}
        assert tiers == {"p-dev": TierOverlap(3, 3, 3), "p-tier": TierOverlap(2, 6, 6)}
        placement = await placer.place(spec)
        assert placement.prefill is not None and placement.prefill.worker_id == "p-tier"
        assert placement.reason == (
            "kv: 8 cached tokens, queue 0, 16 from host + 0 from disk tiers"
        )
        costs = {c.worker_id: (c.cost, c.tier_tokens) for c in placement.candidates}
        assert costs == {"d0": (None, 0), "p-dev": (26.0, 0), "p-tier": (10.0, 16)}

        # host memory evicts blocks 4-5 to disk: their host marks go
        spill = EventBatch("p-tier", "m", 1, 3, removed=tuple(HOST[4:]))
        assert await index.apply(spill) is ApplyResult.APPLIED
        _, _, tiers = await placer._prefix_lookups(spec, workers)
        assert tiers is not None and tiers["p-tier"] == TierOverlap(2, 4, 6)
        placement = await placer.place(spec)
        assert placement.prefill is not None and placement.prefill.worker_id == "p-tier"
        costs = {c.worker_id: (c.cost, c.tier_tokens) for c in placement.candidates}
        assert costs == {"d0": (None, 0), "p-dev": (26.0, 0), "p-tier": (14.0, 16)}

        # a worker known only by its tier marks (its device holds none of the prompt)
        await _join(index, "p-cold", DISK[:6])
        _, overlap, tiers = await placer._prefix_lookups(spec, workers)
        assert overlap is not None and "p-cold" not in overlap
        assert tiers is not None and tiers["p-cold"] == TierOverlap(0, 0, 6)

    check(body)


def test_one_lookup_without_tiered_workers_or_for_state_and_sliding_marks(
    check: Callable[[Body], None],
) -> None:
    plain = [_load("d0", "decode"), _load("p0", "prefill", prefill_tokens_per_s=1000.0)]
    tiered = [_load("d0", "decode"), _load("p0", "prefill", **TIER_RATES)]

    async def body(index: PrefixIndex) -> None:
        await _join(index, "p0", HASHES + HOST + DISK)
        spec = RequestSpec("r", TOKENS)
        for workers, marks in (
            (plain, ResumeMarks()),
            (tiered, ResumeMarks("state")),
            (tiered, ResumeMarks("sliding", 1, 8)),
        ):
            counting = Counting(index)
            placer = _placer(counting, workers, marks=marks)
            _, _, tiers = await placer._prefix_lookups(spec, workers)
            assert tiers is None and counting.chains == [HASHES]

    check(body)


def test_a_failed_tier_lookup_places_on_load_alone(check: Callable[[Body], None]) -> None:
    workers = [_load("d0", "decode"), _load("p0", "prefill", **TIER_RATES)]

    async def body(index: PrefixIndex) -> None:
        await _join(index, "p0", HASHES + HOST + DISK)
        counting = Counting(index, fail=lambda chain: list(chain) == DISK)
        placer = _placer(counting, workers)
        spec = RequestSpec("r", TOKENS)
        assert await placer._prefix_lookups(spec, workers) == (HASHES, None, None)
        assert placer.index_degraded
        placement = await placer.place(spec)
        assert placement.cached_tokens == 0 and placement.prefill is not None
        assert [c.tier_tokens for c in placement.candidates] == [0, 0]
        counting.fail = None  # the index answers again: tiers are back
        _, overlap, tiers = await placer._prefix_lookups(spec, workers)
        assert not placer.index_degraded and overlap == {"p0": 6}
        assert tiers == {"p0": TierOverlap(6, 6, 6)}

    check(body)
