"""Paged decode attention: one query token per request over its block table (flash-decoding).

Two kernels. The first splits each request's context into `num_splits` runs of blocks; a
program handles one (request, kv head, split) and all the query heads of that kv head's
group, so each K/V block is loaded once per group, not once per query head. It writes the
split's normalized partial output and its log-sum-exp. The second combines the splits.

    context of request r (blocks of its block table), num_splits = 3:

    blocks:   [b0 b1 b2 | b3 b4 b5 | b6 b7]       blocks_per_split = cdiv(8, 3) = 3
    split:        0          1         2
    partial:  o_0, lse_0  o_1, lse_1  o_2, lse_2   (fp32, per query head)
    out  = sum_i exp(lse_i - M) * o_i / sum_i exp(lse_i - M),   M = max_i lse_i

The grid, (batch, num_kv_heads, num_splits), depends on shapes only, never on values, so a
launch can be captured in a CUDA graph. The split count comes from the longest context in
the step (`choose_num_splits`; the host knows it), so a short request in a batch with a long
one has splits that start past its context: such a split writes only lse = -inf, and the
reduction neither weighs nor reads its partial.

An fp8 (e4m3) cache is dequantized as it is loaded, in registers: K and V tiles become
float32(stored) * scale in q's dtype (tandem.quant.kv), so the rest of the kernel is
the same for every cache; it reads half the bytes of a 16-bit one.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

# Split choice (choose_num_splits). A long context is cut into runs of about this many
# blocks, so one long request is many programs, not one that the whole step waits for.
BLOCKS_PER_SPLIT = 16
# A split shorter than this many blocks costs more in partial writes and reduction than it
# saves in parallelism.
MIN_BLOCKS_PER_SPLIT = 4
# The reduction reads every split of every request.
MAX_SPLITS = 32
# Streaming multiprocessors of an H100/H200: the count to fill when the device cannot say.
DEFAULT_NUM_SMS = 132

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
FP8_KV_DTYPE = torch.float8_e4m3fn  # a quantized cache (with k_scale, v_scale)
# Tensor-core dots need every dimension >= 16 on NVIDIA GPUs.
_MIN_DOT_DIM = 16


class DecodeTiles(NamedTuple):
    """Launch configuration of the split kernel for one (dtype, head_dim, block size, path)."""

    tile_blocks: int  # whole blocks read per loop iteration
    num_stages: int  # loop iterations whose loads are in flight at once
    num_warps: int


def decode_tiles(dtype: torch.dtype, head_dim: int, block_size: int, use_dot: bool) -> DecodeTiles:
    """The 16-bit tensor-core path: about 32 tokens of K and V per iteration, three stages,
    2 warps, measured on an H200 (the GPU check's `tiles` part: batch 64 x 4096 tokens, 8 kv
    heads x 128, bf16, block 16). The first sweep (benchmarks/results/gpu/run2) took 1023 us
    with 64 tokens and 8 warps (the untuned default), 762 us with 4 warps, more with 128
    tokens; the second (run3) 620 us with 32 tokens and 2 warps whatever the stages (3-5),
    within 1% of the best of 12. fp32 or the multiply-sum path (whose [heads, tokens,
    head_dim] product lives in registers): 32 tokens, three stages, 8 warps from head_dim 128
    (not measured). In whole blocks. Each compiles for sm_90a with async copies and no
    spills (tests/kernels: ptxas)."""
    if use_dot and dtype != torch.float32:
        return DecodeTiles(tile_blocks=max(1, 32 // block_size), num_stages=3, num_warps=2)
    return DecodeTiles(
        tile_blocks=max(1, 32 // block_size),
        num_stages=3,
        num_warps=8 if head_dim >= 128 else 4,
    )


# The kernels' arguments carry no annotations: Triton derives their types at launch (and an
# annotation would pin one), so mypy's untyped-def check is silenced on each.
# The block table's row stride is its width, which follows the batch's longest context, and
# the split count follows it too: Triton would compile a variant per value class of each
# (1, multiple of 16, other), mid-serving. Only SPLITS_PAD (a constexpr) selects a variant.
@triton.jit(do_not_specialize=["stride_bt_req"])
def _decode_split_kernel(  # type: ignore[no-untyped-def]
    q_ptr,  # [batch, num_q_heads, head_dim], the query of each request's newest token
    kv_ptr,  # [num_blocks, 2, block_size, num_kv_heads, head_dim], one layer's cache
    block_tables_ptr,  # [batch, max_blocks] int32 block ids
    context_lens_ptr,  # [batch] int32 tokens of context, >= 1
    part_out_ptr,  # [batch, num_q_heads, num_splits, head_dim] fp32, out: normalized partials
    #                (none written for an empty split)
    part_lse_ptr,  # [batch, num_q_heads, num_splits] fp32, out: log-sum-exp of each partial
    scale,  # softmax scale (fp32)
    k_scale,  # fp32: an fp8 cache holds K / k_scale (unused otherwise)
    v_scale,  # fp32: likewise V
    window,  # a sliding layer's window: keys at [context_len - window, context_len); 0: all
    #          (specialised on: a model's one or two values compile at warm-up)
    stride_q_req,  # q.stride(0)
    stride_q_head,  # q.stride(1); q.stride(2) is 1
    stride_kv_block,  # kv.stride(0): may be large (all layers of a block), used in int64
    stride_kv_kv,  # kv.stride(1): K -> V
    stride_kv_tok,  # kv.stride(2)
    stride_kv_head,  # kv.stride(3); kv.stride(4) is 1
    stride_bt_req,  # block_tables.stride(0)
    stride_bt_blk,  # block_tables.stride(1)
    stride_cl,  # context_lens.stride(0)
    GROUP: tl.constexpr,  # query heads per kv head (num_q_heads // num_kv_heads)
    BLOCK_H: tl.constexpr,  # GROUP padded to a power of two (to >= 16 when USE_DOT)
    HEAD_DIM: tl.constexpr,  # power of two
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block, power of two
    TILE_BLOCKS: tl.constexpr,  # blocks read per loop iteration, power of two
    NUM_STAGES: tl.constexpr,  # software-pipeline depth of the loop over tiles
    USE_DOT: tl.constexpr,  # tl.dot (tensor cores) rather than broadcast multiply-sum
    UPCAST: tl.constexpr,  # compute on q/K/V converted to fp32 (see the wrapper)
    FP8_KV: tl.constexpr,  # the cache is e4m3: dequantize each tile with the scales
):
    req = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    num_splits = tl.num_programs(2)
    num_q_heads = tl.num_programs(1) * GROUP

    # Blocks [start, end) of this request belong to this split; empty when start >= end. A
    # sliding layer's splits share out only the blocks from its window's first key on.
    context_len = tl.load(context_lens_ptr + req * stride_cl)
    num_ctx_blocks = tl.cdiv(context_len, BLOCK_SIZE)
    first_key = 0
    if window > 0:
        first_key = tl.maximum(context_len - window, 0)
    first_block = first_key // BLOCK_SIZE
    # Whole tiles per split: only the context's last tile is partial.
    num_read = num_ctx_blocks - first_block
    blocks_per_split = tl.cdiv(tl.cdiv(num_read, num_splits), TILE_BLOCKS) * TILE_BLOCKS
    start = first_block + split * blocks_per_split
    end = tl.minimum(start + blocks_per_split, num_ctx_blocks)

    h = tl.arange(0, BLOCK_H)  # row h is query head kv_head * GROUP + h
    h_valid = h < GROUP
    q_heads = kv_head * GROUP + h
    rows = (req.to(tl.int64) * num_q_heads + q_heads) * num_splits + split  # [BLOCK_H]
    if start >= end:
        # Past this request's context: no partial, which the reduction skips by its lse.
        tl.store(part_lse_ptr + rows, tl.full([BLOCK_H], float("-inf"), tl.float32), h_valid)
        return
    d = tl.arange(0, HEAD_DIM)

    # q: [BLOCK_H, HEAD_DIM]; padded rows are 0, so their scores are finite (never NaN).
    q = tl.load(
        q_ptr + req.to(tl.int64) * stride_q_req + q_heads[:, None] * stride_q_head + d[None, :],
        mask=h_valid[:, None],
        other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)
    # Scores in the log2 domain: exp2(x * log2(e)) == exp(x), and exp2 is the cheaper op.
    qk_scale = scale * 1.4426950408889634

    # Each iteration reads TILE_BLOCKS whole blocks: their ids (one table read per block, not
    # per token), then each token's K and V row from its block's base:
    #
    #   ids = table[blk : blk + TILE_BLOCKS]                              [TILE_BLOCKS]
    #   key b * BLOCK_SIZE + t of the tile  at  ids[b] * stride_kv_block + t * stride_kv_tok
    #
    # The loop is software-pipelined (num_stages): the next tiles' loads are in flight while
    # this one is computed.
    TILE: tl.constexpr = TILE_BLOCKS * BLOCK_SIZE
    b = tl.arange(0, TILE_BLOCKS)
    t = tl.arange(0, BLOCK_SIZE)
    table = block_tables_ptr + req.to(tl.int64) * stride_bt_req
    head_offset = kv_head * stride_kv_head

    m = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)  # running max (log2 units)
    l_sum = tl.zeros([BLOCK_H], dtype=tl.float32)  # running sum of exp2(s - m)
    acc = tl.zeros([BLOCK_H, HEAD_DIM], dtype=tl.float32)  # running sum of p @ V
    for blk in tl.range(start, end, TILE_BLOCKS, num_stages=NUM_STAGES):
        block_ids = tl.load(table + (blk + b) * stride_bt_blk, mask=blk + b < end, other=0)
        # int64 before the multiply: block_id * stride_kv_block exceeds 2**31 elements in a
        # big cache (e.g. block 2048 of a 32-layer cache with 1M elements per block).
        bases = block_ids.to(tl.int64) * stride_kv_block + head_offset  # [TILE_BLOCKS]
        keys = tl.reshape(bases[:, None] + t[None, :] * stride_kv_tok, [TILE])
        kv_offsets = keys[:, None] + d[None, :]  # [TILE, HEAD_DIM]
        # Nothing past the context is read (splits are whole tiles: none crosses `end`), nor
        # before a sliding layer's window.
        pos = blk * BLOCK_SIZE + tl.arange(0, TILE)
        tok_valid = (pos < context_len) & (pos >= first_key)  # [TILE]
        k = tl.load(kv_ptr + kv_offsets, mask=tok_valid[:, None], other=0.0)
        v = tl.load(kv_ptr + stride_kv_kv + kv_offsets, mask=tok_valid[:, None], other=0.0)
        if FP8_KV:
            k = (k.to(tl.float32) * k_scale).to(q.dtype)
            v = (v.to(tl.float32) * v_scale).to(q.dtype)
        if UPCAST:
            k = k.to(tl.float32)
            v = v.to(tl.float32)

        # Why two paths: tl.dot maps to tensor cores but needs M, N, K >= 16, so the wrapper
        # pads a GQA group (2..8 heads) to 16 rows; the masked rows cost registers, not
        # memory traffic, and decode is bound by the K/V reads. With one query head (MHA) a
        # 16x padding is wasteful and a [1, TILE, HEAD_DIM] broadcast product is small, so
        # that path multiplies and sums in fp32.
        if USE_DOT:
            # "ieee": fp32 inputs would otherwise be truncated to tf32 (ignored for 16-bit).
            s = tl.dot(q, tl.trans(k), input_precision="ieee")  # [BLOCK_H, TILE]
        else:
            s = tl.sum(q[:, None, :] * k[None, :, :], axis=2)
        s = tl.where(tok_valid[None, :], s * qk_scale, float("-inf"))

        # Every tile starts inside [start, end) and so holds >= 1 valid token: m_new is finite.
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp2(m - m_new)  # rescales what was accumulated under the old max
        p = tl.exp2(s - m_new[:, None])  # [BLOCK_H, TILE]
        l_sum = l_sum * alpha + tl.sum(p, axis=1)
        if USE_DOT:
            # p in V's dtype (as flash attention does) so 16-bit dots use tensor cores.
            pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            pv = tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        acc = acc * alpha[:, None] + pv
        m = m_new

    # Every row saw a valid key (padded rows score q = 0 finitely), so l_sum > 0.
    out = acc / l_sum[:, None]
    lse = (m + tl.log2(l_sum)) * 0.6931471805599453
    tl.store(part_lse_ptr + rows, lse, mask=h_valid)
    tl.store(part_out_ptr + rows[:, None] * HEAD_DIM + d[None, :], out, mask=h_valid[:, None])


@triton.jit(do_not_specialize=["num_splits"])
def _decode_reduce_kernel(  # type: ignore[no-untyped-def]
    part_out_ptr,  # [batch, num_q_heads, num_splits, head_dim] fp32 normalized partials
    part_lse_ptr,  # [batch, num_q_heads, num_splits] fp32, -inf for an empty split
    out_ptr,  # [batch, num_q_heads, head_dim], out: in q's dtype
    sinks_ptr,  # [num_q_heads] fp32 sink logits (read only when HAS_SINKS)
    stride_out_req,  # out.stride(0)
    stride_out_head,  # out.stride(1); out.stride(2) is 1
    num_splits,  # splits of the first kernel
    HEAD_DIM: tl.constexpr,  # power of two
    SPLITS_PAD: tl.constexpr,  # num_splits padded to a power of two
    HAS_SINKS: tl.constexpr,  # each head's sink logit joins its softmax's denominator
):
    req = tl.program_id(0)
    head = tl.program_id(1)
    num_q_heads = tl.num_programs(1)

    s = tl.arange(0, SPLITS_PAD)
    s_valid = s < num_splits
    d = tl.arange(0, HEAD_DIM)
    rows = (req.to(tl.int64) * num_q_heads + head) * num_splits + s  # [SPLITS_PAD]

    lse = tl.load(part_lse_ptr + rows, mask=s_valid, other=float("-inf"))
    # Split 0 always holds the request's first block (context_len >= 1), so the max is
    # finite; the guard keeps an all-empty row at 0 instead of NaN all the same.
    lse_max = tl.max(lse, axis=0)
    if HAS_SINKS:  # exp(sink) is one more term of the denominator, attached to no value
        sink = tl.load(sinks_ptr + head)
        lse_max = tl.maximum(lse_max, sink)
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)
    weights = tl.exp(lse - lse_max)  # [SPLITS_PAD], 0 for empty splits and padding
    # An empty split wrote no partial: never read it (0 x garbage could be NaN).
    has_keys = lse > float("-inf")
    parts = tl.load(
        part_out_ptr + rows[:, None] * HEAD_DIM + d[None, :], mask=has_keys[:, None], other=0.0
    )
    total = tl.sum(weights, axis=0)
    if HAS_SINKS:
        total += tl.exp(sink - lse_max)
    out = tl.sum(weights[:, None] * parts, axis=0) / tl.where(total > 0.0, total, 1.0)
    tl.store(
        out_ptr + req.to(tl.int64) * stride_out_req + head * stride_out_head + d,
        out.to(out_ptr.dtype.element_ty),
    )


def choose_num_splits(
    batch: int, num_kv_heads: int, max_context_blocks: int, num_sms: int = DEFAULT_NUM_SMS
) -> int:
    """Splits per request for a step whose longest context is `max_context_blocks` blocks.

    The longest context is cut into runs of about `BLOCKS_PER_SPLIT` blocks, whatever the
    batch: a program's time grows with its blocks, and the step waits for the slowest. When
    batch x num_kv_heads programs leave some of the `num_sms` SMs idle, more splits fill
    them, down to `MIN_BLOCKS_PER_SPLIT` blocks each. At most `MAX_SPLITS`.
    """
    by_length = triton.cdiv(max_context_blocks, BLOCKS_PER_SPLIT)
    to_fill = min(
        triton.cdiv(num_sms, max(batch * num_kv_heads, 1)),
        max_context_blocks // MIN_BLOCKS_PER_SPLIT,
    )
    return max(1, min(max(by_length, to_fill), MAX_SPLITS))


def device_num_sms(device: torch.device) -> int:
    """The SMs of a CUDA device; DEFAULT_NUM_SMS elsewhere (Triton's CPU interpreter)."""
    if device.type != "cuda":
        return DEFAULT_NUM_SMS
    return int(torch.cuda.get_device_properties(device).multi_processor_count)


def is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def check_tables(
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    num_splits: int | None,
    batch: int,
    device: torch.device,
    query: str,
) -> None:
    """A paged decode's block tables ([batch, max_blocks >= 1] int32), context lengths
    ([batch] int32), both on the query's `device` (named `query` in the messages), and split
    count (None or >= 1): what every paged decode kernel here takes."""
    if block_tables.dim() != 2 or block_tables.shape[0] != batch or block_tables.shape[1] < 1:
        raise ValueError(
            f"block_tables must be [batch={batch}, max_blocks >= 1], "
            f"got shape {tuple(block_tables.shape)}"
        )
    if context_lens.shape != (batch,):
        raise ValueError(
            f"context_lens must be [batch={batch}], got shape {tuple(context_lens.shape)}"
        )
    for name, t in (("block_tables", block_tables), ("context_lens", context_lens)):
        if t.dtype != torch.int32:
            raise ValueError(f"{name} dtype {t.dtype} must be torch.int32")
        if t.device != device:
            raise ValueError(f"{name} is on {t.device}, {query} on {device}")
    if num_splits is not None and num_splits < 1:
        raise ValueError(f"num_splits {num_splits} must be >= 1")


def _check_inputs(
    q: torch.Tensor,
    kv_layer: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    num_splits: int | None,
    out: torch.Tensor | None,
) -> None:
    if q.dim() != 3:
        raise ValueError(f"q must be [batch, num_q_heads, head_dim], got shape {tuple(q.shape)}")
    if kv_layer.dim() != 5 or kv_layer.shape[1] != 2:
        raise ValueError(
            "kv_layer must be [num_blocks, 2, block_size, num_kv_heads, head_dim], "
            f"got shape {tuple(kv_layer.shape)}"
        )
    batch, num_q_heads, head_dim = q.shape
    _, _, block_size, num_kv_heads, kv_head_dim = kv_layer.shape
    if q.dtype not in _DTYPES:
        raise ValueError(f"q dtype {q.dtype} is not one of {_DTYPES}")
    if kv_layer.dtype not in (q.dtype, FP8_KV_DTYPE):
        raise ValueError(f"kv_layer dtype {kv_layer.dtype} is neither q's {q.dtype} nor fp8")
    if kv_head_dim != head_dim:
        raise ValueError(f"kv_layer head_dim {kv_head_dim} != q head_dim {head_dim}")
    if not is_pow2(head_dim) or not 16 <= head_dim <= 256:
        raise ValueError(f"head_dim {head_dim} must be a power of two in [16, 256]")
    if not is_pow2(block_size) or block_size > 256:
        raise ValueError(f"block_size {block_size} must be a power of two <= 256")
    if num_kv_heads == 0 or num_q_heads % num_kv_heads != 0:
        raise ValueError(
            f"num_q_heads {num_q_heads} must be a multiple of num_kv_heads {num_kv_heads}"
        )
    if q.stride(-1) != 1 or kv_layer.stride(-1) != 1:
        raise ValueError(
            f"the last dim of q and kv_layer must be contiguous, strides {q.stride()} and "
            f"{kv_layer.stride()}"
        )
    if kv_layer.device != q.device:
        raise ValueError(f"kv_layer is on {kv_layer.device}, q on {q.device}")
    check_tables(block_tables, context_lens, num_splits, batch, q.device, "q")
    if out is not None:
        if out.shape != q.shape or out.dtype != q.dtype or out.device != q.device:
            raise ValueError(
                f"out is {tuple(out.shape)} {out.dtype} on {out.device}, "
                f"need {tuple(q.shape)} {q.dtype} on {q.device}"
            )
        if out.stride(-1) != 1:
            raise ValueError(f"the last dim of out must be contiguous, strides {out.stride()}")


def paged_decode_attention(
    q: torch.Tensor,
    kv_layer: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of each request's newest token over its paged context.

    Args:
        q: [batch, num_q_heads, head_dim], float32, float16 or bfloat16.
        kv_layer: [num_blocks, 2 (K, V), block_size, num_kv_heads, head_dim] in q's dtype;
            any strides on the first four dims (e.g. `kv_cache[:, layer]`), last dim
            contiguous.
        block_tables: [batch, max_blocks] int32; entries past a request's context are
            never read.
        context_lens: [batch] int32, tokens of each request's context including the newest
            one; each must be in [1, max_blocks * block_size] (not checked: that would
            read values, i.e. synchronize with the device).
        scale: softmax scale.
        num_splits: split-K partitions per request; None chooses them for the longest
            context the block tables hold (`choose_num_splits`); a caller that knows the
            batch's longest context passes the choice for that.
        out: [batch, num_q_heads, head_dim] in q's dtype, written in place if given.
        k_scale, v_scale: a float8_e4m3fn cache's scales (value = stored * scale).
        window: a sliding layer's window: only the last `window` keys are read.
        sinks: [num_q_heads] float32 sink logits: exp(sink) joins each head's denominator.

    Returns:
        [batch, num_q_heads, head_dim] in q's dtype (`out` when given).

    Raises:
        ValueError: on shapes, dtypes, devices or strides the kernels do not support.
    """
    _check_inputs(q, kv_layer, block_tables, context_lens, num_splits, out)
    batch, num_q_heads, head_dim = q.shape
    block_size, num_kv_heads = kv_layer.shape[2], kv_layer.shape[3]
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if batch == 0:
        return out
    if num_splits is None:
        num_splits = choose_num_splits(batch, num_kv_heads, block_tables.shape[1])

    group = num_q_heads // num_kv_heads
    # Every tile holds >= 32 tokens, so only the group and head_dim decide the dot's shape.
    use_dot = group > 1 and head_dim >= _MIN_DOT_DIM
    tiles = decode_tiles(q.dtype, head_dim, block_size, use_dot)
    block_h = triton.next_power_of_2(group)
    if use_dot:
        block_h = max(block_h, _MIN_DOT_DIM)

    # The multiply-sum path computes in fp32. The dot path keeps 16-bit operands for tensor
    # cores, except bf16 on CPU tensors: those run under Triton's interpreter, whose tl.dot
    # multiplies bf16 bit patterns as integers (triton-lang/triton#11584, unsupported).
    upcast = not use_dot or (q.dtype == torch.bfloat16 and q.device.type == "cpu")

    part_out = torch.empty(
        (batch, num_q_heads, num_splits, head_dim), dtype=torch.float32, device=q.device
    )
    part_lse = torch.empty((batch, num_q_heads, num_splits), dtype=torch.float32, device=q.device)
    _decode_split_kernel[(batch, num_kv_heads, num_splits)](
        q,
        kv_layer,
        block_tables,
        context_lens,
        part_out,
        part_lse,
        scale,
        float(k_scale),
        float(v_scale),
        window or 0,
        q.stride(0),
        q.stride(1),
        kv_layer.stride(0),
        kv_layer.stride(1),
        kv_layer.stride(2),
        kv_layer.stride(3),
        block_tables.stride(0),
        block_tables.stride(1),
        context_lens.stride(0),
        GROUP=group,
        BLOCK_H=block_h,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        TILE_BLOCKS=tiles.tile_blocks,
        NUM_STAGES=tiles.num_stages,
        USE_DOT=use_dot,
        UPCAST=upcast,
        FP8_KV=kv_layer.dtype == FP8_KV_DTYPE,
        num_warps=tiles.num_warps,
    )
    _decode_reduce_kernel[(batch, num_q_heads)](
        part_out,
        part_lse,
        out,
        sinks if sinks is not None else part_lse,  # never read without HAS_SINKS
        out.stride(0),
        out.stride(1),
        num_splits,
        HEAD_DIM=head_dim,
        SPLITS_PAD=triton.next_power_of_2(num_splits),
        HAS_SINKS=sinks is not None,
    )
    return out
