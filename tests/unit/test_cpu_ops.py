"""The native paged CPU decode attention (kernels/cpu_ops.py) against the torch
path it replaces and the kernels' reference: ragged contexts read from blocks in place."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch

from tandem.kernels import cpu_ops, reference
from tandem.model.attention import DecodeGroup, TorchAttention


@pytest.fixture(scope="module")
def lib():  # type: ignore[no-untyped-def]
    built = cpu_ops.load()
    assert built is not None, "a C compiler is here: the kernel must build"
    return built


def _case(rng: random.Random, lens: list[int], block_size: int, q_heads: int, kv_heads: int,
          dim: int, dtype: torch.dtype):  # type: ignore[no-untyped-def]  # fmt: skip
    num_blocks, num_layers = 512, 3
    gen = torch.Generator().manual_seed(rng.randrange(1 << 30))
    # the engine's cache: [blocks, layers, 2, block_size, kv_heads, dim]; layer 1's K and V
    cache = torch.randn(num_blocks, num_layers, 2, block_size, kv_heads, dim, generator=gen)
    cache = cache.to(dtype)
    ids = rng.sample(range(num_blocks), sum(-(-n // block_size) for n in lens))
    max_blocks = max(-(-n // block_size) for n in lens)
    tables, used = [], 0
    for n in lens:
        k = -(-n // block_size)
        tables.append(ids[used : used + k] + [0] * (max_blocks - k))
        used += k
    q = torch.randn(len(lens), q_heads, dim, generator=gen).to(dtype)
    return cache, torch.tensor(tables), torch.tensor(lens), q


@pytest.mark.parametrize("vector", [True, False], ids=["vector", "plain"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [1, 16, 24])
@pytest.mark.parametrize(
    ("q_heads", "kv_heads", "dim"), [(9, 3, 64), (4, 4, 32), (8, 1, 128), (12, 2, 96)]
)
def test_native_decode_matches_the_reference(
    lib, vector, dtype, block_size, q_heads, kv_heads, dim
):  # type: ignore[no-untyped-def]
    """Both paths (the AVX512-BF16 products where built, and the plain loops): groups of 1,
    3, 6 and 8 query heads per KV head (the vector path takes them 4 at a time), head dims
    32-128 (64 columns at a time), blocks of 1, 16 and 24 tokens (16-key tiles that end at a
    block's end)."""
    rng = random.Random(block_size * 1000 + q_heads * 10 + kv_heads)
    lens = [1, 7, 33, block_size * 3, 300]  # one key, non-multiples, a full last block
    cache, tables, ctx, q = _case(rng, lens, block_size, q_heads, kv_heads, dim, dtype)
    layer = cache[:, 1]
    out = cpu_ops.decode_attention(
        lib, q, layer[:, 0], layer[:, 1], tables, ctx, 0.125, vector=vector
    )
    assert out.dtype == dtype and tuple(out.shape) == (len(lens), q_heads, dim)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    for i, n in enumerate(lens):
        k_rows, v_rows = reference.gather_context(layer.float(), tables[i].tolist(), n)
        want = _attend(q[i].float(), k_rows, v_rows, 0.125)
        torch.testing.assert_close(out[i].float(), want, atol=tol, rtol=tol)


@pytest.mark.parametrize("vector", [True, False], ids=["vector", "plain"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize(("window", "with_sinks"), [(1, False), (20, False), (20, True), (0, True)])
def test_native_decode_windows_and_sinks(lib, vector, dtype, block_size, window, with_sinks):  # type: ignore[no-untyped-def]
    """Sliding windows (starting mid-block; the blocks before them poisoned with NaN, so a
    read of one fails) and gpt-oss's sinks, against the float64 reference."""
    rng = random.Random(block_size * 31 + window)
    lens = [1, 7, 33, 300]
    cache, tables, ctx, q = _case(rng, lens, block_size, 8, 2, 64, dtype)
    layer = cache[:, 1]
    if window:
        for i, n in enumerate(lens):
            first_block = max(0, n - window) // block_size
            layer[tables[i, :first_block]] = float("nan")
    sinks = torch.randn(8, generator=torch.Generator().manual_seed(3)) * 2 if with_sinks else None
    out = cpu_ops.decode_attention(
        lib, q, layer[:, 0], layer[:, 1], tables, ctx, 0.125, vector=vector,
        window=window or None, sinks=sinks,
    )  # fmt: skip
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    for i, n in enumerate(lens):
        want = reference.paged_attention(
            q[i : i + 1].float(), layer.float(), tables[i].tolist(), n, 0.125,
            window or None, sinks,
        )[0]  # fmt: skip
        torch.testing.assert_close(out[i].float(), want, atol=tol, rtol=tol)


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """q [heads, dim], k/v [ctx, kv_heads, dim]: softmax attention, GQA by repetition."""
    group = q.shape[0] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    probs = torch.softmax(torch.einsum("hd,thd->ht", q, k) * scale, dim=-1)
    return torch.einsum("ht,thd->hd", probs, v)


def test_native_and_torch_decode_agree_and_rows_are_batch_independent(lib):
    """The backend's two decode paths agree; each row's result is the same alone or in a
    batch (disaggregated and colocated serving batch rows differently)."""
    rng = random.Random(3)
    lens = [45, 17, 3, 64]
    cache, tables, ctx, q = _case(rng, lens, 16, 9, 3, 64, torch.bfloat16)
    k_cache, v_cache = cache[:, 2, 0], cache[:, 2, 1]
    group = DecodeGroup.build(0, tables, ctx, 16)
    native = TorchAttention(lib)._decode(q, k_cache, v_cache, group, 0.125)
    plain = TorchAttention()._decode(q, k_cache, v_cache, group, 0.125)
    torch.testing.assert_close(native.float(), plain.float(), atol=2e-2, rtol=2e-2)
    for i in range(len(lens)):
        alone = cpu_ops.decode_attention(
            lib, q[i : i + 1], k_cache, v_cache, tables[i : i + 1], ctx[i : i + 1], 0.125
        )
        assert torch.equal(alone[0], native[i])


def test_the_bf16_products_are_built_where_the_cpu_has_them(lib):
    """-march=native on a CPU with AVX512-BF16 must compile the vector path in (a build
    that silently drops it is correct but slow)."""
    flags = Path("/proc/cpuinfo").read_text().split() if Path("/proc/cpuinfo").exists() else []
    wanted = {"avx512f", "avx512_bf16"} <= set(flags)
    assert cpu_ops.has_bf16_dot(lib) == wanted


def test_the_vector_and_plain_paths_agree(lib):
    """bfloat16, the engine's shape: the two paths differ only in summation order."""
    rng = random.Random(11)
    lens = [5, 16, 17, 250]
    cache, tables, ctx, q = _case(rng, lens, 16, 9, 3, 64, torch.bfloat16)
    k_cache, v_cache = cache[:, 0, 0], cache[:, 0, 1]
    fast = cpu_ops.decode_attention(lib, q, k_cache, v_cache, tables, ctx, 0.125)
    plain = cpu_ops.decode_attention(lib, q, k_cache, v_cache, tables, ctx, 0.125, vector=False)
    torch.testing.assert_close(fast.float(), plain.float(), atol=1e-2, rtol=1e-2)


def test_unsupported_inputs_keep_the_torch_path(lib):
    q = torch.randn(1, 4, 32)
    cache = torch.randn(8, 4, 2, 32)
    assert cpu_ops.supports(q, cache)
    assert not cpu_ops.supports(q.half(), cache.half())  # dtype
    big = torch.randn(1, 4, 512)  # head_dim past MAX_HEAD_DIM
    assert not cpu_ops.supports(big, torch.randn(8, 4, 2, 512))
    group = DecodeGroup(0, 1, torch.zeros(1, 1, dtype=torch.int64), torch.zeros(1, 1, 4))
    # no context lengths (a group built by hand): torch ops, the same answer as before
    out = TorchAttention(lib)._decode(q, cache, cache, group, 1.0)
    torch.testing.assert_close(out, TorchAttention()._decode(q, cache, cache, group, 1.0))


@pytest.mark.parametrize(("rows", "dim"), [(1, 576), (16, 576), (3, 4100)])
def test_fused_add_rms_norm_is_bitwise_the_torch_ops(lib, rows, dim):
    """bfloat16: h + y, then transformers' RMSNorm (the normalized row rounded before the
    weight), as one call: the same bits as the torch ops, h updated in place."""
    from tandem.model.llama import rms_norm

    gen = torch.Generator().manual_seed(rows * dim)
    h = (torch.randn(rows, dim, generator=gen) * 3).bfloat16()
    y = torch.randn(rows, dim, generator=gen).bfloat16()
    w = torch.randn(dim, generator=gen).bfloat16()
    fused_h = h.clone()
    out = cpu_ops.add_rms_norm(lib, fused_h, y, w, 1e-5)
    assert torch.equal(fused_h, h + y)
    assert torch.equal(out, rms_norm(h + y, w, 1e-5))
    alone = cpu_ops.add_rms_norm(lib, h.clone(), None, w, 1e-5)
    assert torch.equal(alone, rms_norm(h, w, 1e-5))
    with pytest.raises(ValueError, match="bfloat16"):
        cpu_ops.add_rms_norm(lib, h.float(), None, w, 1e-5)


def test_native_rope_is_bitwise_apply_rotary(lib):
    """bfloat16 query and key heads (a strided view, as the model's qkv split gives) rotated
    in one call: the same bits as tandem.model.rope.apply_rotary."""
    from tandem.model.rope import apply_rotary

    gen = torch.Generator().manual_seed(5)
    qkv = (torch.randn(7, 15 * 64, generator=gen) * 2).bfloat16()
    qk = qkv[:, : 12 * 64].view(7, 12, 64)  # rows strided by 15 heads
    cos = torch.randn(7, 1, 64, generator=gen).bfloat16()
    sin = torch.randn(7, 1, 64, generator=gen).bfloat16()
    assert torch.equal(cpu_ops.rope(lib, qk, cos, sin), apply_rotary(qk, cos, sin))
    with pytest.raises(ValueError, match="bfloat16"):
        cpu_ops.rope(lib, qk.float(), cos, sin)


def test_writes_into_the_given_rows_and_refuses_contexts_past_the_table(lib):
    rng = random.Random(5)
    lens = [9, 30]
    cache, tables, ctx, q = _case(rng, lens, 16, 9, 3, 64, torch.bfloat16)
    k_cache, v_cache = cache[:, 0, 0], cache[:, 0, 1]
    want = cpu_ops.decode_attention(lib, q, k_cache, v_cache, tables, ctx, 0.125)
    layer_out = torch.zeros(5, 9, 64, dtype=torch.bfloat16)  # the rows land at 1 and 2
    got = cpu_ops.decode_attention(lib, q, k_cache, v_cache, tables, ctx, 0.125, out=layer_out[1:3])
    assert got.data_ptr() == layer_out[1].data_ptr()
    assert torch.equal(layer_out[1:3], want)
    assert not layer_out[0].any() and not layer_out[3:].any()
    with pytest.raises(ValueError, match="must be contiguous"):
        cpu_ops.decode_attention(
            lib, q, k_cache, v_cache, tables, ctx, 0.125, out=layer_out[:, :, :64:2]
        )
    # 2 blocks of 16 hold 32 keys: 33 (or 0) would read past the row's table
    for bad in (33, 0):
        with pytest.raises(ValueError, match=r"must lie in \[1, 2 blocks of 16\]"):
            cpu_ops.decode_attention(
                lib, q, k_cache, v_cache, tables, torch.tensor([9, bad]), 0.125
            )
