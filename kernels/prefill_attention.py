"""Paged prefill attention over a varlen batch of chunks: flash-attention over block tables.

The step's prefill chunks lie back to back in `q`. Request i's chunk holds the newest n_i
positions of its context (its own K/V are already in the cache), and each query attends
causally over the cached prefix and the chunk up to itself:

    positions  0 ........ ctx-n-1 | ctx-n ........ ctx-1
               cached prefix      | this chunk's queries (query j sits at ctx-n+j)
    query j sees keys 0 .. ctx-n+j

Keys are read straight from the cache through the block table, a tile of BLOCK_N keys at a
time: whole blocks when BLOCK_N >= block_size, else a run inside one block (both powers of
two, so a tile never straddles a block it does not cover whole):

    key t  ->  kv_layer[block_table[t // block_size], 0 or 1, t % block_size, kv_head]

One program handles one (request, kv head, tile of BLOCK_Q queries) and all GROUP q heads
that share the kv head (GQA): the tile's rows are query-major, head-minor,

    row r  ->  query tile_start + r // GROUP_PAD,  q head kv_head * GROUP + r % GROUP_PAD

so BLOCK_M = BLOCK_Q * GROUP_PAD rows read each K/V tile once (GROUP times less K/V traffic
than one program per q head, and short chunks still fill the rows of a tensor-core tile).
Rows of padded heads (GROUP not a power of two) or of queries past the chunk compute
throwaway values and are not stored. Scores live only as one [BLOCK_M, BLOCK_N] tile: an
online softmax (running max and sum in fp32, exp2 with the scale folded into log2 e)
rescales the fp32 accumulator as the tiles go by.

The grid is (batch, num_kv_heads, cdiv(max_query_len, BLOCK_Q)): shapes only, no device to
host sync; tiles past a request's chunk return at once.

An fp8 (e4m3) cache is dequantized as each K/V tile is loaded: float32(stored) * scale in q's
dtype (tandem.quant.kv); the rest of the kernel does not change.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import triton
import triton.language as tl

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
FP8_KV_DTYPE = torch.float8_e4m3fn  # a quantized cache (with k_scale, v_scale)
INDEX_DTYPES = (torch.int32, torch.int64)
HEAD_DIMS = (16, 32, 64, 128, 256)
LOG2_E = 1.4426950408889634


class Tiles(NamedTuple):
    """Launch configuration for one (dtype, head_dim, GQA group)."""

    block_q: int  # queries per program
    group_pad: int  # rows per query: next power of two >= the GQA group
    block_n: int  # keys per inner iteration
    num_warps: int
    num_stages: int  # inner iterations whose loads are in flight at once


def tiles_for(dtype: torch.dtype, head_dim: int, group: int) -> Tiles:
    """Tile sizes. 16-bit with head_dim 65-128: 128 rows x 128 keys, 8 warps, three stages,
    measured on an H200 (the GPU check's `tiles` part, benchmarks/results/gpu/run2: a
    2048-token chunk over a 6144-token prefix, Llama-3-8B's 32/8 heads x 128) at 1.34 ms
    against 3.58 ms for the 64 x 32 tiles chosen before, the fastest of 13 candidates.
    Elsewhere (not measured on a GPU): ~64 rows (32 for head_dim 256 or fp32, whose FMA dot
    holds more registers) and 32 keys (16 for fp32), 8 warps from head_dim 128. Every one of
    these compiles for sm_90a with async copies and without register spills (tests/kernels:
    ptxas). tl.dot needs every dimension >= 16, hence rows >= 16 whatever the group.
    """
    half = dtype != torch.float32
    measured = half and 64 < head_dim <= 128
    rows = 128 if measured else 64 if half and head_dim <= 128 else 32
    group_pad = triton.next_power_of_2(group)
    block_m = max(rows, group_pad)
    return Tiles(
        block_q=block_m // group_pad,
        group_pad=group_pad,
        block_n=128 if measured else 32 if half else 16,
        num_warps=4 if head_dim <= 64 else 8,
        num_stages=3,
    )


# Triton reads kernel annotations (tl.constexpr), so the arguments carry comments instead.
# The block table's row stride is its width, which follows the step's longest context: not
# specialised on, or each value class (1, multiple of 16, other) would compile mid-serving.
@triton.jit(do_not_specialize=["stride_t_req"])
def _prefill_kernel(  # type: ignore[no-untyped-def]
    q_ptr,  # [num_tokens, num_q_heads, HEAD_DIM] the chunks' queries back to back
    out_ptr,  # [num_tokens, num_q_heads, HEAD_DIM] written for every valid (token, head)
    cache_ptr,  # [num_blocks, 2, block_size, num_kv_heads, HEAD_DIM] kv_layer
    block_tables_ptr,  # [batch, max_blocks] int32/int64: each request's blocks in order
    query_starts_ptr,  # [batch + 1] cumulative chunk starts in q
    context_lens_ptr,  # [batch] context length including the chunk
    sinks_ptr,  # [num_q_heads] fp32 sink logits (read only when HAS_SINKS)
    window,  # a sliding layer's window (query p sees keys (p - window, p]); 0: none
    qk_scale,  # softmax scale * log2(e): scores go through exp2
    k_scale,  # fp32: an fp8 cache holds K / k_scale (unused otherwise)
    v_scale,  # fp32: likewise V
    stride_q_token,  # q.stride(0), elements
    stride_q_head,  # q.stride(1)
    stride_o_token,  # out.stride(0)
    stride_o_head,  # out.stride(1)
    stride_c_block,  # kv_layer.stride(0): spans all layers of a block, may exceed int32
    stride_c_kv,  # kv_layer.stride(1): from a slot's K to its V
    stride_c_slot,  # kv_layer.stride(2)
    stride_c_head,  # kv_layer.stride(3)
    stride_t_req,  # block_tables.stride(0)
    stride_t_block,  # block_tables.stride(1)
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block
    GROUP: tl.constexpr,  # q heads per kv head
    GROUP_PAD: tl.constexpr,  # next power of two >= GROUP (rows per query in the tile)
    BLOCK_Q: tl.constexpr,  # queries per program; BLOCK_Q * GROUP_PAD rows
    BLOCK_N: tl.constexpr,  # keys per inner iteration
    HEAD_DIM: tl.constexpr,  # a power of two, 16..256
    DOT_PRECISION: tl.constexpr,  # "ieee" for fp32 (no TF32 rounding); 16-bit dots ignore it
    DOT_FP32: tl.constexpr,  # feed tl.dot fp32 copies (Triton's CPU interpreter has no bf16 dot)
    NUM_STAGES: tl.constexpr,  # software-pipeline depth of the loop over key tiles
    FP8_KV: tl.constexpr,  # the cache is e4m3: dequantize each tile with the scales
    HAS_SINKS: tl.constexpr,  # each head's sink logit joins its softmax's denominator
):
    BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_PAD
    req = tl.program_id(0)
    kv_head = tl.program_id(1)
    tile_start = tl.program_id(2) * BLOCK_Q

    q_start = tl.load(query_starts_ptr + req)
    num_new = tl.load(query_starts_ptr + req + 1) - q_start
    if tile_start >= num_new:
        return  # the grid covers max_query_len; this chunk is shorter
    context_len = tl.load(context_lens_ptr + req)
    prefix_len = context_len - num_new

    rows = tl.arange(0, BLOCK_M)
    query = tile_start + rows // GROUP_PAD  # [BLOCK_M] index inside the chunk
    head_in_group = rows % GROUP_PAD
    row_valid = (query < num_new) & (head_in_group < GROUP)
    q_head = kv_head * GROUP + head_in_group
    # Padding rows take the last query's position: every row then sees key 0 in the first
    # tile, so the running max is finite from the start and no row divides 0 by 0.
    position = prefix_len + tl.minimum(query, num_new - 1)
    # Keys past the tile's last query are never visible to it.
    kv_end = prefix_len + tl.minimum(tile_start + BLOCK_Q, num_new)

    dims = tl.arange(0, HEAD_DIM)
    token = (q_start + query).to(tl.int64)
    q = tl.load(
        q_ptr + token[:, None] * stride_q_token + q_head[:, None] * stride_q_head + dims[None, :],
        mask=row_valid[:, None],
        other=0.0,
    )  # [BLOCK_M, HEAD_DIM]

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max of scaled scores
    l_i = tl.zeros([BLOCK_M], tl.float32)  # running sum of exp2(score - m_i)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    table = block_tables_ptr + req.to(tl.int64) * stride_t_req
    head_offset = kv_head.to(tl.int64) * stride_c_head

    # A tile's BLOCK_N keys are whole blocks (BLOCK_N >= BLOCK_SIZE) or one run inside a
    # block: one table read per block, not per key.
    #
    #   key start_n + b * RUN + r  at  table[start_n // BLOCK_SIZE + b] * stride_c_block
    #                                  + (start_n % BLOCK_SIZE + r) * stride_c_slot
    #
    # The loop is software-pipelined (num_stages): the next tiles' loads are in flight while
    # this one is computed.
    TILE_BLOCKS: tl.constexpr = (BLOCK_N + BLOCK_SIZE - 1) // BLOCK_SIZE
    RUN: tl.constexpr = BLOCK_N // TILE_BLOCKS  # keys of one block in a tile
    b = tl.arange(0, TILE_BLOCKS)
    r = tl.arange(0, RUN)
    # A sliding layer's tiles start at its first query's window (rounded down to a whole
    # BLOCK_N, as every tile is); keys before it are not even loaded (their pages may be
    # freed). A later row may see no key in the first tiles: hence the guard on the max.
    kv_first = 0
    if window > 0:
        kv_first = tl.maximum(prefix_len + tile_start - window + 1, 0)
    kv_start = kv_first // BLOCK_N * BLOCK_N
    for start_n in tl.range(kv_start, kv_end, BLOCK_N, num_stages=NUM_STAGES):
        keys = start_n + tl.arange(0, BLOCK_N)  # [BLOCK_N] positions
        key_valid = (keys < kv_end) & (keys >= kv_first)
        blocks = start_n // BLOCK_SIZE + b  # [TILE_BLOCKS]
        block = tl.load(
            table + blocks * stride_t_block,
            mask=(blocks * BLOCK_SIZE < kv_end) & ((blocks + 1) * BLOCK_SIZE > kv_first),
            other=0,
        )
        # int64: block id * stride_c_block overflows int32 in a large cache.
        slot = (
            tl.reshape(
                block.to(tl.int64)[:, None] * stride_c_block
                + (start_n % BLOCK_SIZE + r)[None, :] * stride_c_slot,
                [BLOCK_N],
            )
            + head_offset
        )  # [BLOCK_N]
        k = tl.load(
            cache_ptr + slot[None, :] + dims[:, None], mask=key_valid[None, :], other=0.0
        )  # [HEAD_DIM, BLOCK_N]
        if FP8_KV:
            k = (k.to(tl.float32) * k_scale).to(q.dtype)
        if DOT_FP32:
            s = tl.dot(q.to(tl.float32), k.to(tl.float32), input_precision="ieee")
        else:
            s = tl.dot(q, k, input_precision=DOT_PRECISION)
        s = s * qk_scale  # [BLOCK_M, BLOCK_N]
        seen = keys[None, :] <= position[:, None]
        if window > 0:
            seen = seen & (keys[None, :] > position[:, None] - window)
        s = tl.where(seen, s, float("-inf"))

        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # -inf only for a row that has seen no key yet: subtract 0 then (exp2(-inf) = 0)
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.math.exp2(m_i - m_sub)  # rescales what was summed under the old max
        p = tl.math.exp2(s - m_sub[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        v = tl.load(
            cache_ptr + stride_c_kv + slot[:, None] + dims[None, :],
            mask=key_valid[:, None],
            other=0.0,
        )  # [BLOCK_N, HEAD_DIM]
        if FP8_KV:
            v = (v.to(tl.float32) * v_scale).to(q.dtype)
        # P in the cache dtype, as flash-attention does: the second dot runs on tensor cores.
        p = p.to(v.dtype)
        if DOT_FP32:
            pv = tl.dot(p.to(tl.float32), v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p, v, input_precision=DOT_PRECISION)
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    if HAS_SINKS:
        # exp(sink) in the denominator, under a max that covers it too (log2 units)
        sink = tl.load(sinks_ptr + q_head, mask=head_in_group < GROUP, other=0.0)
        sink = sink * 1.4426950408889634
        m_f = tl.maximum(m_i, sink)
        rescale = tl.math.exp2(m_i - m_f)
        out = acc * rescale[:, None] / (l_i * rescale + tl.math.exp2(sink - m_f))[:, None]
    else:
        out = acc / l_i[:, None]
    tl.store(
        out_ptr + token[:, None] * stride_o_token + q_head[:, None] * stride_o_head + dims[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_valid[:, None],
    )


def _check(
    q: torch.Tensor,
    kv_layer: torch.Tensor,
    block_tables: torch.Tensor,
    query_starts: torch.Tensor,
    context_lens: torch.Tensor,
    max_query_len: int,
    scale: float,
    out: torch.Tensor | None,
) -> None:
    if q.dim() != 3:
        raise ValueError(f"q must be [num_tokens, num_q_heads, head_dim], got {tuple(q.shape)}")
    if kv_layer.dim() != 5 or kv_layer.shape[1] != 2:
        raise ValueError(
            f"kv_layer must be [num_blocks, 2, block_size, num_kv_heads, head_dim], "
            f"got {tuple(kv_layer.shape)}"
        )
    num_q_heads, head_dim = q.shape[1:]
    num_kv_heads = kv_layer.shape[3]
    if kv_layer.shape[4] != head_dim:
        raise ValueError(
            f"q head_dim {head_dim} does not match kv_layer head_dim {kv_layer.shape[4]}"
        )
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"head_dim must be one of {HEAD_DIMS}, got {head_dim}")
    if num_kv_heads == 0 or num_q_heads % num_kv_heads:
        raise ValueError(
            f"num_q_heads {num_q_heads} must be a multiple of num_kv_heads {num_kv_heads}"
        )
    if q.dtype not in DTYPES:
        raise ValueError(f"q dtype must be one of {DTYPES}, got {q.dtype}")
    if kv_layer.dtype not in (q.dtype, FP8_KV_DTYPE):
        raise ValueError(f"q dtype {q.dtype} does not match kv_layer dtype {kv_layer.dtype}")
    if context_lens.dim() != 1:
        raise ValueError(f"context_lens must be [batch], got {tuple(context_lens.shape)}")
    batch = context_lens.shape[0]
    if query_starts.shape != (batch + 1,):
        raise ValueError(
            f"query_starts must be [batch + 1] = [{batch + 1}], got {tuple(query_starts.shape)}"
        )
    if block_tables.dim() != 2 or block_tables.shape[0] != batch:
        raise ValueError(
            f"block_tables must be [batch={batch}, max_blocks], got {tuple(block_tables.shape)}"
        )
    for name, t in (
        ("block_tables", block_tables),
        ("query_starts", query_starts),
        ("context_lens", context_lens),
    ):
        if t.dtype not in INDEX_DTYPES:
            raise ValueError(f"{name} must be int32 or int64, got {t.dtype}")
    if max_query_len < 0:
        raise ValueError(f"max_query_len must be >= 0, got {max_query_len}")
    if max_query_len > q.shape[0]:
        raise ValueError(f"max_query_len {max_query_len} exceeds num_tokens {q.shape[0]}")
    if not math.isfinite(scale):
        raise ValueError(f"scale must be finite, got {scale}")
    named = {
        "q": q,
        "kv_layer": kv_layer,
        "block_tables": block_tables,
        "query_starts": query_starts,
        "context_lens": context_lens,
    }
    if out is not None:
        if out.shape != q.shape or out.dtype != q.dtype:
            raise ValueError(
                f"out must be {tuple(q.shape)} {q.dtype}, got {tuple(out.shape)} {out.dtype}"
            )
        named["out"] = out
    devices = {name: t.device for name, t in named.items()}
    if len(set(devices.values())) != 1:
        raise ValueError(f"all tensors must be on one device, got {devices}")
    strides = {name: named[name].stride(-1) for name in ("q", "kv_layer", "out") if name in named}
    if any(s != 1 for s in strides.values()):
        raise ValueError(f"head_dim must be contiguous (stride 1), got strides {strides}")


def paged_prefill_attention(
    q: torch.Tensor,
    kv_layer: torch.Tensor,
    block_tables: torch.Tensor,
    query_starts: torch.Tensor,
    context_lens: torch.Tensor,
    max_query_len: int,
    scale: float,
    out: torch.Tensor | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of each request's chunk over its cached prefix and itself.

    Args:
        q: [num_tokens, num_q_heads, head_dim], the requests' chunks back to back.
        kv_layer: [num_blocks, 2, block_size, num_kv_heads, head_dim], a strided view of the
            whole cache; the chunks' own K/V are already written to it.
        block_tables: [batch, max_blocks] int32 (int64 accepted), each request's blocks.
        query_starts: [batch + 1] int32 (int64 accepted), cumulative: request i's queries
            are q[query_starts[i]:query_starts[i + 1]].
        context_lens: [batch] int32 (int64 accepted): request i's chunk holds positions
            context_lens[i] - n_i ... context_lens[i] - 1.
        max_query_len: the longest chunk, known on the host; sizes the grid. Queries past it
            are not computed (their rows of `out` are left as they were).
        scale: softmax scale.
        out: optional [num_tokens, num_q_heads, head_dim] output, q's dtype.
        k_scale, v_scale: a float8_e4m3fn cache's scales (value = stored * scale).
        window: a sliding layer's window: the query at position p sees keys (p - window, p]
            only, and no tile before its queries' windows is read.
        sinks: [num_q_heads] float32 sink logits: exp(sink) joins each head's denominator.

    Returns:
        `out` (allocated when not given): [num_tokens, num_q_heads, head_dim], q's dtype,
        accumulated in fp32.

    Values on the device are not checked (a sync per layer): context_lens[i] >= n_i and
    block tables covering context_lens[i] tokens are the caller's contract.

    Raises:
        ValueError: shapes, dtypes, devices or strides that do not fit together.
    """
    _check(q, kv_layer, block_tables, query_starts, context_lens, max_query_len, scale, out)
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    batch = context_lens.shape[0]
    if batch == 0 or max_query_len == 0:
        return out
    head_dim = q.shape[2]
    block_size, num_kv_heads = kv_layer.shape[2:4]
    group = q.shape[1] // num_kv_heads
    tiles = tiles_for(q.dtype, head_dim, group)
    grid = (batch, num_kv_heads, triton.cdiv(max_query_len, tiles.block_q))
    _prefill_kernel[grid](
        q,
        out,
        kv_layer,
        block_tables,
        query_starts,
        context_lens,
        sinks if sinks is not None else context_lens,  # never read without HAS_SINKS
        window or 0,
        scale * LOG2_E,
        float(k_scale),
        float(v_scale),
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        kv_layer.stride(0),
        kv_layer.stride(1),
        kv_layer.stride(2),
        kv_layer.stride(3),
        block_tables.stride(0),
        block_tables.stride(1),
        BLOCK_SIZE=block_size,
        GROUP=group,
        GROUP_PAD=tiles.group_pad,
        BLOCK_Q=tiles.block_q,
        BLOCK_N=tiles.block_n,
        HEAD_DIM=head_dim,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        # CPU tensors only run under the interpreter, which multiplies bf16 bit patterns as
        # integers; fp32 copies of bf16 values multiply exactly, as bf16 tensor cores do.
        DOT_FP32=q.device.type == "cpu" and q.dtype == torch.bfloat16,
        NUM_STAGES=tiles.num_stages,
        FP8_KV=kv_layer.dtype == FP8_KV_DTYPE,
        HAS_SINKS=sinks is not None,
        num_warps=tiles.num_warps,
    )
    return out
