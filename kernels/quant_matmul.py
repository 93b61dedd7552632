"""Dequant-GEMM: y[n, out] = x[n, in] @ dequant(W).T with W quantized (tandem.quant.weight's
layout, output-major [out, in]), dequantized in registers, never in memory.

  scaled_matmul   int8 (W8A16) or fp8 e4m3: the tile's integers/e4m3 values are exact in
                  the activation dtype, so they feed tl.dot as they are and the per-channel
                  (or per-tensor) scale multiplies the fp32 accumulator once, in the epilogue.
                  fp8 W8A8 (`quantize_x`): the kernel also quantizes x, so a decode step's
                  fp8 linear is one launch: a first pass over the program's rows of x finds
                  each row's scale (max(absmax / 448, eps), tandem.kernels.fp8_quant's
                  values), the main loop puts each x tile on e4m3's grid before the dot,
                  and the epilogue multiplies by the row scale too. A program re-reads only
                  its BLOCK_M rows of x, small next to its BLOCK_N rows of w at decode sizes.
  int4_matmul     two inputs per byte (input 2j in the low nibble, 2j + 1 in the high one),
                  group-wise scales and zero points (uint8, float32, or none: 8), optional
                  g_idx (GPTQ's act-order: each input's group). The low nibbles meet x's even
                  inputs, the high nibbles its odd ones: two dots per K step and no
                  interleaving in registers:

                      byte j of row o:  [ hi = q[o, 2j+1] | lo = q[o, 2j] ]
                      acc += x[:, 0::2] @ ((lo - z) * s).T + x[:, 1::2] @ ((hi - z) * s).T

                  Without g_idx one K step covers one group (BLOCK_K = group_size), so the
                  step loads one scale and zero per output; with g_idx they are gathered per
                  (output, input).

Both accumulate in fp32 and store in x's dtype (float16, bfloat16, or float32 with IEEE dots).
Tiles: decode batches (1-16 rows) take 16-row tiles; prefill 64-row tiles (`tiles_for`).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import triton
import triton.language as tl

from tandem.kernels.fp8_quant import _round_to_e4m3
from tandem.quant.weight import _EPS, FP8_MAX

X_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
SCALED_DTYPES = (torch.int8, torch.float8_e4m3fn)
INT4_GROUP_SIZES = (32, 64, 128)
G_IDX_BLOCK_K = 64  # inputs per K step when groups follow g_idx


class Tiles(NamedTuple):
    block_m: int  # rows of x per program
    block_n: int  # outputs per program
    num_warps: int


def tiles_for(num_rows: int, int4: bool) -> Tiles:
    """Decode batches (1-16 rows): one 16-row tile (tl.dot's least), narrow in outputs so a
    GEMV still spreads over many programs; prefill: 64-row tiles over 8 warps (int4's two
    dequantized half-tiles take more registers than int8/fp8's one: 64 outputs, not 128).
    Compiled for sm_90 without spills (tests/kernels/test_quant_matmul.py)."""
    if num_rows <= 16:
        return Tiles(16, 32, 4)
    if num_rows <= 32:
        return Tiles(32, 64, 4)
    return Tiles(64, 64 if int4 else 128, 8)


# Triton reads kernel annotations (tl.constexpr), so the arguments carry comments instead.
# num_rows follows the batch: not specialised on (1, multiples of 16, other), so a batch size
# warm-up did not hit never compiles a variant mid-serving.
@triton.jit(do_not_specialize=["num_rows"])
def _scaled_matmul_kernel(  # type: ignore[no-untyped-def]
    x_ptr,  # [num_rows, in_features] activations, inputs contiguous
    w_ptr,  # [out_features, in_features] int8, or e4m3 bytes as uint8; inputs contiguous
    scales_ptr,  # fp32 [out_features] (per channel) or [1] (per tensor: stride_s = 0)
    out_ptr,  # [num_rows, out_features] in x's dtype, outputs contiguous
    num_rows,  # rows of x (masks the last row tile)
    out_features,  # masks the last output tile
    in_features,  # masks the last K step
    stride_xm,  # x.stride(0), elements
    stride_wn,  # w.stride(0)
    stride_s,  # scales' stride: 1 per channel, 0 per tensor
    stride_om,  # out.stride(0)
    BLOCK_M: tl.constexpr,  # rows per program
    BLOCK_N: tl.constexpr,  # outputs per program
    BLOCK_K: tl.constexpr,  # inputs per K step
    W_FP8: tl.constexpr,  # w holds e4m3 bytes (read as uint8: masked loads need an integer 0)
    QUANT_X: tl.constexpr,  # W8A8: quantize each row of x to e4m3 first (module docstring)
    EPS: tl.constexpr,  # QUANT_X: the smallest row scale
    FP8_MAX: tl.constexpr,  # QUANT_X: e4m3's largest value
    DOT_PRECISION: tl.constexpr,  # "ieee" for float32 activations, else "tf32" (unused)
    DOT_FP32: tl.constexpr,  # fp32 operands (Triton's CPU interpreter has no bf16 dot)
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] output channels
    ks = tl.arange(0, BLOCK_K)  # [BLOCK_K]
    row_ok = rows < num_rows
    col_ok = cols < out_features
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xm  # [BLOCK_M, 1]
    w_rows = w_ptr + cols.to(tl.int64)[:, None] * stride_wn  # [BLOCK_N, 1]
    if QUANT_X:
        # Each row's scale, max(absmax / 448, eps) divided exactly (as fp8_quant does): a
        # first pass over the program's rows of x, small next to its columns of w.
        absmax = tl.zeros((BLOCK_M,), dtype=tl.float32)
        for k0 in range(0, in_features, BLOCK_K):
            k = k0 + ks
            xk = tl.load(x_rows + k[None, :], mask=row_ok[:, None] & (k < in_features)[None, :],
                         other=0.0)  # fmt: skip
            absmax = tl.maximum(absmax, tl.max(tl.abs(xk.to(tl.float32)), axis=1))
        x_scale = tl.maximum(tl.math.div_rn(absmax, FP8_MAX), EPS)  # [BLOCK_M]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, in_features, BLOCK_K):
        k = k0 + ks
        k_ok = k < in_features
        x = tl.load(x_rows + k[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_rows + k[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0)
        if QUANT_X:
            # x / scale on e4m3's grid, in fp32: e4m3 values are exact in x's 16-bit dtype
            q = tl.math.div_rn(x.to(tl.float32), x_scale[:, None])
            q = _round_to_e4m3(tl.minimum(tl.maximum(q, -FP8_MAX), FP8_MAX))
            x = q.to(x.dtype)
        if W_FP8:
            w = w.to(tl.float8e4nv, bitcast=True)
        # int8 and e4m3 values are exact in float16/bfloat16: no rounding before the dot.
        if DOT_FP32:
            acc = tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), acc, input_precision="ieee")
        else:
            acc = tl.dot(x, tl.trans(w.to(x.dtype)), acc, input_precision=DOT_PRECISION)
    scale = tl.load(scales_ptr + cols * stride_s, mask=col_ok, other=0.0)  # [BLOCK_N]
    y = acc * scale[None, :]
    if QUANT_X:
        y = y * x_scale[:, None]
    out = out_ptr + rows.to(tl.int64)[:, None] * stride_om + cols[None, :]
    tl.store(out, y.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit(do_not_specialize=["num_rows"])
def _int4_matmul_kernel(  # type: ignore[no-untyped-def]
    x_ptr,  # [num_rows, in_features] activations, inputs contiguous
    qweight_ptr,  # uint8 [out_features, in_features // 2]: input 2j low nibble, 2j+1 high
    scales_ptr,  # fp32 [out_features, num_groups]
    zeros_ptr,  # [out_features, num_groups] uint8 or fp32 (read only when HAS_ZEROS)
    g_idx_ptr,  # int32 [in_features]: group of each input (read only when HAS_G_IDX)
    out_ptr,  # [num_rows, out_features] in x's dtype, outputs contiguous
    num_rows,  # rows of x (masks the last row tile)
    out_features,  # masks the last output tile
    in_features,  # even; masks the last K step
    stride_xm,  # x.stride(0), elements
    stride_qn,  # qweight.stride(0), bytes
    stride_sn,  # scales.stride(0)
    stride_zn,  # zeros.stride(0)
    stride_om,  # out.stride(0)
    GROUP_SIZE: tl.constexpr,  # inputs per group (32, 64, 128); without g_idx = BLOCK_K
    BLOCK_M: tl.constexpr,  # rows per program
    BLOCK_N: tl.constexpr,  # outputs per program
    BLOCK_K: tl.constexpr,  # inputs per K step (BLOCK_K // 2 bytes of each weight row)
    HAS_ZEROS: tl.constexpr,  # zero points given (else 8)
    HAS_G_IDX: tl.constexpr,  # groups follow g_idx (else input i is in group i // GROUP_SIZE)
    DOT_PRECISION: tl.constexpr,  # "ieee" for float32 activations
    DOT_FP32: tl.constexpr,  # fp32 operands (Triton's CPU interpreter has no bf16 dot)
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BLOCK_M]
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] output channels
    js = tl.arange(0, BLOCK_K // 2)  # [BLOCK_K / 2] byte columns of one K step
    row_ok = rows < num_rows
    col_ok = cols < out_features
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xm  # [BLOCK_M, 1]
    q_rows = qweight_ptr + cols.to(tl.int64)[:, None] * stride_qn  # [BLOCK_N, 1]
    s_rows = scales_ptr + cols.to(tl.int64) * stride_sn  # [BLOCK_N]
    z_rows = zeros_ptr + cols.to(tl.int64) * stride_zn  # [BLOCK_N]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, in_features, BLOCK_K):
        j = k0 // 2 + js  # byte column
        even = 2 * j  # input in the low nibble; 2j + 1 in the high one
        j_ok = even < in_features
        wmask = col_ok[:, None] & j_ok[None, :]  # [BLOCK_N, BLOCK_K / 2]
        packed = tl.load(q_rows + j[None, :], mask=wmask, other=0)  # uint8
        lo = (packed & 0xF).to(tl.float32)
        hi = (packed >> 4).to(tl.float32)
        if HAS_G_IDX:
            # Act-order: each input has its own group, gathered per (output, input).
            g_lo = tl.load(g_idx_ptr + even, mask=j_ok, other=0)  # [BLOCK_K / 2]
            g_hi = tl.load(g_idx_ptr + even + 1, mask=j_ok, other=0)
            s_lo = tl.load(s_rows[:, None] + g_lo[None, :], mask=wmask, other=0.0)
            s_hi = tl.load(s_rows[:, None] + g_hi[None, :], mask=wmask, other=0.0)
            if HAS_ZEROS:
                z_lo = tl.load(z_rows[:, None] + g_lo[None, :], mask=wmask, other=0).to(tl.float32)
                z_hi = tl.load(z_rows[:, None] + g_hi[None, :], mask=wmask, other=0).to(tl.float32)
            else:
                z_lo = 8.0
                z_hi = 8.0
        else:
            # The step lies inside one group (BLOCK_K == GROUP_SIZE): one scale per output.
            g = k0 // GROUP_SIZE
            s_lo = tl.load(s_rows + g, mask=col_ok, other=0.0)[:, None]  # [BLOCK_N, 1]
            s_hi = s_lo
            if HAS_ZEROS:
                z_lo = tl.load(z_rows + g, mask=col_ok, other=0).to(tl.float32)[:, None]
            else:
                z_lo = tl.full((BLOCK_N, 1), 8.0, tl.float32)
            z_hi = z_lo
        x_lo = tl.load(x_rows + even[None, :], mask=row_ok[:, None] & j_ok[None, :], other=0.0)
        x_hi = tl.load(x_rows + even[None, :] + 1, mask=row_ok[:, None] & j_ok[None, :], other=0.0)
        # Dequantized in fp32, rounded once to x's dtype for the dot (as the reference does).
        w_lo = ((lo - z_lo) * s_lo).to(x_lo.dtype)  # [BLOCK_N, BLOCK_K / 2]
        w_hi = ((hi - z_hi) * s_hi).to(x_lo.dtype)
        if DOT_FP32:  # bf16 values are exact in fp32: the same products
            x_lo, x_hi = x_lo.to(tl.float32), x_hi.to(tl.float32)
            w_lo, w_hi = w_lo.to(tl.float32), w_hi.to(tl.float32)
            acc = tl.dot(x_lo, tl.trans(w_lo), acc, input_precision="ieee")
            acc = tl.dot(x_hi, tl.trans(w_hi), acc, input_precision="ieee")
        else:
            acc = tl.dot(x_lo, tl.trans(w_lo), acc, input_precision=DOT_PRECISION)
            acc = tl.dot(x_hi, tl.trans(w_hi), acc, input_precision=DOT_PRECISION)
    out = out_ptr + rows.to(tl.int64)[:, None] * stride_om + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def _check_x(x: torch.Tensor, in_features: int, tensors: dict[str, torch.Tensor | None]) -> None:
    if x.dim() != 2 or x.shape[1] != in_features:
        raise ValueError(f"x must be [num_rows, {in_features}], got {tuple(x.shape)}")
    if x.dtype not in X_DTYPES:
        raise ValueError(f"x dtype must be one of {X_DTYPES}, got {x.dtype}")
    if x.stride(1) != 1:
        raise ValueError(f"x's inputs must be contiguous (stride 1), got stride {x.stride(1)}")
    devices = {name: t.device for name, t in tensors.items() if t is not None}
    if len(set(devices.values()) | {x.device}) != 1:
        raise ValueError(f"all tensors must be on x's device {x.device}, got {devices}")


def _out(x: torch.Tensor, out_features: int, out: torch.Tensor | None) -> torch.Tensor:
    shape = (x.shape[0], out_features)
    if out is None:
        return torch.empty(shape, dtype=x.dtype, device=x.device)
    if tuple(out.shape) != shape or out.dtype != x.dtype or out.stride(1) != 1:
        raise ValueError(
            f"out must be {shape} {x.dtype} with contiguous outputs, got {tuple(out.shape)} "
            f"{out.dtype} strides {out.stride()}"
        )
    return out


def _precision(x: torch.Tensor) -> str:
    return "ieee" if x.dtype == torch.float32 else "tf32"


def _dot_fp32(x: torch.Tensor) -> bool:
    # CPU tensors only run under the interpreter, which multiplies bf16 bit patterns as
    # integers: give it fp32 copies (exact for bf16 values).
    return x.device.type == "cpu" and x.dtype == torch.bfloat16


def scaled_matmul(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    out: torch.Tensor | None = None,
    quantize_x: bool = False,
) -> torch.Tensor:
    """y = x @ (qweight * scales[:, None]).T for int8 or fp8 e4m3 weights; with
    `quantize_x`, fp8's W8A8 product: x quantized per row to e4m3 in the kernel
    (`tandem.quant.weight.fp8_reference_matmul`'s values).

    Args:
        x: [num_rows, in_features] float16/bfloat16/float32, inputs contiguous.
        qweight: [out_features, in_features] int8 or float8_e4m3fn, inputs contiguous.
        scales: float32 [out_features] (per channel) or [1] (per tensor).
        out: optional [num_rows, out_features] in x's dtype, written in place.
        quantize_x: fp8 weights only: quantize x per row first.

    Returns:
        [num_rows, out_features] in x's dtype.

    Raises:
        ValueError: shapes, dtypes, devices or strides that do not fit together.
    """
    if qweight.dim() != 2 or qweight.dtype not in SCALED_DTYPES or qweight.stride(1) != 1:
        raise ValueError(
            f"qweight must be [out, in] int8 or float8_e4m3fn with contiguous inputs, got "
            f"{qweight.dtype} {tuple(qweight.shape)} strides {qweight.stride()}"
        )
    out_features, in_features = qweight.shape
    if scales.dtype != torch.float32 or tuple(scales.shape) not in ((out_features,), (1,)):
        raise ValueError(
            f"scales must be float32 [{out_features}] or [1], got {scales.dtype} "
            f"{tuple(scales.shape)}"
        )
    w_fp8 = qweight.dtype == torch.float8_e4m3fn
    if quantize_x and not w_fp8:
        raise ValueError(f"quantize_x is fp8's W8A8 product, got {qweight.dtype} weights")
    _check_x(x, in_features, {"qweight": qweight, "scales": scales})
    y = _out(x, out_features, out)
    if x.shape[0] == 0 or out_features == 0:
        return y
    tiles = tiles_for(x.shape[0], int4=False)
    block_k = 128 if x.shape[0] <= 16 else 64
    grid = (triton.cdiv(x.shape[0], tiles.block_m), triton.cdiv(out_features, tiles.block_n))
    _scaled_matmul_kernel[grid](
        x,
        qweight.view(torch.uint8) if w_fp8 else qweight,
        scales,
        y,
        x.shape[0],
        out_features,
        in_features,
        x.stride(0),
        qweight.stride(0),
        scales.stride(0) if scales.shape[0] == out_features and out_features > 1 else 0,
        y.stride(0),
        BLOCK_M=tiles.block_m,
        BLOCK_N=tiles.block_n,
        BLOCK_K=block_k,
        W_FP8=w_fp8,
        QUANT_X=quantize_x,
        EPS=_EPS,
        FP8_MAX=FP8_MAX,
        DOT_PRECISION=_precision(x),
        DOT_FP32=_dot_fp32(x),
        num_warps=tiles.num_warps,
    )
    return y


def int4_matmul(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    group_size: int,
    g_idx: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """y = x @ W.T with W[o, i] = (q[o, i] - zeros[o, g(i)]) * scales[o, g(i)], g(i) =
    i // group_size, or g_idx[i] when given; zeros None means 8.

    Args:
        x: [num_rows, in_features] float16/bfloat16/float32, inputs contiguous.
        qweight: uint8 [out_features, in_features // 2], two inputs per byte (module doc).
        scales: float32 [out_features, in_features // group_size].
        zeros: uint8 or float32, scales' shape, or None.
        group_size: 32, 64 or 128, dividing in_features.
        g_idx: int32 [in_features], each input's group (GPTQ act-order), or None. Values are
            not range-checked (that would sync with the device): the loader checked them.
        out: optional [num_rows, out_features] in x's dtype, written in place.

    Raises:
        ValueError: shapes, dtypes, devices or strides that do not fit together.
    """
    if qweight.dim() != 2 or qweight.dtype != torch.uint8 or qweight.stride(1) != 1:
        raise ValueError(
            f"qweight must be uint8 [out, in // 2] with contiguous bytes, got {qweight.dtype} "
            f"{tuple(qweight.shape)} strides {qweight.stride()}"
        )
    out_features, in_features = qweight.shape[0], 2 * qweight.shape[1]
    if group_size not in INT4_GROUP_SIZES or in_features % group_size:
        raise ValueError(
            f"group_size must be one of {INT4_GROUP_SIZES} and divide in_features "
            f"{in_features}, got {group_size}"
        )
    groups = (out_features, in_features // group_size)
    if scales.dtype != torch.float32 or tuple(scales.shape) != groups or scales.stride(1) != 1:
        raise ValueError(
            f"scales must be float32 {groups} with contiguous groups, got {scales.dtype} "
            f"{tuple(scales.shape)}"
        )
    if zeros is not None and (
        zeros.dtype not in (torch.uint8, torch.float32)
        or tuple(zeros.shape) != groups
        or zeros.stride(1) != 1
    ):
        raise ValueError(
            f"zeros must be uint8 or float32 {groups} with contiguous groups, got "
            f"{zeros.dtype} {tuple(zeros.shape)}"
        )
    if g_idx is not None and (
        g_idx.dtype != torch.int32 or tuple(g_idx.shape) != (in_features,) or g_idx.stride(0) != 1
    ):
        raise ValueError(
            f"g_idx must be contiguous int32 [{in_features}], got {g_idx.dtype} "
            f"{tuple(g_idx.shape)}"
        )
    _check_x(x, in_features, {"qweight": qweight, "scales": scales, "zeros": zeros, "g_idx": g_idx})
    y = _out(x, out_features, out)
    if x.shape[0] == 0 or out_features == 0:
        return y
    tiles = tiles_for(x.shape[0], int4=True)
    grid = (triton.cdiv(x.shape[0], tiles.block_m), triton.cdiv(out_features, tiles.block_n))
    _int4_matmul_kernel[grid](
        x,
        qweight,
        scales,
        zeros if zeros is not None else scales,  # never read
        g_idx if g_idx is not None else scales,  # never read
        y,
        x.shape[0],
        out_features,
        in_features,
        x.stride(0),
        qweight.stride(0),
        scales.stride(0),
        zeros.stride(0) if zeros is not None else 0,
        y.stride(0),
        GROUP_SIZE=group_size,
        BLOCK_M=tiles.block_m,
        BLOCK_N=tiles.block_n,
        BLOCK_K=G_IDX_BLOCK_K if g_idx is not None else group_size,
        HAS_ZEROS=zeros is not None,
        HAS_G_IDX=g_idx is not None,
        DOT_PRECISION=_precision(x),
        DOT_FP32=_dot_fp32(x),
        num_warps=tiles.num_warps,
    )
    return y


def quantized_linear(
    x: torch.Tensor, qw: Any, out: torch.Tensor | None = None, quantize_x: bool = False
) -> torch.Tensor:
    """x @ dequant(qw).T for a `tandem.quant.weight.QuantizedWeight` (read by its fields):
    int4 -> int4_matmul, int8/fp8 -> scaled_matmul (fp8 with `quantize_x`: W8A8)."""
    if qw.scheme == "int4":
        return int4_matmul(x, qw.qweight, qw.scales, qw.zeros, qw.group_size, qw.g_idx, out)
    return scaled_matmul(x, qw.qweight, qw.scales, out, quantize_x)
