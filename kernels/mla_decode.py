"""Paged MLA decode: DeepSeek-V3's absorbed attention over the latent cache (flash-decoding).

An MLA layer's cache has one KV "head" whose K and V halves together hold each token's
entry [latent (kv_lora_rank) | k_rot (qk_rope_head_dim)], D = entry / 2 numbers in each
half (tandem.model.mla):

    entry  = [ latent[0 : D] | latent[D : LAT] | k_rot ]      (LAT = kv_lora_rank >= D)
              '--- K half ---' '--------- V half --------'

Every query head attends to the same entries (multi-query attention), each with its
absorbed query [q_lat (LAT) | q_rot (ROPE)]:

    score[h, t] = (q_lat[h] . latent[t] + q_rot[h] . k_rot[t]) * scale
    context[h]  = softmax(score[h]) @ latent                  [LAT], in fp32, out in q's dtype

W_UV and o_proj stay torch matmuls outside the kernel. Two kernels, as in
kernels/decode_attention.py: the first splits each row's context into `num_splits` runs of
TILE-token tiles (a token's block from the table, so tiles ignore block boundaries); a
program handles one (row, tile of BLOCK_H heads, split), so each entry is loaded once per
tile of heads, and writes the split's normalized partial context and log-sum-exp. The
second combines the splits. The grid, (rows, head tiles, num_splits), depends on
shapes only; the split count on the longest context (`choose_num_splits`).

The latent is read as NUM_CHUNKS chunks of CHUNK columns, each inside one half (CHUNK
divides D and LAT), so every chunk is one contiguous run of the cache: a [TILE, NUM_CHUNKS,
CHUNK] offset tensor, flattened to [TILE, LAT_PAD], loads with vector accesses.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from tandem.kernels.decode_attention import check_tables, choose_num_splits, is_pow2

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Tensor-core dots need every dimension >= 16 on NVIDIA GPUs: heads, tokens, latent and rope
# are padded to it (masked rows and columns cost registers, not memory traffic).
_MIN_DOT_DIM = 16
# Query heads per program: 16 rows is the smallest tensor-core tile, so a wider tile only
# trades registers (its [BLOCK_H, LAT] accumulator) for fewer re-reads, which the L2 serves.
MAX_BLOCK_H = 16
# The widest contiguous run a latent chunk is read as (128 bytes of bf16).
MAX_CHUNK = 64


class MlaTiles(NamedTuple):
    """Launch configuration of the split kernel."""

    tile: int  # tokens read per loop iteration
    num_stages: int  # loop iterations whose loads are in flight at once
    num_warps: int


def mla_tiles(kv_lora_rank: int) -> MlaTiles:
    """16 tokens of entries per iteration (a [16, 576] bf16 tile is 18 KiB of shared memory
    per stage), two stages; 8 warps for DeepSeek-V3's 512-wide latent, whose [16, 512] fp32
    accumulator and tile share the registers (sm_90a: 127 a thread in bf16, no spills). Not
    yet tuned on a GPU."""
    return MlaTiles(tile=16, num_stages=2, num_warps=8 if kv_lora_rank >= 256 else 4)


def latent_chunk(half: int, kv_lora_rank: int) -> int:
    """The largest power of two <= MAX_CHUNK dividing both D and kv_lora_rank: no chunk of
    the latent straddles the K/V boundary."""
    chunk = 1
    while chunk < MAX_CHUNK and half % (chunk * 2) == 0 and kv_lora_rank % (chunk * 2) == 0:
        chunk *= 2
    return chunk


# The kernels' arguments carry no annotations: Triton derives their types at launch.
@triton.jit(do_not_specialize=["stride_bt_req"])
def _mla_split_kernel(  # type: ignore[no-untyped-def]
    q_lat_ptr,  # [rows, heads, LAT]
    q_rot_ptr,  # [rows, heads, ROPE]
    kv_ptr,  # [num_blocks, 2, block_size, 1, HALF], any strides but the last
    block_tables_ptr,  # [rows, max_blocks] int32
    context_lens_ptr,  # [rows] int32, >= 1
    part_out_ptr,  # [rows, heads, num_splits, LAT] fp32, out: normalized partial contexts
    part_lse_ptr,  # [rows, heads, num_splits] fp32, out: log-sum-exp (-inf: empty split)
    scale,  # softmax scale (fp32)
    num_heads,  # query heads
    stride_ql_req,
    stride_ql_head,  # q_lat.stride(2) is 1
    stride_qr_req,
    stride_qr_head,  # q_rot.stride(2) is 1
    stride_kv_block,  # kv.stride(0): may be large (all layers of a block), used in int64
    stride_kv_kv,  # kv.stride(1): K half -> V half
    stride_kv_tok,  # kv.stride(2)
    stride_bt_req,
    stride_bt_blk,
    stride_cl,
    LAT: tl.constexpr,  # kv_lora_rank
    ROPE: tl.constexpr,  # qk_rope_head_dim
    HALF: tl.constexpr,  # D = (LAT + ROPE) / 2, <= LAT
    CHUNK: tl.constexpr,  # latent columns per contiguous run (divides HALF and LAT)
    NUM_CHUNKS_PAD: tl.constexpr,  # LAT // CHUNK padded to a power of two
    ROPE_PAD: tl.constexpr,  # ROPE padded to a power of two >= 16
    BLOCK_H: tl.constexpr,  # heads per program, power of two >= 16
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block, power of two
    TILE: tl.constexpr,  # tokens read per loop iteration, power of two >= 16
    NUM_STAGES: tl.constexpr,
    UPCAST: tl.constexpr,  # compute on fp32 copies (bf16 under the interpreter)
):
    req = tl.program_id(0)
    head_tile = tl.program_id(1)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)

    # Tiles [start, end) of TILE tokens of this row belong to this split; empty past it.
    context_len = tl.load(context_lens_ptr + req * stride_cl)
    num_tiles = tl.cdiv(context_len, TILE)
    tiles_per_split = tl.cdiv(num_tiles, num_splits)
    start = split * tiles_per_split
    end = tl.minimum(start + tiles_per_split, num_tiles)

    heads = head_tile * BLOCK_H + tl.arange(0, BLOCK_H)
    h_valid = heads < num_heads
    rows = (req.to(tl.int64) * num_heads + heads) * num_splits + split  # [BLOCK_H]
    if start >= end:  # past this row's context: no partial, skipped by its lse
        tl.store(part_lse_ptr + rows, tl.full([BLOCK_H], float("-inf"), tl.float32), h_valid)
        return

    # Latent column c = chunk * CHUNK + i: K half at c while c < HALF, else V half at c - HALF.
    LAT_PAD: tl.constexpr = NUM_CHUNKS_PAD * CHUNK
    chunk = tl.arange(0, NUM_CHUNKS_PAD)
    c0 = chunk * CHUNK
    chunk_off = tl.where(c0 < HALF, c0, stride_kv_kv + c0 - HALF)  # [NUM_CHUNKS_PAD]
    col = tl.reshape(c0[:, None] + tl.arange(0, CHUNK)[None, :], [LAT_PAD])
    col_off = tl.reshape(chunk_off[:, None] + tl.arange(0, CHUNK)[None, :], [LAT_PAD])
    col_valid = col < LAT
    # k_rot: all in the V half, after its LAT - HALF latent columns.
    r = tl.arange(0, ROPE_PAD)
    r_valid = r < ROPE
    rot_off = stride_kv_kv + (LAT - HALF) + r

    q_lat = tl.load(
        q_lat_ptr
        + req.to(tl.int64) * stride_ql_req
        + heads[:, None] * stride_ql_head
        + col[None, :],
        mask=h_valid[:, None] & col_valid[None, :],
        other=0.0,
    )  # [BLOCK_H, LAT_PAD]; padded rows and columns are 0 (finite scores)
    q_rot = tl.load(
        q_rot_ptr + req.to(tl.int64) * stride_qr_req + heads[:, None] * stride_qr_head + r[None, :],
        mask=h_valid[:, None] & r_valid[None, :],
        other=0.0,
    )  # [BLOCK_H, ROPE_PAD]
    if UPCAST:
        q_lat = q_lat.to(tl.float32)
        q_rot = q_rot.to(tl.float32)
    qk_scale = scale * 1.4426950408889634  # log2 domain: exp2 is the cheaper op

    table = block_tables_ptr + req.to(tl.int64) * stride_bt_req
    m = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l_sum = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, LAT_PAD], dtype=tl.float32)
    for tile in tl.range(start, end, num_stages=NUM_STAGES):
        # Each token's block from the table (a tile spans blocks, or part of one: a tile of
        # whole 64-token blocks spills at LAT 512), then its entry from the block's base.
        pos = tile * TILE + tl.arange(0, TILE)
        tok_valid = pos < context_len  # nothing past the context is read
        block_ids = tl.load(table + (pos // BLOCK_SIZE) * stride_bt_blk, mask=tok_valid, other=0)
        # int64 before the multiply: block_id * stride_kv_block can exceed 2**31.
        toks = block_ids.to(tl.int64) * stride_kv_block + (pos % BLOCK_SIZE) * stride_kv_tok
        latent = tl.load(
            kv_ptr + toks[:, None] + col_off[None, :],
            mask=tok_valid[:, None] & col_valid[None, :],
            other=0.0,
        )  # [TILE, LAT_PAD]
        k_rot = tl.load(
            kv_ptr + toks[:, None] + rot_off[None, :],
            mask=tok_valid[:, None] & r_valid[None, :],
            other=0.0,
        )  # [TILE, ROPE_PAD]
        if UPCAST:
            latent = latent.to(tl.float32)
            k_rot = k_rot.to(tl.float32)
        # "ieee": fp32 inputs would otherwise be truncated to tf32 (ignored for 16-bit).
        s = tl.dot(q_lat, tl.trans(latent), input_precision="ieee")
        s += tl.dot(q_rot, tl.trans(k_rot), input_precision="ieee")  # [BLOCK_H, TILE]
        s = tl.where(tok_valid[None, :], s * qk_scale, float("-inf"))

        # Every tile starts inside the context and so holds >= 1 valid token: m_new is finite.
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_sum = l_sum * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(latent.dtype), latent, input_precision="ieee")
        m = m_new

    out = acc / l_sum[:, None]
    lse = (m + tl.log2(l_sum)) * 0.6931471805599453
    tl.store(part_lse_ptr + rows, lse, mask=h_valid)
    tl.store(
        part_out_ptr + rows[:, None] * LAT + col[None, :],
        out,
        mask=h_valid[:, None] & col_valid[None, :],
    )


@triton.jit(do_not_specialize=["num_splits"])
def _mla_reduce_kernel(  # type: ignore[no-untyped-def]
    part_out_ptr,  # [rows, heads, num_splits, LAT] fp32
    part_lse_ptr,  # [rows, heads, num_splits] fp32, -inf for an empty split
    out_ptr,  # [rows, heads, LAT], out: in q's dtype
    stride_out_req,
    stride_out_head,  # out.stride(2) is 1
    num_splits,
    LAT: tl.constexpr,
    LAT_PAD: tl.constexpr,  # LAT padded to a power of two
    SPLITS_PAD: tl.constexpr,  # num_splits padded to a power of two
):
    req = tl.program_id(0)
    head = tl.program_id(1)
    num_heads = tl.num_programs(1)
    s = tl.arange(0, SPLITS_PAD)
    c = tl.arange(0, LAT_PAD)
    c_valid = c < LAT
    rows = (req.to(tl.int64) * num_heads + head) * num_splits + s
    lse = tl.load(part_lse_ptr + rows, mask=s < num_splits, other=float("-inf"))
    # Split 0 always holds the row's first block, so the max is finite.
    lse_max = tl.max(lse, axis=0)
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)
    weights = tl.exp(lse - lse_max)
    has_keys = lse > float("-inf")  # an empty split wrote no partial: never read it
    parts = tl.load(
        part_out_ptr + rows[:, None] * LAT + c[None, :],
        mask=has_keys[:, None] & c_valid[None, :],
        other=0.0,
    )
    total = tl.sum(weights, axis=0)
    out = tl.sum(weights[:, None] * parts, axis=0) / tl.where(total > 0.0, total, 1.0)
    tl.store(
        out_ptr + req.to(tl.int64) * stride_out_req + head * stride_out_head + c,
        out.to(out_ptr.dtype.element_ty),
        mask=c_valid,
    )


def _check_inputs(
    q_lat: torch.Tensor,
    q_rot: torch.Tensor,
    kv_layer: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    num_splits: int | None,
) -> None:
    if q_lat.dim() != 3 or q_rot.dim() != 3 or q_lat.shape[:2] != q_rot.shape[:2]:
        raise ValueError(
            "q_lat and q_rot must be [rows, heads, kv_lora_rank] and [rows, heads, rope], "
            f"got {tuple(q_lat.shape)} and {tuple(q_rot.shape)}"
        )
    if kv_layer.dim() != 5 or kv_layer.shape[1] != 2 or kv_layer.shape[3] != 1:
        raise ValueError(
            f"kv_layer must be [num_blocks, 2, block_size, 1, D], got shape {tuple(kv_layer.shape)}"
        )
    rows, lat, rope = q_lat.shape[0], q_lat.shape[2], q_rot.shape[2]
    half, block_size = kv_layer.shape[4], kv_layer.shape[2]
    if q_lat.dtype not in _DTYPES or q_rot.dtype != q_lat.dtype or kv_layer.dtype != q_lat.dtype:
        raise ValueError(
            f"q_lat, q_rot and kv_layer must share one of {_DTYPES}, got {q_lat.dtype}, "
            f"{q_rot.dtype} and {kv_layer.dtype}"
        )
    if 2 * half != lat + rope or lat < half:
        raise ValueError(
            f"an entry of kv_lora_rank {lat} + rope {rope} must fill the cache's two halves "
            f"of {half} with the latent covering the K half"
        )
    if not is_pow2(block_size) or block_size > 256:
        raise ValueError(f"block_size {block_size} must be a power of two <= 256")
    if q_lat.stride(-1) != 1 or q_rot.stride(-1) != 1 or kv_layer.stride(-1) != 1:
        raise ValueError("the last dim of q_lat, q_rot and kv_layer must be contiguous")
    for name, t in (("q_rot", q_rot), ("kv_layer", kv_layer)):
        if t.device != q_lat.device:
            raise ValueError(f"{name} is on {t.device}, q_lat on {q_lat.device}")
    check_tables(block_tables, context_lens, num_splits, rows, q_lat.device, "q_lat")


def head_tile(num_heads: int) -> int:
    """Query heads per program: a power of two in [16, MAX_BLOCK_H]."""
    return max(_MIN_DOT_DIM, min(triton.next_power_of_2(num_heads), MAX_BLOCK_H))


def mla_num_splits(rows: int, num_heads: int, max_context_blocks: int, num_sms: int) -> int:
    """The split count for `rows` rows whose longest context is `max_context_blocks`: the
    dense kernel's rule with a program per (row, head tile) in place of a kv head's."""
    tiles = triton.cdiv(num_heads, head_tile(num_heads))
    return choose_num_splits(rows, tiles, max_context_blocks, num_sms)


def mla_decode_attention(
    q_lat: torch.Tensor,
    q_rot: torch.Tensor,
    kv_layer: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Each row's latent context: softmax((q_lat . latent + q_rot . k_rot) * scale) @ latent
    over its paged entries.

    Args:
        q_lat: [rows, heads, kv_lora_rank], the absorbed query (q_nope @ W_UK); float32,
            float16 or bfloat16, last dim contiguous.
        q_rot: [rows, heads, qk_rope_head_dim], rotated, in q_lat's dtype.
        kv_layer: [num_blocks, 2, block_size, 1, D] in q_lat's dtype, D = (kv_lora_rank +
            rope) / 2 (any strides on the first four dims, last dim contiguous).
        block_tables: [rows, max_blocks] int32; entries past a row's context never read.
        context_lens: [rows] int32, each in [1, max_blocks * block_size] (not checked).
        scale: softmax scale.
        num_splits: split-K partitions per row; None: `mla_num_splits` for the longest
            context the block tables hold.
        out: [rows, heads, kv_lora_rank] in q_lat's dtype, written in place if given.

    Returns:
        [rows, heads, kv_lora_rank] in q_lat's dtype (`out` when given).

    Raises:
        ValueError: on shapes, dtypes, devices or strides the kernels do not support.
    """
    _check_inputs(q_lat, q_rot, kv_layer, block_tables, context_lens, num_splits)
    rows, heads, lat = q_lat.shape
    rope, half, block_size = q_rot.shape[2], kv_layer.shape[4], kv_layer.shape[2]
    if out is None:
        out = torch.empty(q_lat.shape, dtype=q_lat.dtype, device=q_lat.device)
    elif out.shape != q_lat.shape or out.dtype != q_lat.dtype or out.stride(-1) != 1:
        raise ValueError(f"out must be {tuple(q_lat.shape)} {q_lat.dtype}, last dim contiguous")
    if rows == 0:
        return out
    block_h = head_tile(heads)
    if num_splits is None:
        from tandem.kernels.decode_attention import device_num_sms

        sms = device_num_sms(q_lat.device)
        num_splits = mla_num_splits(rows, heads, block_tables.shape[1], sms)
    chunk = latent_chunk(half, lat)
    chunks_pad = max(triton.next_power_of_2(lat // chunk), triton.cdiv(_MIN_DOT_DIM, chunk))
    tiles = mla_tiles(lat)
    # The interpreter's tl.dot multiplies bf16 bit patterns as integers (triton#11584).
    upcast = q_lat.dtype == torch.bfloat16 and q_lat.device.type == "cpu"
    part_out = torch.empty((rows, heads, num_splits, lat), dtype=torch.float32, device=out.device)
    part_lse = torch.empty((rows, heads, num_splits), dtype=torch.float32, device=out.device)
    _mla_split_kernel[(rows, triton.cdiv(heads, block_h), num_splits)](
        q_lat,
        q_rot,
        kv_layer,
        block_tables,
        context_lens,
        part_out,
        part_lse,
        scale,
        heads,
        q_lat.stride(0),
        q_lat.stride(1),
        q_rot.stride(0),
        q_rot.stride(1),
        kv_layer.stride(0),
        kv_layer.stride(1),
        kv_layer.stride(2),
        block_tables.stride(0),
        block_tables.stride(1),
        context_lens.stride(0),
        LAT=lat,
        ROPE=rope,
        HALF=half,
        CHUNK=chunk,
        NUM_CHUNKS_PAD=chunks_pad,
        ROPE_PAD=max(triton.next_power_of_2(rope), _MIN_DOT_DIM),
        BLOCK_H=block_h,
        BLOCK_SIZE=block_size,
        TILE=tiles.tile,
        NUM_STAGES=tiles.num_stages,
        UPCAST=upcast,
        num_warps=tiles.num_warps,
    )
    _mla_reduce_kernel[(rows, heads)](
        part_out,
        part_lse,
        out,
        out.stride(0),
        out.stride(1),
        num_splits,
        LAT=lat,
        LAT_PAD=triton.next_power_of_2(lat),
        SPLITS_PAD=triton.next_power_of_2(num_splits),
    )
    return out
