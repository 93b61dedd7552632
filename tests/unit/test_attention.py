"""The CPU attention backend against the pure-torch reference in kernels/reference.py."""

from __future__ import annotations

import random

import pytest
import torch

from tandem.engine.runner import MIN_DECODE_GROUP_ROWS
from tandem.kernels import reference
from tandem.model.attention import AttentionMetadata, DecodeGroup, PrefillSpan, TorchAttention


def build_case(
    rng: random.Random,
    lens: list[tuple[int, int]],
    block_size: int,
    num_blocks: int,
    q_heads: int,
    kv_heads: int,
    dim: int = 16,
):
    """lens: (context_len, num_new) per request; decode rows are the num_new == 1 ones."""
    gen = torch.Generator().manual_seed(rng.randint(0, 10**6))
    kv = torch.randn(num_blocks, 2, block_size, kv_heads, dim, generator=gen)
    free = list(range(num_blocks))
    rng.shuffle(free)  # scattered, non-contiguous block ids, including the last ones
    tables = []
    for ctx, _ in lens:
        n = -(-ctx // block_size)
        tables.append([free.pop() for _ in range(n)])

    def is_decode(i: int) -> bool:
        return lens[i][1] == 1 and lens[i][0] > 1

    order = sorted(range(len(lens)), key=lambda i: not is_decode(i))  # decodes first
    total = sum(lens[i][1] for i in order)
    q = torch.randn(total, q_heads, dim, generator=gen)
    k = torch.randn(total, kv_heads, dim, generator=gen)
    v = torch.randn(total, kv_heads, dim, generator=gen)
    slot_blocks, slot_offsets, spans, decodes = [], [], [], []
    start = 0
    for i in order:
        ctx, new = lens[i]
        for pos in range(ctx - new, ctx):
            slot_blocks.append(tables[i][pos // block_size])
            slot_offsets.append(pos % block_size)
        if is_decode(i):
            decodes.append(i)
        else:
            spans.append(PrefillSpan(start, new, ctx, torch.tensor(tables[i])))
        start += new
    meta = AttentionMetadata(torch.tensor(slot_blocks), torch.tensor(slot_offsets), prefills=spans)
    if decodes:
        max_blocks = max(len(tables[i]) for i in decodes)
        padded = [tables[i] + [0] * (max_blocks - len(tables[i])) for i in decodes]
        ctx_t = torch.tensor([lens[i][0] for i in decodes])
        group = DecodeGroup.build(0, torch.tensor(padded), ctx_t, block_size)
        meta.decode_groups.append(group)
    return kv, tables, order, q, k, v, meta


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize(("q_heads", "kv_heads"), [(4, 2), (16, 8)])  # block-diagonal, per head
@pytest.mark.parametrize(
    ("window", "with_sinks"), [(1, False), (5, False), (8, True), (None, True)]
)
def test_sliding_window_and_sinks_match_reference(
    monkeypatch, block_size, q_heads, kv_heads, window, with_sinks
):
    """Sliding-window layers and sinks (Gemma 3, gpt-oss) against the float64 reference:
    decode rows whose windows start mid-block and past the first blocks, chunks after a
    cached prefix longer than the window, prefill tiles (made small) that each read their
    own keys."""
    import tandem.model.windowed as windowed

    monkeypatch.setattr(windowed, "PREFILL_TILE", 3)
    rng = random.Random(block_size * 7 + kv_heads + (window or 0))
    lens = [(1, 1), (7, 1), (33, 1), (5, 5), (19, 19), (23, 6), (40, 1), (12, 11)]
    kv, tables, order, q, k, v, meta = build_case(rng, lens, block_size, 512, q_heads, kv_heads)
    sinks = torch.randn(q_heads) * 2 if with_sinks else None
    out = TorchAttention().forward(q, k, v, kv, meta, 0.25, window, sinks)
    start = 0
    for i in order:
        ctx, new = lens[i]
        want = reference.paged_attention(
            q[start : start + new], kv, tables[i], ctx, 0.25, window, sinks
        )
        torch.testing.assert_close(out[start : start + new], want, atol=1e-5, rtol=1e-5)
        start += new
    if window is not None and window < 33:  # the window mattered: the full answer differs
        full = TorchAttention().forward(q, k, v, kv, meta, 0.25, None, sinks)
        assert not torch.allclose(full, out, atol=1e-3)


@pytest.mark.parametrize("block_size", [1, 4, 16])
# kv_heads 8: past BLOCK_DIAGONAL_MAX_KV_HEADS, the per-head decode products
@pytest.mark.parametrize(("q_heads", "kv_heads"), [(4, 4), (4, 2), (8, 1), (16, 8)])
def test_torch_attention_matches_reference(block_size, q_heads, kv_heads):
    rng = random.Random(block_size * 100 + q_heads * 10 + kv_heads)
    # ragged: length 1, non-multiples of the block size, chunks after a cached prefix
    lens = [(1, 1), (7, 1), (33, 1), (5, 5), (19, 19), (23, 6), (40, 1)]
    num_blocks = 4096  # large ids catch index arithmetic overflow
    kv, tables, order, q, k, v, meta = build_case(
        rng, lens, block_size, num_blocks, q_heads, kv_heads
    )
    out = TorchAttention().forward(q, k, v, kv, meta, scale=0.25)
    start = 0
    for i in order:
        ctx, new = lens[i]
        want = reference.paged_attention(q[start : start + new], kv, tables[i], ctx, 0.25)
        torch.testing.assert_close(out[start : start + new], want, atol=1e-5, rtol=1e-5)
        start += new


def test_new_keys_are_written_to_their_slots():
    rng = random.Random(0)
    kv, tables, order, q, k, v, meta = build_case(rng, [(6, 6)], 4, 8, 2, 2)
    TorchAttention().forward(q, k, v, kv, meta, scale=1.0)
    keys, vals = reference.gather_context(kv, tables[0], 6)
    torch.testing.assert_close(keys, k)
    torch.testing.assert_close(vals, v)


def test_decode_groups_are_independent():
    assert MIN_DECODE_GROUP_ROWS >= 1
    rng = random.Random(1)
    lens = [(30, 1), (3, 1), (12, 1)]
    kv, tables, order, q, k, v, meta = build_case(rng, lens, 4, 64, 4, 2)
    whole = TorchAttention().forward(q, k, v, kv.clone(), meta, scale=0.5)
    # the same rows split into three single-row groups
    [g] = meta.decode_groups
    meta.decode_groups = [
        DecodeGroup(i, i + 1, g.block_tables[i : i + 1], g.key_bias[i : i + 1]) for i in range(3)
    ]
    split = TorchAttention().forward(q, k, v, kv.clone(), meta, scale=0.5)
    torch.testing.assert_close(whole, split, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_block_diagonal_decode_equals_per_head_products(monkeypatch, dtype):
    """The block-diagonal queries' zeros add exact zeros: the per-head products' numbers
    (GQA 9 q heads over 3 KV heads, as SmolLM2), up to the order the CPU's GEMM sums in:
    bit for bit on an Intel Xeon (AMX), the last float32 bit apart on an AMD EPYC, whose BLAS
    blocks the wider product differently. A query in the wrong block is off by far more."""
    from tandem.model import attention

    rng = random.Random(7)
    lens = [(45, 1), (17, 1), (3, 1), (64, 1)]
    kv, tables, order, q, k, v, meta = build_case(rng, lens, 16, 256, 9, 3)
    kv, q, k, v = kv.to(dtype), q.to(dtype), k.to(dtype), v.to(dtype)
    diagonal = TorchAttention().forward(q, k, v, kv.clone(), meta, scale=0.125)
    monkeypatch.setattr(attention, "BLOCK_DIAGONAL_MAX_KV_HEADS", 0)
    per_head = TorchAttention().forward(q, k, v, kv.clone(), meta, scale=0.125)
    tol = 1e-6 if dtype == torch.float32 else 0.0
    torch.testing.assert_close(diagonal, per_head, atol=tol, rtol=tol)
