"""Hand-offs between tensor-parallel layouts (issue 29): an owner whose KV heads are split over
rank caches (`RemoteKV.ranks`) and a reader split another way (or not at all) move every head
of every block into the cache that holds it, for any pair of TP sizes, replicated heads
included. Local transport (in-process copies): the NIXL path is the services' hand-off tests'.
"""

from __future__ import annotations

import dataclasses
import itertools
from types import SimpleNamespace
from typing import cast

import pytest
import torch

from tandem.model.config import ModelConfig
from tandem.parallel.sharding import Shard, kv_heads
from tandem.transfer import KVHandoff, RankKV, make_transport, sign_handoff, verify_handoff
from tandem.transfer.base import RemoteKV

BLOCKS, LAYERS, BLOCK_SIZE, HEAD_DIM = 12, 2, 4, 8


def rank_caches(num_kv_heads: int, tp: int, dtype: torch.dtype) -> list[tuple[torch.Tensor, int]]:
    """Each rank's cache and first head, as tandem.parallel.sharding splits `num_kv_heads`."""
    config = _config(num_kv_heads, tp)
    out = []
    for r in range(tp):
        heads = kv_heads(config, Shard(r, tp))
        shape = (BLOCKS, LAYERS, 2, BLOCK_SIZE, len(heads), HEAD_DIM)
        out.append((torch.zeros(shape, dtype=dtype), heads.start))
    return out


def _config(num_kv_heads: int, tp: int) -> ModelConfig:
    # kv_heads reads only the KV heads' count.
    return cast(ModelConfig, SimpleNamespace(num_kv_heads=num_kv_heads))


def whole(caches: list[tuple[torch.Tensor, int]], num_kv_heads: int) -> torch.Tensor:
    """The model's whole KV from rank caches (each head from the first rank holding it)."""
    out = torch.full((BLOCKS, LAYERS, 2, BLOCK_SIZE, num_kv_heads, HEAD_DIM), float("nan"))
    for cache, start in reversed(caches):
        out[..., start : start + cache.shape[4], :] = cache.float()
    return out


def register(name: str, caches: list[tuple[torch.Tensor, int]]):  # type: ignore[no-untyped-def]
    t = make_transport("local", name)
    t.register(caches[0][0], ranks=caches if len(caches) > 1 else ())
    return t


@pytest.mark.parametrize(
    ("num_kv_heads", "p", "d"),
    [(k, p, d) for k in (1, 2, 3, 4) for p, d in itertools.product((1, 2, 4), repeat=2)
     if (p, d) != (1, 1) and all(x <= k or x % k == 0 for x in (p, d))],
)  # fmt: skip
@pytest.mark.parametrize("dtype", [torch.float32, torch.float8_e4m3fn])
def test_every_head_lands_in_the_ranks_that_hold_it(
    num_kv_heads: int, p: int, d: int, dtype: torch.dtype
) -> None:
    gen = torch.Generator().manual_seed(num_kv_heads * 100 + p * 10 + d)
    owner_caches = rank_caches(num_kv_heads, p, dtype)
    model = torch.randn(BLOCKS, LAYERS, 2, BLOCK_SIZE, num_kv_heads, HEAD_DIM, generator=gen)
    for cache, start in owner_caches:  # replicas hold the same values, as ranks compute them
        cache.copy_(model[..., start : start + cache.shape[4], :].to(dtype))
    reader_caches = rank_caches(num_kv_heads, d, dtype)
    owner = register(f"own-{num_kv_heads}-{p}-{d}-{dtype}", owner_caches)
    reader = register(f"read-{num_kv_heads}-{p}-{d}-{dtype}", reader_caches)
    try:
        remote_ids, local_ids = [3, 4, 5, 9, 0], [7, 8, 9, 1, 2]
        handle = owner.export(remote_ids)
        assert len(handle.ranks) == (p if p > 1 else 0)
        assert handle.layout.num_kv_heads == num_kv_heads
        moved = reader.read(handle, local_ids, notif=b"done")
        assert owner.poll() == [b"done"]
        got = whole(reader_caches, num_kv_heads)
        want = whole(owner_caches, num_kv_heads)
        assert torch.equal(got[local_ids], want[remote_ids])
        untouched = [b for b in range(BLOCKS) if b not in local_ids]
        assert not got[untouched].any()
        for cache, start in reader_caches:  # each replica got its own copy
            assert torch.equal(
                cache.float()[local_ids], want[remote_ids][..., start : start + cache.shape[4], :]
            )
        per_head = LAYERS * 2 * BLOCK_SIZE * HEAD_DIM * dtype.itemsize
        # Each head crosses once per reader rank needing it (a direct read or one staging).
        assert moved >= len(remote_ids) * num_kv_heads * per_head
    finally:
        owner.close()
        reader.close()


def test_staging_reads_in_chunks_of_whole_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    """A staging buffer smaller than the read: several reads, the same result."""
    import tandem.transfer.ranks as ranks

    monkeypatch.setattr(ranks, "STAGING_BYTES", 1)  # one block per read
    test_every_head_lands_in_the_ranks_that_hold_it(4, 2, 1, torch.float32)


def test_ranks_must_cover_every_head_and_are_signed() -> None:
    owner_caches = rank_caches(4, 2, torch.float32)
    owner = register("own-sign", owner_caches)
    try:
        handle = owner.export([1, 2])
        with pytest.raises(ValueError, match="not all 4"):
            dataclasses.replace(handle, ranks=handle.ranks[:1])
        with pytest.raises(ValueError, match="outside"):
            dataclasses.replace(handle, ranks=(*handle.ranks[:1], RankKV(1, 2, 3)))
        handoff = KVHandoff(handle, BLOCK_SIZE, 8, "h:1", "lease", 1, 9.0)
        key, hashes = b"k" * 32, [1, 2]
        signed = dataclasses.replace(handoff, signature=sign_handoff(key, "r", hashes, handoff))
        assert verify_handoff(key, "r", hashes, signed)
        r0, r1 = handle.ranks
        for ranks in (
            (r0, RankKV(r1.base_addr + 4096, r1.head_start, r1.num_heads)),  # another address
            (RankKV(r0.base_addr, 0, 3), RankKV(r1.base_addr, 3, 1)),  # other head ranges
            (r0, r1, r1),  # an extra rank
        ):
            altered = dataclasses.replace(signed.remote, ranks=ranks)
            assert not verify_handoff(key, "r", hashes, dataclasses.replace(signed, remote=altered))
        single = RemoteKV(**{**_fields(handle), "ranks": ()})
        unsigned = dataclasses.replace(signed, remote=single)  # the ranks dropped
        assert not verify_handoff(key, "r", hashes, unsigned)
    finally:
        owner.close()


def _fields(remote: RemoteKV) -> dict[str, object]:
    return {f.name: getattr(remote, f.name) for f in dataclasses.fields(remote)}


# -- one copy of replicated heads (issue 43: MLA's latent, every rank's) ----------------------


def test_plan_reads_replicated_heads_cross_once() -> None:
    """Owner replicas are read from the first owner rank holding them; reader replicas get
    them by a local copy from the first reader rank holding them, not a second read."""
    from tandem.transfer.ranks import HeadReads, plan_reads

    h0, h01, h23 = range(0, 1), range(0, 2), range(2, 4)
    assert plan_reads([h0, h0], [h0]) == HeadReads(((0, 0),), {}, ())
    assert plan_reads([h0], [h0, h0]) == HeadReads(((0, 0),), {}, ((0, 1),))
    assert plan_reads([h0, h0], [h0, h0]) == HeadReads(((0, 0),), {}, ((0, 1),))
    assert plan_reads([h0, h0], [h0, h0, h0, h0]) == HeadReads(
        ((0, 0),), {}, ((0, 1), (0, 2), (0, 3))
    )
    # dense splits as before: a read per distinct range, staged where the split differs
    assert plan_reads([h01, h23], [h01, h23]) == HeadReads(((0, 0), (1, 1)), {}, ())
    assert plan_reads([h01, h23], [range(4)]) == HeadReads(
        (), {0: ((0, 0, 0, 2),), 1: ((0, 2, 0, 2),)}, ()
    )
    assert plan_reads([range(4)], [h01, h23]) == HeadReads(
        (), {0: ((0, 0, 0, 2), (1, 0, 2, 2))}, ()
    )
    # KV heads replicated past the ranks' count (2 heads, 4 ranks): each read once
    assert plan_reads([h0, h0, range(1, 2), range(1, 2)], [h01]) == HeadReads(
        (), {0: ((0, 0, 0, 1),), 2: ((0, 1, 0, 1),)}, ()
    )
    assert plan_reads([h01], [h0, h0, range(1, 2), range(1, 2)]) == HeadReads(
        (), {0: ((0, 0, 0, 1), (2, 0, 1, 1))}, ((0, 1), (2, 3))
    )


@pytest.mark.parametrize(("p", "d"), [(2, 1), (1, 2), (2, 2), (1, 4)])
def test_one_replicated_head_moves_one_copy(p: int, d: int) -> None:
    """One KV head (MLA's latent) replicated on every rank: a hand-off moves the blocks' bytes
    once over the transport (one rank's), whatever the TP sizes; every reader rank gets it."""
    owner_caches = rank_caches(1, p, torch.float32)
    model = torch.randn(BLOCKS, LAYERS, 2, BLOCK_SIZE, 1, HEAD_DIM)
    for cache, _ in owner_caches:
        cache.copy_(model)
    reader_caches = rank_caches(1, d, torch.float32)
    owner, reader = (
        register(f"own1-{p}-{d}", owner_caches),
        register(f"read1-{p}-{d}", reader_caches),
    )
    try:
        remote_ids, local_ids = [3, 4, 5, 9, 0], [7, 8, 9, 1, 2]
        moved = reader.read(owner.export(remote_ids), local_ids)
        assert moved == len(remote_ids) * LAYERS * 2 * BLOCK_SIZE * HEAD_DIM * 4  # one copy
        assert reader.last_num_descriptors == 3  # runs 3-5 -> 7-9, 9 -> 1, 0 -> 2
        for cache, _ in reader_caches:
            assert torch.equal(cache[local_ids], model[remote_ids])
            assert not cache[[b for b in range(BLOCKS) if b not in local_ids]].any()
    finally:
        owner.close()
        reader.close()
