"""The paged MLA decode kernel (kernels/mla_decode.py) against its float64 reference in
kernels/reference.py and against tandem.model.mla.absorbed_decode (the CPU torch path).

Without a GPU the kernels run under Triton's interpreter (tests/conftest.py), so shapes stay
small: kv_lora_rank 32 + rope 8 (D = 20: the latent crosses into the V half), 16 heads,
plus one case at DeepSeek-V3's 512 + 64.

Tolerances (the reference computes in float64 and casts to the input dtype):
    fp32  atol = rtol = 1e-5    (seen: ~4e-7)
    bf16  atol = rtol = 1.6e-2  (bf16 inputs, p rounded to bf16 before P @ latent, as the
                                 dense decode kernel's tests allow)
"""

from __future__ import annotations

import math

import pytest
import torch

from tandem.kernels.mla_decode import latent_chunk, mla_decode_attention, mla_num_splits
from tandem.kernels.reference import mla_decode_context
from tests.kernels.compile_check import assert_lowers

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
TOLERANCES = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (1.6e-2, 1.6e-2)}
LAT, ROPE, HEADS = 32, 8, 16


def make_case(
    context_lens: list[int],
    *,
    block_size: int,
    dtype: torch.dtype,
    lat: int = LAT,
    rope: int = ROPE,
    heads: int = HEADS,
    num_blocks: int = 64,
    poison: bool = True,
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """q_lat, q_rot, kv_layer, block_tables, context_lens for a ragged batch.

    kv_layer is layer 1 of a 2-layer cache (strided across blocks). With `poison` every slot
    no row owns is NaN (padded table entries point at NaN block 0, the tail of each row's
    last block is NaN), so reading either poisons the output. Block ids are shuffled.
    """
    gen = torch.Generator().manual_seed(seed)
    half = (lat + rope) // 2
    fill = float("nan") if poison else 0.0
    cache = torch.full((num_blocks, 2, 2, block_size, 1, half), fill, dtype=dtype)
    kv_layer = cache[:, 1]
    ids = torch.cat(
        [torch.tensor([num_blocks - 1]), torch.randperm(num_blocks - 2, generator=gen) + 1]
    )
    max_blocks = max(math.ceil(n / block_size) for n in context_lens) + 1
    tables = torch.zeros(len(context_lens), max_blocks, dtype=torch.int32)
    used = 0
    for r, ctx in enumerate(context_lens):
        n = math.ceil(ctx / block_size)
        tables[r, :n] = ids[used : used + n]
        used += n
        for t in range(ctx):
            block, slot = int(tables[r, t // block_size]), t % block_size
            kv_layer[block, :, slot] = torch.randn(2, 1, half, generator=gen).to(dtype)
    rows = len(context_lens)
    q_lat = torch.randn(rows, heads, lat, generator=gen).to(dtype)
    q_rot = torch.randn(rows, heads, rope, generator=gen).to(dtype)
    lens = torch.tensor(context_lens, dtype=torch.int32)
    return (
        q_lat.to(DEVICE), q_rot.to(DEVICE), cache.to(DEVICE)[:, 1], tables.to(DEVICE),
        lens.to(DEVICE),
    )  # fmt: skip


def reference(q_lat, q_rot, kv, tables, lens, scale):  # type: ignore[no-untyped-def]
    kv_cpu = kv.cpu()
    return torch.stack([
        mla_decode_context(q_lat[r].cpu(), q_rot[r].cpu(), kv_cpu, tables[r].tolist(), int(n),
                           scale)
        for r, n in enumerate(lens.tolist())
    ]).to(q_lat.device)  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_splits", [1, 3, None])
@pytest.mark.parametrize("block_size", [4, 16])
def test_matches_reference(dtype: torch.dtype, num_splits: int | None, block_size: int) -> None:
    """Rows of 1 token, a block boundary, several blocks and longer than one split, in one
    batch (a short row's later splits are empty), over a NaN-poisoned scattered cache."""
    lens = [1, block_size, block_size + 1, 5 * block_size + 3, 150]
    q_lat, q_rot, kv, tables, ctx = make_case(lens, block_size=block_size, dtype=dtype)
    out = mla_decode_attention(q_lat, q_rot, kv, tables, ctx, 0.15, num_splits=num_splits)
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(out, reference(q_lat, q_rot, kv, tables, ctx, 0.15), atol=atol,
                               rtol=rtol)  # fmt: skip


@pytest.mark.parametrize("heads", [1, 20])
def test_heads_not_a_tile_multiple(heads: int) -> None:
    """A single head (padded to the 16-row tile) and 20 (two tiles, the second partial)."""
    q_lat, q_rot, kv, tables, ctx = make_case([7, 33], block_size=4, dtype=torch.float32,
                                              heads=heads)  # fmt: skip
    out = mla_decode_attention(q_lat, q_rot, kv, tables, ctx, 0.3, num_splits=2)
    torch.testing.assert_close(out, reference(q_lat, q_rot, kv, tables, ctx, 0.3), atol=1e-5,
                               rtol=1e-5)  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_deepseek_v3_shape(dtype: torch.dtype) -> None:
    """kv_lora_rank 512 + rope 64 (D = 288: latent chunks of 32, nine in K, seven in V)."""
    assert latent_chunk(288, 512) == 32
    q_lat, q_rot, kv, tables, ctx = make_case(
        [1, 40], block_size=16, dtype=dtype, lat=512, rope=64, num_blocks=8
    )
    out = mla_decode_attention(q_lat, q_rot, kv, tables, ctx, 576**-0.5, num_splits=2)
    atol, rtol = TOLERANCES[dtype]
    want = reference(q_lat, q_rot, kv, tables, ctx, 576**-0.5)
    torch.testing.assert_close(out, want, atol=atol, rtol=rtol)


def test_equals_absorbed_decode_context() -> None:
    """The kernel's context is tandem.model.mla.absorbed_decode's before W_UV (W_UK and W_UV
    identities, so its q_nope is q_lat and its output the context), within 1e-5 in fp32."""
    from tandem.model.attention import DecodeGroup
    from tandem.model.mla import MlaWeights, absorbed_decode

    lens = [1, 4, 13, 70]
    q_lat, q_rot, kv, tables, ctx = make_case(lens, block_size=4, dtype=torch.float32,
                                              poison=False)  # fmt: skip
    eye = torch.eye(LAT, device=DEVICE).expand(HEADS, LAT, LAT)
    w = MlaWeights(*(torch.empty(0),) * 6, w_uk=eye, w_uv=eye)  # type: ignore[arg-type]
    group = DecodeGroup.build(0, tables.long(), ctx.long(), 4)
    want = absorbed_decode(q_lat, q_rot, kv, group, w, LAT, 0.2)
    out = mla_decode_attention(q_lat, q_rot, kv, tables, ctx, 0.2)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)


def test_split_choice_and_empty_batch() -> None:
    # one row x 8 head tiles: 17 splits fill 132 SMs (more than 256 blocks in runs of 16)
    assert mla_num_splits(1, 128, 256, 132) == 17
    assert mla_num_splits(64, 128, 4, 132) == 1
    q_lat, q_rot, kv, tables, ctx = make_case([5], block_size=4, dtype=torch.float32)
    out = mla_decode_attention(q_lat[:0], q_rot[:0], kv, tables[:0], ctx[:0], 1.0)
    assert out.shape == (0, HEADS, LAT)


def test_rejects_bad_inputs() -> None:
    q_lat, q_rot, kv, tables, ctx = make_case([5], block_size=4, dtype=torch.float32)
    with pytest.raises(ValueError, match="must fill the cache's two halves"):
        mla_decode_attention(q_lat[..., :16], q_rot, kv, tables, ctx, 1.0)
    with pytest.raises(ValueError, match="must share one of"):
        mla_decode_attention(q_lat.half(), q_rot, kv, tables, ctx, 1.0)
    with pytest.raises(ValueError, match="context_lens dtype torch.int64"):
        mla_decode_attention(q_lat, q_rot, kv, tables, ctx.long(), 1.0)
    with pytest.raises(ValueError, match="num_splits 0"):
        mla_decode_attention(q_lat, q_rot, kv, tables, ctx, 1.0, num_splits=0)


# Compiles both kernels for sm_90a with the wrapper's configuration and the alignment a
# launch specialises on (tests/kernels/compile_check.py; no GPU needed). The split kernel's
# loop must be pipelined (cp.async) with no spills.
LOWER_SCRIPT = r"""
import torch
import triton

from tandem.kernels.mla_decode import (
    _MIN_DOT_DIM, _mla_reduce_kernel, _mla_split_kernel, head_tile, latent_chunk, mla_tiles,
)
from tests.kernels.compile_check import aligned_attrs, compile_sm90, ptxas_usage

names = _mla_split_kernel.arg_names
aligned = [n for n in names if n.endswith("_ptr") or n.startswith(("stride_q", "stride_kv"))]
for dtype in ("bf16", "fp16", "fp32"):
    for lat, rope, heads, block_size in ((512, 64, 128, 16), (512, 64, 128, 64), (32, 8, 16, 16)):
        half = (lat + rope) // 2
        chunk = latent_chunk(half, lat)
        tiles = mla_tiles(lat)
        constants = dict(
            LAT=lat, ROPE=rope, HALF=half, CHUNK=chunk,
            NUM_CHUNKS_PAD=max(triton.next_power_of_2(lat // chunk), -(-_MIN_DOT_DIM // chunk)),
            ROPE_PAD=max(triton.next_power_of_2(rope), _MIN_DOT_DIM), BLOCK_H=head_tile(heads),
            BLOCK_SIZE=block_size, TILE=tiles.tile, NUM_STAGES=tiles.num_stages,
            UPCAST=False,
        )
        signature = {}
        for name in names:
            if name in constants:
                signature[name] = "constexpr"
            elif name in ("q_lat_ptr", "q_rot_ptr", "kv_ptr"):
                signature[name] = "*" + dtype
            elif name in ("part_out_ptr", "part_lse_ptr"):
                signature[name] = "*fp32"
            elif name.endswith("_ptr"):
                signature[name] = "*i32"
            elif name == "scale":
                signature[name] = "fp32"
            else:
                signature[name] = "i64" if name == "stride_kv_block" else "i32"
        kernel = compile_sm90(
            _mla_split_kernel, signature, constants, aligned_attrs(_mla_split_kernel, aligned),
            num_warps=tiles.num_warps, enable_fp_fusion=True,
        )
        ptx = kernel.asm["ptx"]
        assert "cp.async" in ptx, f"{dtype} {lat}: the loop is not pipelined"
        registers, spills = ptxas_usage(ptx)
        assert spills == 0, (dtype, lat, block_size, registers, spills)
        print(dtype, lat, rope, block_size, registers, "registers ok")
    signature = {
        "part_out_ptr": "*fp32", "part_lse_ptr": "*fp32", "out_ptr": "*" + dtype,
        "stride_out_req": "i32", "stride_out_head": "i32", "num_splits": "i32",
        "LAT": "constexpr", "LAT_PAD": "constexpr", "SPLITS_PAD": "constexpr",
    }
    ptrs = ["part_out_ptr", "part_lse_ptr", "out_ptr"]
    kernel = compile_sm90(
        _mla_reduce_kernel, signature, dict(LAT=512, LAT_PAD=512, SPLITS_PAD=32),
        aligned_attrs(_mla_reduce_kernel, ptrs), num_warps=4, enable_fp_fusion=True,
    )
    assert "cubin" in kernel.asm
    print(dtype, "reduce ok")
"""


def test_lowers_for_sm90_pipelined_without_spills() -> None:
    """The interpreter runs programs the GPU compiler rejects: compile for a real target."""
    assert_lowers(LOWER_SCRIPT, 3 * 3 + 3)
