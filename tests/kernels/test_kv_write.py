"""The K/V slot-write kernel against `tandem.kernels.reference.write_kv_reference`.

A write is a copy, so kernel and reference must agree bit for bit (assert_close with zero
tolerance), on the whole cache: every other slot, layer and block must keep its bytes.
On a machine without a GPU the kernel runs under Triton's interpreter (tests/conftest.py).
"""

from __future__ import annotations

import pytest
import torch

from tandem.kernels.kv_write import write_kv
from tandem.kernels.reference import write_kv_reference
from tests.kernels.compile_check import assert_lowers

NUM_LAYERS = 2  # writes go to layer 1: a strided view, as kv_cache[:, layer] is


def random_slots(
    gen: torch.Generator, num_tokens: int, num_blocks: int, block_size: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """Distinct (block, offset) slots scattered over the cache."""
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    return (slots // block_size).to(dtype), (slots % block_size).to(dtype)


def check_write(
    num_tokens: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    index_dtype: torch.dtype = torch.int64,
    num_blocks: int = 16,
) -> None:
    gen = torch.Generator().manual_seed(num_tokens * 100 + head_dim)
    shape = (num_blocks, NUM_LAYERS, 2, block_size, num_kv_heads, head_dim)
    cache = torch.randn(shape, generator=gen).to(dtype)
    expected = cache.clone()
    k = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype)
    block_ids, offsets = random_slots(gen, num_tokens, num_blocks, block_size, index_dtype)

    write_kv(k, v, cache[:, 1], block_ids, offsets)
    write_kv_reference(k, v, expected[:, 1], block_ids, offsets)
    torch.testing.assert_close(cache, expected, atol=0.0, rtol=0.0)


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("num_tokens", [1, 15, 33])
def test_matches_reference(num_tokens: int, block_size: int) -> None:
    check_write(num_tokens, num_kv_heads=2, head_dim=64, block_size=block_size, dtype=torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_dtypes(dtype: torch.dtype, index_dtype: torch.dtype) -> None:
    check_write(
        9, num_kv_heads=2, head_dim=128, block_size=16, dtype=dtype, index_dtype=index_dtype
    )


@pytest.mark.parametrize(
    "num_kv_heads, head_dim",
    [
        (1, 64),
        (3, 24),  # neither is a power of two: masked heads and dims
        (40, 128),  # 5120 elements a token: two head tiles, the second one masked
    ],
)
def test_head_shapes(num_kv_heads: int, head_dim: int) -> None:
    check_write(5, num_kv_heads, head_dim, block_size=16, dtype=torch.float16)


def test_strided_k_v() -> None:
    """k and v as views into a fused qkv projection output (token stride > heads * dim)."""
    gen = torch.Generator().manual_seed(1)
    num_tokens, q_heads, kv_heads, dim = 6, 8, 2, 64
    qkv = torch.randn(num_tokens, q_heads + 2 * kv_heads, dim, generator=gen)
    k, v = qkv[:, q_heads : q_heads + kv_heads], qkv[:, q_heads + kv_heads :]
    cache = torch.zeros(8, NUM_LAYERS, 2, 16, kv_heads, dim)
    expected = cache.clone()
    block_ids, offsets = random_slots(gen, num_tokens, 8, 16, torch.int64)
    write_kv(k, v, cache[:, 0], block_ids, offsets)
    write_kv_reference(k, v, expected[:, 0], block_ids, offsets)
    torch.testing.assert_close(cache, expected, atol=0.0, rtol=0.0)


def test_high_block_ids() -> None:
    # Block stride 2 layers * 2 * 16 * 2 * 64 = 8192 elements: ids above 2**31 / 8192 =
    # 262144 put their slots past int32 element offsets. The fp16 cache spans 4 GiB of
    # address space, but only the written blocks are ever touched. int32 ids: the kernel
    # must widen them itself.
    num_blocks = 2**18 + 64
    cache = torch.empty(num_blocks, NUM_LAYERS, 2, 16, 2, 64, dtype=torch.float16)
    kv_layer = cache[:, 1]
    gen = torch.Generator().manual_seed(2)
    block_ids = torch.tensor([num_blocks - 1, num_blocks - 1, num_blocks - 40], dtype=torch.int32)
    offsets = torch.tensor([0, 15, 7], dtype=torch.int32)
    assert int(block_ids.min()) * kv_layer.stride(0) >= 2**31
    k = torch.randn(3, 2, 64, generator=gen).half()
    v = torch.randn(3, 2, 64, generator=gen).half()
    write_kv(k, v, kv_layer, block_ids, offsets)
    torch.testing.assert_close(kv_layer[block_ids.long(), 0, offsets.long()], k, atol=0.0, rtol=0.0)
    torch.testing.assert_close(kv_layer[block_ids.long(), 1, offsets.long()], v, atol=0.0, rtol=0.0)


def test_no_tokens() -> None:
    cache = torch.zeros(4, 2, 16, 2, 64)
    empty = torch.zeros(0, 2, 64)
    write_kv(
        empty, empty, cache, torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int64)
    )
    assert not cache.any()


def _valid_args() -> dict[str, torch.Tensor]:
    return dict(
        k=torch.zeros(3, 2, 64),
        v=torch.zeros(3, 2, 64),
        kv_layer=torch.zeros(4, 2, 16, 2, 64),
        slot_block_ids=torch.zeros(3, dtype=torch.int64),
        slot_offsets=torch.zeros(3, dtype=torch.int64),
    )


BAD_ARGS = {
    "k-2d": (dict(k=torch.zeros(3, 128)), r"k \(3, 128\) and v \(3, 2, 64\)"),
    "v-shape": (dict(v=torch.zeros(4, 2, 64)), r"got k \(3, 2, 64\) and v \(4, 2, 64\)"),
    "kv-heads": (
        dict(kv_layer=torch.zeros(4, 2, 16, 4, 64)),
        r"\[num_blocks, 2, block_size, 2, 64\] .* got \(4, 2, 16, 4, 64\)",
    ),
    "dtype-mismatch": (dict(k=torch.zeros(3, 2, 64).half()), r"float16, torch.float32"),
    "dtype-unsupported": (
        {name: torch.zeros(s).double() for name, s in (("k", (3, 2, 64)), ("v", (3, 2, 64)))}
        | dict(kv_layer=torch.zeros(4, 2, 16, 2, 64).double()),
        r"float64",
    ),
    "ids-length": (dict(slot_block_ids=torch.zeros(2, dtype=torch.int64)), r"\[3\], got \(2,\)"),
    "ids-float": (dict(slot_offsets=torch.zeros(3)), r"slot_offsets must be int32 or int64"),
    "device": (dict(slot_offsets=torch.zeros(3, dtype=torch.int64, device="meta")), r"meta"),
    "strided-dim": (dict(k=torch.zeros(3, 2, 128)[:, :, ::2]), r"'k': 2"),
}


@pytest.mark.parametrize("override, match", BAD_ARGS.values(), ids=BAD_ARGS.keys())
def test_rejects_bad_arguments(override: dict[str, torch.Tensor], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        write_kv(**{**_valid_args(), **override})


# Compiles the kernel for sm_90 (Triton's own LLVM and ptxas, no GPU needed) in a fresh
# interpreter without TRITON_INTERPRET. Exit code 3: this Triton cannot target CUDA.
LOWER_SCRIPT = r"""
from tandem.kernels.kv_write import _write_kv_kernel
from tests.kernels.compile_check import compile_sm90

# (k/v dtype, cache dtype): an fp8 cache quantizes 16-bit k/v on the way in.
for dtype, cache in (("fp16", "fp16"), ("bf16", "bf16"), ("fp32", "fp32"), ("bf16", "fp8e4nv")):
    for index in ("i32", "i64"):
        constants = dict(BLOCK_H=4, BLOCK_D=128, FP8=cache == "fp8e4nv")
        signature = {}
        for name in _write_kv_kernel.arg_names:
            if name in constants:
                signature[name] = "constexpr"
            elif name.startswith("slot_"):
                signature[name] = "*" + index
            elif name == "cache_ptr":
                signature[name] = "*" + cache
            elif name.endswith("_ptr"):
                signature[name] = "*" + dtype
            elif name in ("k_scale", "v_scale"):
                signature[name] = "fp32"
            else:
                signature[name] = "i64" if name == "stride_c_block" else "i32"
        kernel = compile_sm90(_write_kv_kernel, signature, constants, enable_fp_fusion=True)
        assert "cubin" in kernel.asm
        print(dtype, cache, index, "ok")
"""


def test_lowers_for_sm90() -> None:
    """The interpreter runs programs the GPU compiler rejects: compile for a real target."""
    assert_lowers(LOWER_SCRIPT, 8)
