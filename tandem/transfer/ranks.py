"""Tensor-parallel reads: hand-offs where either side splits the KV heads over rank caches.

A tensor-parallel engine registers one cache per rank (`KVTransport.register(ranks=...)`), each
holding a range of the model's KV heads (ranks past the heads' count hold replicas), and its
handles carry them (`RemoteKV.ranks`). A read where either side is split gives each of the
reader's rank caches its heads from the first owner rank holding them:

    owner ranks    [h0 h1 | h2 h3]        reader ranks   [h0 h1 | h2 h3]   same split: read
                                                          [h0 | h1 | h2 | h3]  straight into
                                                          each cache; any other: staged

A staged read pulls one owner rank's whole blocks into a staging buffer (few, large reads: one
descriptor per run of blocks) and copies each head range out into the reader cache holding it.

Replicated heads cross the wire once (`plan_reads`): owner replicas are read from the first
owner rank holding them, and reader rank caches that replicate an earlier one's heads (MLA's
latent, the one KV head every rank caches; dense KV heads past the ranks' count) get them by
a local copy from it after the reads, a fan-out on the reader's machine:

    owner [h0 | h0]  -> reader [h0 | h0]   one read into reader rank 0, one local copy to 1

Everything here works on plain data (head ranges, tensors, block ids) and the transport's
reads passed in; `KVTransport` (tandem.transfer.base) checks a read's arguments first.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import torch

from tandem.transfer.layout import KVLayout
from tandem.transfer.runs import coalesce

# A staged read pulls one source rank's whole blocks into a staging buffer of this size, then
# copies each head range into the rank cache that holds it: reads stay few and large.
STAGING_BYTES = 32 << 20


def ranks_layout(
    kv_cache: torch.Tensor, ranks: tuple[tuple[torch.Tensor, int], ...], rank0: KVLayout
) -> KVLayout:
    """The layout of a tensor-parallel engine's whole KV: rank 0's, over every head."""
    if ranks[0][0] is not kv_cache:
        raise ValueError("ranks[0] must be the registered kv_cache (rank 0's)")
    heads: set[int] = set()
    for t, start in ranks:
        if not t.is_contiguous() or t.dtype != kv_cache.dtype or t.device != kv_cache.device:
            raise ValueError("every rank's cache must be contiguous, of one dtype and device")
        if t.dim() != 6 or t.shape[:4] != kv_cache.shape[:4] or t.shape[5] != kv_cache.shape[5]:
            raise ValueError(
                f"rank caches differ in more than their heads: {tuple(t.shape)} vs "
                f"{tuple(kv_cache.shape)}"
            )
        heads.update(range(start, start + int(t.shape[4])))
    if heads != set(range(len(heads))):
        raise ValueError(f"the ranks' KV heads {sorted(heads)} are not 0..N-1")
    return dataclasses.replace(rank0, num_kv_heads=len(heads))


def staging_buffer(
    current: torch.Tensor | None,
    block_bytes: int,
    device: torch.device,
    register: Callable[[torch.Tensor], None],
) -> torch.Tensor:
    """A staging buffer of `STAGING_BYTES`, or of one `block_bytes` block if larger: `current`
    if it is large enough, else a new uint8 one on `device`, returned once `register` (the
    transport's `_do_register_staging`) accepted it."""
    size = max(STAGING_BYTES, block_bytes)
    if current is not None and len(current) >= size:
        return current
    staging = torch.empty(size, dtype=torch.uint8, device=device)
    register(staging)
    return staging


@dataclasses.dataclass(frozen=True, slots=True)
class HeadReads:
    """Which reads a head-split hand-off makes (`plan_reads`).

    direct: (source, target) pairs: the target holds exactly the source's heads, read
        straight into it.
    staged: source -> (target, its first head to write, the source's first head to copy,
        heads) copies out of the source's whole blocks read into the staging buffer.
    fan_out: (from target, to target): a target holding the same heads as an earlier one
        gets them by a local copy from it, not a second read over the wire (replicated
        heads: MLA's latent on every rank, or dense KV heads past the ranks' count).
    """

    direct: tuple[tuple[int, int], ...]
    staged: dict[int, tuple[tuple[int, int, int, int], ...]]
    fan_out: tuple[tuple[int, int], ...]


def plan_reads(sources: Sequence[range], targets: Sequence[range]) -> HeadReads:
    """The reads giving each target (a reader rank cache's model KV heads) its heads from the
    first source (an owner rank cache's) holding each; every head crosses the wire once per
    distinct target head range, whatever the number of owner replicas or reader replicas:

        owner [h0 | h0]  -> reader [h0]       one read (from owner rank 0)
        owner [h0]       -> reader [h0 | h0]  one read, one local copy (reader rank 0 -> 1)
        owner [h0 | h0]  -> reader [h0 | h0]  one read, one local copy
    """
    owner: dict[int, int] = {}  # model KV head -> first source holding it
    for i, heads in enumerate(sources):
        for h in heads:
            owner.setdefault(h, i)
    direct: list[tuple[int, int]] = []
    staged: dict[int, list[tuple[int, int, int, int]]] = {}
    fan_out: list[tuple[int, int]] = []
    first: dict[range, int] = {}  # a head range -> the first target holding it
    for t, heads in enumerate(targets):
        if heads in first:
            fan_out.append((first[heads], t))
            continue
        first[heads] = t
        same = [i for i, src in enumerate(sources) if src == heads]
        if same:
            direct.append((same[0], t))
            continue
        h = heads.start
        while h < heads.stop:  # split the target's heads into runs of heads of one source
            i, end = owner[h], h + 1
            while end < heads.stop and owner[end] == i:
                end += 1
            staged.setdefault(i, []).append((t, h - heads.start, h - sources[i].start, end - h))
            h = end
    return HeadReads(tuple(direct), {i: tuple(c) for i, c in staged.items()}, tuple(fan_out))


def read_heads(
    sources: Sequence[range],
    targets: Sequence[tuple[torch.Tensor, int]],
    layout: KVLayout,
    remote_ids: Sequence[int],
    local_ids: Sequence[int],
    read_into: Callable[[int, list[tuple[int, int, int]], torch.Tensor], None],
    staging: Callable[[int], torch.Tensor],
) -> tuple[int, int]:
    """Read owner blocks `remote_ids[i]` into local blocks `local_ids[i]` of every target cache.

    As `plan_reads` plans: a target holding exactly one source's heads is read straight into
    (one descriptor per run); otherwise each source needed is read whole blocks at a time
    into the staging buffer (up to `STAGING_BYTES` a read) and its head ranges copied out; a
    target replicating an earlier one's heads is copied from it locally, after the reads.

    Args:
        sources: the model KV heads each of the owner's rank caches holds, rank 0 first
            (`RemoteKV.sources`).
        targets: this engine's rank caches, each with the first head it holds, rank 0's (the
            registered cache) first; an engine without ranks: its cache, at head 0.
        layout: this engine's layout over every head.
        remote_ids, local_ids: the block mapping, checked (equal lengths, local ids distinct
            and in range).
        read_into: `read_into(i, runs, dst)` copies runs of source i's blocks into blocks of
            the same size at `dst` (a target cache or the staging buffer).
        staging: `staging(block_bytes)`, the registered staging buffer (uint8, at least one
            block of `block_bytes`).

    Returns:
        (bytes moved over the transport, descriptors used); local fan-out copies are not
        counted.
    """
    heads = [range(start, start + int(cache.shape[4])) for cache, start in targets]
    plan = plan_reads(sources, heads)
    per_head = layout.block_bytes // layout.num_kv_heads
    moved, descriptors = 0, 0
    for i, t in plan.direct:
        runs = coalesce(remote_ids, local_ids)
        descriptors += len(runs)
        read_into(i, runs, targets[t][0])
        moved += len(local_ids) * per_head * len(sources[i])
    for i, copies in sorted(plan.staged.items()):
        num_heads = len(sources[i])
        src_bytes = per_head * num_heads
        buffer = staging(src_bytes)
        chunk = len(buffer) // src_bytes
        shape = (*targets[0][0].shape[1:4], num_heads, -1)
        for c in range(0, len(local_ids), chunk):
            chunk_ids = remote_ids[c : c + chunk]
            runs = coalesce(chunk_ids, range(len(chunk_ids)))
            descriptors += len(runs)
            read_into(i, runs, buffer)
            moved += len(chunk_ids) * src_bytes
            # rows: [len(chunk_ids), num_layers, 2, block_size, num_heads, head_dim bytes]
            rows = buffer[: len(chunk_ids) * src_bytes].view(len(chunk_ids), *shape)
            # Runs of consecutive local blocks: one strided slice copy each.
            local_runs = coalesce(range(len(chunk_ids)), local_ids[c : c + chunk])
            for t, dst_head, src_head, n in copies:
                dst = targets[t][0].view(torch.uint8)  # heads as bytes: dtype-agnostic
                for s0, d0, k in local_runs:
                    dst[d0 : d0 + k, :, :, :, dst_head : dst_head + n].copy_(
                        rows[s0 : s0 + k, :, :, :, src_head : src_head + n]
                    )
    for a, b in plan.fan_out:  # replicas: a local copy on this machine, not a wire read
        src, dst = targets[a][0], targets[b][0]
        for _, d0, k in coalesce(local_ids, local_ids):
            dst[d0 : d0 + k].copy_(src[d0 : d0 + k])
    return moved, descriptors
