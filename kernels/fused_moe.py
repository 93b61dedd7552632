"""Fused mixture-of-experts MLP: y[t] = sum_j w[t, j] * expert_{e[t, j]}(x[t]), SwiGLU experts,
as two grouped GEMMs over (token, slot) pairs sorted by expert.

The pairs are sorted by expert and each expert's run padded to a multiple of BLOCK_M
(`align_by_expert`), so every row tile belongs to one expert; padding rows hold the sentinel
`num_pairs` and are masked:

    pairs sorted:      e0 e0 e0 | e1 | e3 e3          (e2 idle)
    padded, BLOCK_M=2: [p p][p -] [p -] [p p] [- -]...  block_expert = [0, 0, 1, 3, E, ...]

  _gate_up_kernel  act[pair] = silu(x[token] @ Wg[e]) * (x[token] @ Wu[e]): one program per
                   (row tile, intermediate tile), gate and up accumulated side by side from
                   the fused [E, hidden, 2 * inter] matrix, the SwiGLU in the epilogue
  _down_kernel     out[pair] = w[pair] * (act[pair] @ Wd[e]): the routing weight applied in
                   the epilogue; the host sums each token's top_k rows (no atomics, so the
                   sum's order is fixed)

gpt-oss's experts (`biases`, `swiglu_limit`): each GEMM's bias added in its epilogue, and
the clamped SwiGLU (up + 1) * g * sigmoid(alpha * g), g = min(gate, limit), up clamped to
[-limit, limit], in place of silu(gate) * up.

MXFP4 experts (gpt-oss as OpenAI ships it, kept in 4 bits on the device): each matrix is
uint8 [E, in / 2, out], two e2m1 values per byte along the inputs (input 2i in the low nibble,
2i + 1 in the high one), with uint8 scales [E, in / 32, out], each block of 32 inputs of a
column scaled by 2^(scale - 127). A K step is one such block (BLOCK_K = 32): its bytes are
split and decoded in registers (`_mxfp4_tile`: every value times its power of two is exact in
bfloat16) and fed to the same dot as a bf16 tile, so a step reads a quarter of the bytes.

Every shape is a function of (num_tokens, top_k, num_experts, BLOCK_M) only, never of the
routing: the sort, the padding and both grids have fixed sizes and nothing is read back to
the host, so CUDA graphs capture a decode step through it. Tiles past the last expert's
run see block_expert == num_experts and return at once.

Accumulates in fp32; stores in x's dtype (float16, bfloat16, or float32 with IEEE dots).
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

X_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MXFP4_BLOCK = 32  # inputs per MXFP4 scale


def block_m_for(num_pairs: int, num_experts: int) -> int:
    """Rows per tile: 16 (tl.dot's least) while an expert's run is short (decode), 64 when
    runs are long enough to fill such tiles (prefill)."""
    return 16 if num_pairs <= 4 * num_experts * 16 else 64


def align_by_expert(
    expert_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The pairs sorted by expert, each expert's run padded to a multiple of block_m.

    Args:
        expert_ids: [num_tokens, top_k] int
    Returns:
        sorted_pairs: int32 [max_padded], flat pair ids (pair p is token p // top_k), the
            sentinel num_pairs in padding; max_padded = the most any routing needs.
        block_expert: int32 [max_padded // block_m], each tile's expert; num_experts past
            the last run.
    """
    flat = expert_ids.flatten().long()
    num_pairs = flat.numel()
    # every expert may leave up to block_m - 1 rows of padding
    num_blocks = triton.cdiv(num_pairs + num_experts * (block_m - 1), block_m)
    dev = flat.device
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    padded_ends = torch.cumsum(padded, 0)
    padded_starts = padded_ends - padded
    starts = torch.cumsum(counts, 0) - counts
    order = torch.argsort(flat, stable=True)  # [num_pairs]
    sorted_experts = flat[order]
    rank = torch.arange(num_pairs, device=dev) - starts[sorted_experts]  # within its expert
    sorted_pairs = torch.full((num_blocks * block_m,), num_pairs, dtype=torch.int32, device=dev)
    sorted_pairs[padded_starts[sorted_experts] + rank] = order.to(torch.int32)
    tile_starts = torch.arange(num_blocks, device=dev) * block_m
    block_expert = torch.searchsorted(padded_ends, tile_starts, right=True).to(torch.int32)
    return sorted_pairs, block_expert


# Triton reads kernel annotations (tl.constexpr), so the arguments carry comments instead.
@triton.jit
def _mxfp4_tile(packed, scale, dtype: tl.constexpr):  # type: ignore[no-untyped-def]
    """[R, N] uint8 (two e2m1 values each, low nibble first) and [N] uint8 scales (one per
    column for the tile's 2R inputs) -> the [2R, N] weights in `dtype`, exactly."""
    rows: tl.constexpr = packed.shape[0]
    cols: tl.constexpr = packed.shape[1]
    nib = tl.reshape(tl.permute(tl.join(packed & 0xF, packed >> 4), (0, 2, 1)), (2 * rows, cols))
    exp = ((nib >> 1) & 3).to(tl.float32)
    half = (nib & 1).to(tl.float32) * 0.5
    mag = tl.where(exp == 0.0, half, (1.0 + half) * tl.exp2(exp - 1.0))
    val = tl.where((nib & 8) != 0, -mag, mag)
    return (val * tl.exp2(scale.to(tl.float32) - 127.0)[None, :]).to(dtype)


@triton.jit(do_not_specialize=["num_pairs"])
def _gate_up_kernel(  # type: ignore[no-untyped-def]
    x_ptr,  # [num_tokens, hidden] activations, hidden contiguous
    w_ptr,  # [num_experts, hidden, 2 * inter]: gate columns, then up columns; contiguous
    sorted_pairs_ptr,  # int32 [num_blocks * BLOCK_M] pair ids by expert, num_pairs = padding
    block_expert_ptr,  # int32 [num_blocks] each tile's expert (num_experts: empty tile)
    act_ptr,  # [num_pairs, inter] out: silu(gate) * up per pair, in x's dtype
    bias_ptr,  # [num_experts, 2 * inter] gate | up biases, contiguous (read when HAS_BIAS)
    scales_ptr,  # MXFP4: uint8 [num_experts, hidden / 32, 2 * inter], contiguous
    num_pairs,  # num_tokens * TOP_K (the padding sentinel)
    num_experts,  # tiles with this expert are past the last run
    hidden,  # K of the GEMM
    inter,  # expert intermediate size (masks the last column tile)
    limit,  # CLAMPED: the SwiGLU's clamp
    alpha,  # CLAMPED: the sigmoid's gain
    stride_xm,  # x.stride(0)
    stride_we,  # w.stride(0)
    stride_wk,  # w.stride(1) (MXFP4: one row of bytes holds two inputs)
    stride_am,  # act.stride(0)
    TOP_K: tl.constexpr,  # slots per token (pair p is token p // TOP_K)
    BLOCK_M: tl.constexpr,  # pairs per program (one expert's)
    BLOCK_N: tl.constexpr,  # intermediate columns per program
    BLOCK_K: tl.constexpr,  # hidden inputs per K step
    DOT_PRECISION: tl.constexpr,  # "ieee" for float32 activations, else "tf32" (unused)
    DOT_FP32: tl.constexpr,  # fp32 operands (Triton's CPU interpreter has no bf16 dot)
    HAS_BIAS: tl.constexpr,  # gpt-oss: gate and up have per-expert biases
    CLAMPED: tl.constexpr,  # gpt-oss's clamped SwiGLU
    MXFP4: tl.constexpr,  # w is MXFP4 (BLOCK_K = 32: a step is one scale block)
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert >= num_experts:
        return
    pairs = tl.load(sorted_pairs_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))  # [BLOCK_M]
    row_ok = pairs < num_pairs
    tokens = (pairs // TOP_K).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N]
    col_ok = cols < inter
    ks = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + tokens[:, None] * stride_xm  # [BLOCK_M, 1]
    w_base = w_ptr + expert.to(tl.int64) * stride_we + cols[None, :]  # [1, BLOCK_N]
    gate = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        k = k0 + ks
        k_ok = k < hidden
        x = tl.load(x_rows + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        if MXFP4:  # hidden is a multiple of 32: no K mask
            kb = (k0 // 2 + tl.arange(0, BLOCK_K // 2)).to(tl.int64)
            b_rows = w_base + kb[:, None] * stride_wk  # [BLOCK_K / 2, BLOCK_N] bytes
            bmask = col_ok[None, :]
            s_row = scales_ptr + expert.to(tl.int64) * (hidden // 32) * 2 * inter
            s_row += (k0 // 32) * 2 * inter + cols
            wg = _mxfp4_tile(
                tl.load(b_rows, mask=bmask, other=0),
                tl.load(s_row, mask=col_ok, other=0),
                x_ptr.dtype.element_ty,
            )
            wu = _mxfp4_tile(tl.load(b_rows + inter, mask=bmask, other=0),
                             tl.load(s_row + inter, mask=col_ok, other=0),
                             x_ptr.dtype.element_ty)  # fmt: skip
        else:
            w_rows = w_base + k.to(tl.int64)[:, None] * stride_wk  # [BLOCK_K, BLOCK_N]
            wmask = k_ok[:, None] & col_ok[None, :]
            wg = tl.load(w_rows, mask=wmask, other=0.0)
            wu = tl.load(w_rows + inter, mask=wmask, other=0.0)
        if DOT_FP32:
            x = x.to(tl.float32)
            gate = tl.dot(x, wg.to(tl.float32), gate, input_precision="ieee")
            up = tl.dot(x, wu.to(tl.float32), up, input_precision="ieee")
        else:
            gate = tl.dot(x, wg, gate, input_precision=DOT_PRECISION)
            up = tl.dot(x, wu, up, input_precision=DOT_PRECISION)
    # SwiGLU in the epilogue, rounded like the torch path: gate and up in x's dtype first
    dtype = act_ptr.dtype.element_ty
    # (each bf16 product computed in fp32 and rounded: the interpreter has no bf16 arithmetic)
    g = gate.to(dtype).to(tl.float32)
    u = up.to(dtype).to(tl.float32)
    if HAS_BIAS:
        b = bias_ptr + expert.to(tl.int64) * 2 * inter + cols
        g = (g + tl.load(b, mask=col_ok, other=0.0).to(tl.float32)[None, :]).to(dtype)
        u = (u + tl.load(b + inter, mask=col_ok, other=0.0).to(tl.float32)[None, :]).to(dtype)
        g = g.to(tl.float32)
        u = u.to(tl.float32)
    if CLAMPED:
        g = tl.minimum(g, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit)
        ga = (g * alpha).to(dtype).to(tl.float32)
        sig = (1.0 / (1.0 + tl.exp(-ga))).to(dtype).to(tl.float32)
        glu = (g * sig).to(dtype).to(tl.float32)
        act = ((u + 1.0).to(dtype).to(tl.float32) * glu).to(dtype)
    else:
        silu = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)
        act = (silu * u).to(dtype)
    out = act_ptr + pairs.to(tl.int64)[:, None] * stride_am + cols[None, :]
    tl.store(out, act, mask=row_ok[:, None] & col_ok[None, :])


@triton.jit(do_not_specialize=["num_pairs"])
def _down_kernel(  # type: ignore[no-untyped-def]
    act_ptr,  # [num_pairs, inter] silu(gate) * up per pair, inter contiguous
    w_ptr,  # [num_experts, inter, hidden] contiguous
    sorted_pairs_ptr,  # int32 [num_blocks * BLOCK_M] pair ids by expert, num_pairs = padding
    block_expert_ptr,  # int32 [num_blocks] each tile's expert (num_experts: empty tile)
    weights_ptr,  # [num_pairs] routing weight of each pair (fp32 or x's dtype)
    bias_ptr,  # [num_experts, hidden] contiguous (read when HAS_BIAS)
    scales_ptr,  # MXFP4: uint8 [num_experts, inter / 32, hidden], contiguous
    out_ptr,  # [num_pairs, hidden] out: each pair's weighted expert output
    num_pairs,  # the padding sentinel
    num_experts,  # tiles with this expert are past the last run
    inter,  # K of the GEMM
    hidden,  # masks the last column tile
    stride_am,  # act.stride(0)
    stride_we,  # w.stride(0)
    stride_wk,  # w.stride(1)
    stride_om,  # out.stride(0)
    BLOCK_M: tl.constexpr,  # pairs per program (one expert's)
    BLOCK_N: tl.constexpr,  # hidden columns per program
    BLOCK_K: tl.constexpr,  # intermediate inputs per K step
    DOT_PRECISION: tl.constexpr,  # "ieee" for float32 activations, else "tf32" (unused)
    DOT_FP32: tl.constexpr,  # fp32 operands (Triton's CPU interpreter has no bf16 dot)
    HAS_BIAS: tl.constexpr,  # gpt-oss: down has per-expert biases
    MXFP4: tl.constexpr,  # w is MXFP4 (BLOCK_K = 32: a step is one scale block)
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + pid_m)
    if expert >= num_experts:
        return
    pairs = tl.load(sorted_pairs_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))  # [BLOCK_M]
    row_ok = pairs < num_pairs
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < hidden
    ks = tl.arange(0, BLOCK_K)
    a_rows = act_ptr + pairs.to(tl.int64)[:, None] * stride_am  # [BLOCK_M, 1]
    w_base = w_ptr + expert.to(tl.int64) * stride_we + cols[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        k = k0 + ks
        k_ok = k < inter
        a = tl.load(a_rows + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        if MXFP4:  # inter is a multiple of 32: no K mask
            kb = (k0 // 2 + tl.arange(0, BLOCK_K // 2)).to(tl.int64)
            s_row = scales_ptr + (expert.to(tl.int64) * (inter // 32) + k0 // 32) * hidden + cols
            w = _mxfp4_tile(
                tl.load(w_base + kb[:, None] * stride_wk, mask=col_ok[None, :], other=0),
                tl.load(s_row, mask=col_ok, other=0),
                act_ptr.dtype.element_ty,
            )
        else:
            w = tl.load(
                w_base + k.to(tl.int64)[:, None] * stride_wk,
                mask=k_ok[:, None] & col_ok[None, :],
                other=0.0,
            )
        if DOT_FP32:
            acc = tl.dot(a.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, w, acc, input_precision=DOT_PRECISION)
    # the routing weight in the epilogue, on the expert's output in x's dtype (the torch
    # path's order of roundings)
    dtype = out_ptr.dtype.element_ty
    rw = tl.load(weights_ptr + pairs, mask=row_ok, other=0.0).to(tl.float32)  # [BLOCK_M]
    y = acc.to(dtype).to(tl.float32)
    if HAS_BIAS:
        bias = tl.load(bias_ptr + expert.to(tl.int64) * hidden + cols, mask=col_ok, other=0.0)
        y = (y + bias.to(tl.float32)[None, :]).to(dtype).to(tl.float32)
    y = y * rw[:, None]
    out = out_ptr + pairs.to(tl.int64)[:, None] * stride_om + cols[None, :]
    tl.store(out, y.to(dtype), mask=row_ok[:, None] & col_ok[None, :])


def _check_mxfp4(
    gate_up: torch.Tensor,
    down: torch.Tensor,
    gate_up_scales: torch.Tensor | None,
    down_scales: torch.Tensor | None,
    hidden: int,
    inter: int,
) -> None:
    if hidden % MXFP4_BLOCK or inter % MXFP4_BLOCK:
        raise ValueError(f"MXFP4 experts need hidden ({hidden}) and inter ({inter}) in 32s")
    num_experts = gate_up.shape[0]
    want = ((num_experts, hidden // MXFP4_BLOCK, 2 * inter),
            (num_experts, inter // MXFP4_BLOCK, hidden))  # fmt: skip
    for name, t, shape in (("gate_up_scales", gate_up_scales, want[0]),
                           ("down_scales", down_scales, want[1])):  # fmt: skip
        if t is None or t.shape != shape or t.dtype != torch.uint8 or not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous uint8 {list(shape)}")
    if gate_up.dtype != torch.uint8 or down.dtype != torch.uint8:
        raise ValueError(f"MXFP4 experts must be uint8, got {gate_up.dtype}, {down.dtype}")


def _tiles(block_m: int) -> dict[str, Any]:
    return dict(BLOCK_M=block_m, BLOCK_N=64, BLOCK_K=32 if block_m <= 16 else 64)


def fused_moe(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    expert_ids: torch.Tensor,
    weights: torch.Tensor,
    first_expert: int = 0,
    gate_up_bias: torch.Tensor | None = None,
    down_bias: torch.Tensor | None = None,
    swiglu_limit: float | None = None,
    swiglu_alpha: float = 1.702,
    gate_up_scales: torch.Tensor | None = None,
    down_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """The experts' routed, weighted sum per token; with expert parallelism (`gate_up` and
    `down` hold experts [first_expert, first_expert + num_local) of more), the sum over the
    pairs routed to those: the others' rows stay zero. gpt-oss: `gate_up_bias` [E, 2 * inter]
    and `down_bias` [E, hidden] (contiguous, x's dtype), and with `swiglu_limit` its clamped
    SwiGLU.

    Args:
        x: [num_tokens, hidden] float16/bfloat16/float32, hidden contiguous.
        gate_up: [num_experts, hidden, 2 * inter] in x's dtype, contiguous (gate, then up);
            MXFP4 (with `gate_up_scales`): uint8 [num_experts, hidden / 2, 2 * inter].
        down: [num_experts, inter, hidden] in x's dtype, contiguous; MXFP4 (with
            `down_scales`): uint8 [num_experts, inter / 2, hidden].
        expert_ids: [num_tokens, top_k] int, global expert ids.
        weights: [num_tokens, top_k] routing weights (fp32 or x's dtype).
        gate_up_scales, down_scales: MXFP4's uint8 scales, [num_experts, hidden / 32,
            2 * inter] and [num_experts, inter / 32, hidden], contiguous (module docstring).
    Returns:
        [num_tokens, hidden] in x's dtype.
    Raises:
        ValueError: shapes, dtypes or layouts that do not fit.
    """
    if x.dim() != 2 or x.dtype not in X_DTYPES or x.stride(1) != 1:
        raise ValueError(
            f"x must be [num_tokens, hidden] float16/bfloat16/float32 with contiguous hidden, "
            f"got {tuple(x.shape)} {x.dtype}"
        )
    n, hidden = x.shape
    num_experts, _, two_inter = gate_up.shape
    inter = two_inter // 2
    mxfp4 = gate_up_scales is not None
    pack = 2 if mxfp4 else 1  # inputs per stored element
    if gate_up.shape != (num_experts, hidden // pack, 2 * inter) or not gate_up.is_contiguous():
        raise ValueError(
            f"gate_up must be contiguous [E, {hidden // pack}, 2 * inter], got {gate_up.shape}"
        )
    if down.shape != (num_experts, inter // pack, hidden) or not down.is_contiguous():
        raise ValueError(
            f"down must be contiguous [{num_experts}, {inter // pack}, {hidden}], got "
            f"{tuple(down.shape)}"
        )
    if mxfp4:
        _check_mxfp4(gate_up, down, gate_up_scales, down_scales, hidden, inter)
    elif gate_up.dtype != x.dtype or down.dtype != x.dtype or down_scales is not None:
        raise ValueError(f"expert weights must be {x.dtype}, got {gate_up.dtype}, {down.dtype}")
    if expert_ids.dim() != 2 or expert_ids.shape[0] != n or weights.shape != expert_ids.shape:
        raise ValueError(
            f"expert_ids and weights must be [{n}, top_k], got {tuple(expert_ids.shape)} and "
            f"{tuple(weights.shape)}"
        )
    top_k = expert_ids.shape[1]
    num_pairs = n * top_k
    block_m = block_m_for(num_pairs, num_experts)
    local = expert_ids - first_expert
    # another rank's pairs go to bin num_experts, whose tiles return at once (fixed shapes)
    local = torch.where((local >= 0) & (local < num_experts), local, num_experts)
    sorted_pairs, block_expert = align_by_expert(local, num_experts + 1, block_m)
    tiles = _tiles(block_m)
    num_blocks = block_expert.shape[0]
    fp32 = x.device.type == "cpu" and x.dtype != torch.float32  # the interpreter's dots
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    for name, bias, shape in (("gate_up_bias", gate_up_bias, (num_experts, 2 * inter)),
                              ("down_bias", down_bias, (num_experts, hidden))):  # fmt: skip
        if bias is not None and (
            bias.shape != shape or not bias.is_contiguous() or bias.dtype != x.dtype
        ):
            raise ValueError(f"{name} must be contiguous {list(shape)} {x.dtype}")
    act = torch.empty(num_pairs, inter, dtype=x.dtype, device=x.device)
    clamped = swiglu_limit is not None
    if mxfp4:
        tiles["BLOCK_K"] = MXFP4_BLOCK  # a K step is one scale block
    _gate_up_kernel[(num_blocks, triton.cdiv(inter, tiles["BLOCK_N"]))](
        x, gate_up, sorted_pairs, block_expert, act,
        gate_up_bias if gate_up_bias is not None else act,  # never read without HAS_BIAS
        gate_up_scales if mxfp4 else act,  # never read without MXFP4
        num_pairs, num_experts, hidden, inter,
        float(swiglu_limit or 0.0), float(swiglu_alpha),
        x.stride(0), gate_up.stride(0), gate_up.stride(1), act.stride(0),
        TOP_K=top_k, DOT_PRECISION=precision, DOT_FP32=fp32,
        HAS_BIAS=gate_up_bias is not None, CLAMPED=clamped, MXFP4=mxfp4, **tiles,
    )  # fmt: skip
    out = torch.zeros(num_pairs, hidden, dtype=x.dtype, device=x.device)  # others' pairs: 0
    _down_kernel[(num_blocks, triton.cdiv(hidden, tiles["BLOCK_N"]))](
        act, down, sorted_pairs, block_expert, weights.reshape(-1).contiguous(),
        down_bias if down_bias is not None else out, down_scales if mxfp4 else out, out,
        num_pairs, num_experts, inter, hidden,
        act.stride(0), down.stride(0), down.stride(1), out.stride(0),
        DOT_PRECISION=precision, DOT_FP32=fp32, HAS_BIAS=down_bias is not None,
        MXFP4=mxfp4, **tiles,
    )  # fmt: skip
    # each token's top_k rows, summed in a fixed order
    return out.view(n, top_k, hidden).sum(1)
