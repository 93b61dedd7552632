"""KV tiers in the engine (tandem.engine.tiering): what the device cache evicts comes back from
host memory or disk token-identical to recomputing it -- with prefix hits, chunked prefill,
preemption, sliding windows, latents and linear-attention states -- and a record that fails
its check is a counted miss, never KV."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

from tandem.engine.block_pool import KVEventKind
from tandem.engine.prefix_hash import DISK_TIER, HOST_TIER, tier_mark
from tandem.engine.sampling import SamplingParams

BS = 4
GREEDY = SamplingParams(max_tokens=6, temperature=0.0)
SEEDED = SamplingParams(max_tokens=6, temperature=0.9, seed=11)
TIERS = {
    "host": dict(kv_host_bytes=64 << 20),
    "disk": dict(kv_disk_bytes=64 << 20),
    "both": dict(kv_host_bytes=64 << 20, kv_disk_bytes=64 << 20),
}


def prompts(n: int, length: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [rng.choices(range(3, 250), k=length) for _ in range(n)]


def tiered(engine_factory, model_dir: Path, tmp_path: Path, tiers: str, **kw: Any) -> Any:
    opts = dict(TIERS[tiers])
    if "kv_disk_bytes" in opts:
        opts["kv_disk_dir"] = str(tmp_path / "kv-disk")
    return engine_factory(model_dir, block_size=BS, **opts, **kw)


def run(engine: Any, batch: list[list[int]], params: SamplingParams = GREEDY) -> list[Any]:
    done = engine.generate(batch, params)
    engine.check_integrity()
    assert engine.tiers.tiers.drain()  # what the run evicted is in its tiers now
    return done


def tier(engine: Any, name: str) -> Any:
    [s] = [s for s in engine.tier_stats() if s.tier == name]
    return s


@pytest.mark.parametrize("tiers", sorted(TIERS))
def test_evicted_prefixes_come_back_token_identical(
    tiny_model_dir, engine_factory, tmp_path, tiers
) -> None:
    """Four 40-token prompts through a 24-block cache (each prompt 10+ blocks): every
    repeat finds most of its prefix only in the tiers, and answers exactly as an engine
    that recomputes everything, greedy and seeded."""
    ref = engine_factory(tiny_model_dir, block_size=BS, enable_prefix_caching=False)
    engine = tiered(engine_factory, tiny_model_dir, tmp_path, tiers, num_blocks=24)
    batch = prompts(4, 40)
    for params in (GREEDY, SEEDED):
        want = [c.token_ids for c in ref.generate(batch, params)]
        for _ in range(2):
            for p, w in zip(batch, want, strict=True):
                [got] = run(engine, [p], params)
                assert got.token_ids == w
    # every repeat took at least its device-evicted blocks from a tier
    served = {s.tier: s.hit_tokens for s in engine.tier_stats()}
    assert served[tiers if tiers != "both" else "host"] >= 3 * 4 * 20
    assert all(s.digest_mismatches == 0 and s.failed_writes == 0 for s in engine.tier_stats())
    assert engine.num_free_blocks() == engine.num_blocks
    engine.close()


def test_chunked_prefill_preemption_and_prefix_hits_with_tiers(
    tiny_model_dir, engine_factory, tmp_path
) -> None:
    """Six requests at once in 8-token chunks through a cache too small for them all
    (preemptions), twice: the second round's prefixes come from the host tier, the
    device cache and recomputation mixed, and every output equals the reference."""
    kw = dict(max_num_batched_tokens=16, long_prefill_token_threshold=8, num_blocks=40)
    ref = engine_factory(tiny_model_dir, block_size=BS, enable_prefix_caching=False)
    engine = tiered(engine_factory, tiny_model_dir, tmp_path, "host", **kw)
    shared = prompts(1, 24, seed=3)[0]
    batch = [shared + p for p in prompts(6, 20, seed=4)]
    params = SamplingParams(max_tokens=12, temperature=0.0)
    want = [c.token_ids for c in ref.generate(batch, params)]
    for _ in range(2):
        assert [c.token_ids for c in run(engine, batch, params)] == want
    assert engine.scheduler.num_preemptions > 0
    assert tier(engine, "host").hit_tokens > 0
    engine.close()


def test_concurrent_tier_hits_do_not_crowd_each_other_out(
    tiny_model_dir, engine_factory, tmp_path
) -> None:
    """Four prompts whose blocks are all in host memory arrive at once at a cache that holds
    two of them: each one's blocks enter the device cache only as it is admitted, so none
    evicts another's before its lookup, and every one is served from the tier."""
    engine = tiered(engine_factory, tiny_model_dir, tmp_path, "host", num_blocks=26)
    batch = prompts(4, 40, seed=13)
    want = [c.token_ids for c in run(engine, batch[:2]) + run(engine, batch[2:])]
    run(engine, prompts(2, 40, seed=14))  # the device cache now holds none of them
    done = run(engine, batch)
    assert [c.token_ids for c in done] == want
    assert [c.num_cached_tokens for c in done] == [36] * 4
    assert tier(engine, "host").hit_tokens >= 4 * 36
    engine.close()


def test_corrupted_records_are_counted_misses_and_never_served(
    tiny_model_dir, engine_factory, tmp_path
) -> None:
    """A flipped byte in host memory and on disk, and a truncated file: each block is
    recomputed (the outputs stay exact), counted, and gone from its tier."""
    ref = engine_factory(tiny_model_dir, block_size=BS, enable_prefix_caching=False)
    engine = tiered(engine_factory, tiny_model_dir, tmp_path, "both", num_blocks=24)
    batch = prompts(4, 40, seed=1)
    want = [c.token_ids for c in ref.generate(batch, GREEDY)]
    for p in batch:
        run(engine, [p])
    tiers = engine.tiers.tiers
    for key in tiers.host.keys():  # every host record corrupted: the disk copies serve
        tiers.host.get_quiet(key).payload[7] ^= 0x10
    for p, w in zip(batch, want, strict=True):
        assert run(engine, [p])[0].token_ids == w
    host = tier(engine, "host")
    assert host.digest_mismatches > 0 and tier(engine, "disk").hit_tokens > 0
    files = sorted(tiers.disk.dir.glob("*.kv"))
    assert len(files) >= 4
    for i, path in enumerate(files):  # now the disk: flipped bits and truncations
        raw = bytearray(path.read_bytes())
        if i % 2:
            raw[-3] ^= 0x01
            path.write_bytes(raw)
        else:
            path.write_bytes(raw[: len(raw) // 2])
    for key in tiers.host.keys():
        tiers.host.drop(key)
    before = tier(engine, "disk").digest_mismatches
    for p, w in zip(batch, want, strict=True):
        assert run(engine, [p])[0].token_ids == w
    assert tier(engine, "disk").digest_mismatches > before
    engine.close()


def test_a_stale_copy_cannot_be_taken_after_the_block_is_reused(
    tiny_model_dir, engine_factory, tmp_path
) -> None:
    """The bytes a tier keeps are the evicted block's, copied before allocation reuses
    it: the block's KV as it was computed, not what the next request writes there."""
    engine = tiered(engine_factory, tiny_model_dir, tmp_path, "host", num_blocks=12)
    first, other = prompts(2, 40, seed=2)
    run(engine, [first])
    request = engine.make_request(engine.spec("probe", first, GREEDY))
    engine.scheduler.hash_request(request)
    pool = engine.kv.pool
    cached = {h: pool.get_cached_block(h) for h in request.block_hashes}
    kv_then = {h: engine.kv_cache[b].clone() for h, b in cached.items() if b is not None}
    run(engine, [other])  # reuses every block
    assert all(pool.get_cached_block(h) is None for h in kv_then)
    store = engine.tiers.tiers.host
    for h, kv in kv_then.items():
        entry = store.get_quiet(h)
        assert entry is not None and torch.equal(entry.payload, kv.view(torch.uint8).reshape(-1))
    engine.close()


def test_a_restarted_worker_serves_its_disk_tier(tiny_model_dir, engine_factory, tmp_path) -> None:
    ref = engine_factory(tiny_model_dir, block_size=BS, enable_prefix_caching=False)
    batch = prompts(3, 40, seed=6)
    want = [c.token_ids for c in ref.generate(batch, GREEDY)]
    first = tiered(engine_factory, tiny_model_dir, tmp_path, "disk", num_blocks=24)
    for p in batch:
        run(first, [p])
    first.close()  # a pod restarted on the same volume
    again = tiered(engine_factory, tiny_model_dir, tmp_path, "disk", num_blocks=24)
    assert again.tiers.tiers.drain()
    assert tier(again, "disk").blocks > 0
    again.enable_kv_events()  # what the restarted worker advertises: its disk tier's marks
    assert tier_mark(first_hash(again, batch[0]), DISK_TIER) in again.cached_block_hashes()
    got = [run(again, [p])[0] for p in batch]
    assert [c.token_ids for c in got] == want
    assert all(c.num_cached_tokens > 0 for c in got) and tier(again, "disk").hit_tokens > 0
    again.close()
    # another layout (a block of 8 tokens) finds the directory's records not its own
    disk = dict(kv_disk_dir=str(tmp_path / "kv-disk"), kv_disk_bytes=64 << 20)
    other = engine_factory(tiny_model_dir, block_size=8, num_blocks=24, **disk)
    assert other.tiers.tiers.drain() and tier(other, "disk").blocks == 0
    other.close()


def first_hash(engine: Any, prompt: list[int]) -> int:
    request = engine.make_request(engine.spec("h", prompt, GREEDY))
    engine.scheduler.hash_request(request)
    return request.block_hashes[0]


def test_the_index_hears_which_tier_holds_each_block(
    tiny_model_dir, engine_factory, tmp_path
) -> None:
    engine = tiered(engine_factory, tiny_model_dir, tmp_path, "both", num_blocks=12)
    engine.enable_kv_events()
    first, other = prompts(2, 40, seed=8)
    run(engine, [first])
    h = first_hash(engine, first)
    events = engine.take_kv_events()
    stored = {e.block_hash for e in events if e.kind is KVEventKind.STORED}
    assert {h, tier_mark(h, HOST_TIER), tier_mark(h, DISK_TIER)} <= stored
    run(engine, [other])  # evicts `first` from the device: its host and disk marks stay
    events = engine.take_kv_events()
    assert (KVEventKind.REMOVED, h) in [(e.kind, e.block_hash) for e in events]
    assert tier_mark(h, HOST_TIER) not in {e.block_hash for e in events}
    snapshot = set(engine.cached_block_hashes())
    assert h not in snapshot and tier_mark(h, HOST_TIER) in snapshot
    assert tier_mark(h, DISK_TIER) in snapshot
    engine.close()


def test_a_tier_slower_than_recomputing_is_not_used(
    tiny_model_dir, engine_factory, tmp_path
) -> None:
    engine = tiered(engine_factory, tiny_model_dir, tmp_path, "host", num_blocks=24)
    batch = prompts(3, 40, seed=9)
    for p in batch:
        run(engine, [p])
    engine.tiers.prefill_tokens_per_s = 10 * engine.tiers.onload_tokens_per_s(HOST_TIER)
    assert not engine.tiers.pays(HOST_TIER)
    [again] = run(engine, [batch[0]])
    assert again.num_cached_tokens < 40 - BS and tier(engine, "host").hit_tokens == 0
    engine.close()


@pytest.mark.parametrize(
    ("arch", "blocks"), [("gpt-oss", 30), ("deepseek-v3", 12), ("qwen3-next", 12)]
)
def test_every_kind_of_kv_state_comes_back_whole(
    hf_model, engine_factory, tmp_path, arch, blocks
) -> None:
    """Sliding windows' tables (gpt-oss), latents (DeepSeek-V3) and pages beside
    linear-attention checkpoints (Qwen3-Next): whatever the tiers bring back, the
    outputs equal recomputation's."""
    model_dir, _ = hf_model(arch)
    ref = engine_factory(model_dir, block_size=BS, enable_prefix_caching=False)
    engine = tiered(engine_factory, model_dir, tmp_path, "host", num_blocks=blocks)
    batch = prompts(3, 30, seed=10)
    want = [c.token_ids for c in ref.generate(batch, GREEDY)]
    for _ in range(2):
        for p, w in zip(batch, want, strict=True):
            assert run(engine, [p])[0].token_ids == w
    if arch != "qwen3-next":  # its checkpoints stay on the device: pages alone resume nothing
        assert tier(engine, "host").hit_tokens > 0
    engine.close()


@pytest.mark.parametrize("arch", ["llama", "deepseek-v3"])
def test_tensor_parallel_records_hold_each_head_once_and_serve_any_tp_size(
    hf_model, engine_factory, tmp_path, arch
) -> None:
    """TP=2 on a CPU: a record holds every KV head once (Llama's heads split between the
    ranks: both halves; DeepSeek-V3's latent, which every rank replicates: one copy), so it
    is the single-rank engine's block exactly: a TP=1 worker restarted on the same disk
    directory serves the TP=2 worker's records, and both answer as recomputation does."""
    model_dir, _ = hf_model(arch)
    ref = engine_factory(model_dir, block_size=BS, enable_prefix_caching=False)
    batch = prompts(3, 30, seed=12)
    want = [c.token_ids for c in ref.generate(batch, GREEDY)]
    two = tiered(engine_factory, model_dir, tmp_path, "both", num_blocks=12,
                 tensor_parallel_size=2)  # fmt: skip
    try:
        io, (one_rank, _) = two.tiers.io, two.rank_kv[0]
        heads = one_rank.shape[4] * (1 if arch == "deepseek-v3" else 2)
        assert io.block_shape[3] == heads and len(io.parts) == (1 if arch == "deepseek-v3" else 2)
        assert (
            io.nbytes == one_rank[0].numel() * one_rank.element_size() * heads // one_rank.shape[4]
        )
        for _ in range(2):
            assert [run(two, [p])[0].token_ids for p in batch] == want
        assert tier(two, "host").hit_tokens > 0
    finally:
        two.close()
    one = tiered(engine_factory, model_dir, tmp_path, "disk", num_blocks=12)
    try:
        assert one.tiers.tiers.drain() and tier(one, "disk").blocks > 0
        got = [run(one, [p])[0] for p in batch]
        assert [c.token_ids for c in got] == want and tier(one, "disk").hit_tokens > 0
    finally:
        one.close()
