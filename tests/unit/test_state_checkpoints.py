"""Prefix hits for models with linear-attention layers (Qwen3-Next): the checkpoints'
bookkeeping (LRU slots keyed by block hash) and the KV manager's rule that a prefix is a hit
only where its pages and its state checkpoint are both held."""

from __future__ import annotations

import pytest

from tandem.engine.block_pool import KVEvent, KVEventKind
from tandem.engine.kv_manager import KVCacheManager
from tandem.engine.prefix_hash import state_mark
from tandem.engine.request import Request
from tandem.engine.sampling import SamplingParams
from tandem.engine.state_checkpoints import StateCheckpoints
from tandem.model.layer_groups import LayerGroup, LayerKind

BS = 4
GROUPS = (LayerGroup(LayerKind.LINEAR, (0, 1, 2)), LayerGroup(LayerKind.FULL, (3,)))


def test_checkpoint_slots_are_claimed_once_and_evicted_least_recently_used() -> None:
    c = StateCheckpoints(2)
    assert c.claim(10) == 0 and c.claim(11) == 1
    assert c.claim(10) is None  # that prefix has one
    assert c.lookup(10) == 0  # now 11 is the least recently used
    assert c.claim(12) == 1 and 11 not in c and c.lookup(11) is None
    assert c.claim(13, pinned={0, 1}) is None  # every slot still read or written this step
    assert c.claim(13, pinned={1}) == 0 and 10 not in c
    c.check_integrity()
    c.clear()
    assert len(c) == 0 and c.claim(14) == 0
    c.check_integrity()
    with pytest.raises(ValueError, match="num_slots must be positive"):
        StateCheckpoints(0)


def _request(rid: str, n: int) -> Request:
    r = Request(rid, list(range(n)), SamplingParams(max_tokens=4, temperature=0.0))
    r.update_block_hashes(BS, ())
    return r


def _cached(kv: KVCacheManager, n: int) -> Request:
    """A request whose first n tokens are computed and published, then freed."""
    r = _request("first", n + 1)
    kv.allocate_slots(r, n + 1)
    r.num_computed_tokens = n
    kv.cache_blocks(r)
    kv.free("first")
    return r


def test_a_hit_on_the_pages_but_not_the_state_is_a_miss() -> None:
    ckpts = StateCheckpoints(4)
    kv = KVCacheManager(16, BS, groups=GROUPS, checkpoints=ckpts)
    first = _cached(kv, 12)  # three full blocks cached
    second = _request("second", 14)
    assert kv.pool.num_cached_blocks == 3
    assert kv.get_computed_blocks(second) == ([], 0)  # no checkpoint at all
    ckpts.claim(first.block_hashes[1])  # the state after 8 tokens
    hits, n = kv.get_computed_blocks(second)
    assert n == 8 and hits == [kv.pool.get_cached_block(h) for h in first.block_hashes[:2]]
    assert kv.checkpoint_slot(second, 8) == 0
    ckpts.claim(first.block_hashes[2])  # after 12: the longest both hold
    assert kv.get_computed_blocks(second)[1] == 12
    with pytest.raises(RuntimeError, match="without a linear-attention state checkpoint"):
        kv.checkpoint_slot(second, 4)


def test_a_checkpoint_without_its_pages_is_a_miss_too() -> None:
    ckpts = StateCheckpoints(4)
    kv = KVCacheManager(4, BS, groups=GROUPS, checkpoints=ckpts)
    first = _cached(kv, 12)
    ckpts.claim(first.block_hashes[2])  # the state after 12 tokens
    assert kv.get_computed_blocks(_request("second", 14))[1] == 12
    kv.allocate_slots(_request("other", 8), 8)  # evicts the tail blocks first: 3, then 2
    assert kv.pool.get_cached_block(first.block_hashes[2]) is None
    assert kv.get_computed_blocks(_request("second", 14)) == ([], 0)  # no checkpoint at 8
    ckpts.claim(first.block_hashes[1])
    assert kv.get_computed_blocks(_request("second", 14))[1] == 8
    kv.reset_prefix_cache()
    assert len(ckpts) == 0


def test_dense_models_and_caching_off_need_no_checkpoints() -> None:
    dense = KVCacheManager(8, BS, groups=(LayerGroup(LayerKind.FULL, (0, 1)),))
    _cached(dense, 8)
    assert dense.get_computed_blocks(_request("second", 10))[1] == 8
    assert KVCacheManager(8, BS, enable_caching=False, groups=GROUPS).checkpoints is None
    with pytest.raises(ValueError, match="needs checkpoints"):
        KVCacheManager(8, BS, groups=GROUPS)


def test_checkpoints_publish_their_state_marks() -> None:
    """Kept and evicted checkpoints are STORED and REMOVED events of their blocks' state
    marks (the prefix index's view of where a worker can resume), and a snapshot lists the
    marks held; a mark is never a block hash."""
    ckpts = StateCheckpoints(1)
    kv = KVCacheManager(8, BS, groups=GROUPS, checkpoints=ckpts)
    first = _cached(kv, 8)
    ckpts.claim(1)  # before events are recorded: none
    kv.enable_events()
    kv.take_events()
    h0, h1 = first.block_hashes[:2]
    ckpts.claim(h1)  # evicts 1
    assert kv.take_events() == [
        KVEvent(KVEventKind.REMOVED, state_mark(1)),
        KVEvent(KVEventKind.STORED, state_mark(h1)),
    ]
    assert sorted(kv.cached_hashes()) == sorted([h0, h1, state_mark(h1)])
    assert state_mark(h1) not in (h0, h1) and state_mark(h1) != state_mark(h0)
    kv.reset_prefix_cache()
    assert kv.take_events()[-1] == KVEvent(KVEventKind.REMOVED, state_mark(h1))


def test_the_router_looks_up_a_linear_models_prefixes_with_state_marks() -> None:
    import asyncio

    from tandem.engine.prefix_hash import hash_blocks, hash_keys
    from tandem.engine.request import RequestSpec
    from tandem.services.router.config import RouterConfig
    from tandem.services.router.placer import Placer, ResumeMarks

    asked: list[tuple[list[int], list[int] | None, object]] = []

    class Index:
        async def lookup(  # type: ignore[no-untyped-def]
            self, model, hashes, marks=None, marks_from=None
        ):
            asked.append((hashes, marks, marks_from))
            return {"d0": 2}

    tokens = tuple(range(5, 69))  # 4 blocks of 16
    config = RouterConfig(model_dir="m", block_size=16, decode_addresses=("d:1",))
    for marks in (ResumeMarks(), ResumeMarks("state")):
        placer = Placer(config, "m", marks=marks)
        placer._index = Index()  # type: ignore[assignment]
        asyncio.run(placer._prefix_overlap(RequestSpec("r", tokens), []))
    hashes = hash_blocks(list(tokens), 16, hash_keys("m"))
    assert asked == [(hashes, None, None), (hashes, [state_mark(h) for h in hashes], None)]
