"""fp8 (W8A8) activation quantization in one kernel: x [n, in] -> e4m3 [n, in] and one
float32 scale per row, the same values as `tandem.quant.weight.quantize_fp8_activations`
(scale = max(absmax / 448, eps); q = e4m3(clamp(x / scale, -448, 448)), rounded to nearest).

Why a kernel: in torch that is eight element-wise launches (cast, abs, amax, divide, clamp,
divide, clamp, cast) before every fp8 matmul, four matmuls per layer. On an H200 they made a
Llama-3-8B-shaped engine with fp8 weights 0.76x as fast per decode step as bf16 (8.3 vs
6.3 ms, CUDA graphs on: benchmarks/results/gpu/run2). One program per row reads the row
twice (absmax, then quantize; the second read hits L2) and writes it once.

Exactness: both divisions are IEEE round-to-nearest (`div_rn`, as torch divides; Triton's
default fp32 division is approximate), and each value is rounded to the e4m3 grid, ties to
even, before the cast (`_round_to_e4m3`), so the bytes and scales equal the reference's on
a GPU and under the interpreter alike (tests/kernels/test_fp8_quant.py).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem.quant.weight import _EPS, FP8_MAX

_BLOCK = 1024  # columns per loop iteration


@triton.jit
def _fp8_rows_kernel(  # type: ignore[no-untyped-def]
    x_ptr,  # [n, in] in fp16/bf16/fp32
    q_ptr,  # [n, in] float8_e4m3fn, out
    scales_ptr,  # [n] float32, out
    n_cols,
    stride_x,  # x.stride(0); x.stride(1) is 1
    stride_q,  # q.stride(0)
    EPS: tl.constexpr,
    FP8_MAX: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    x_row = x_ptr + row.to(tl.int64) * stride_x
    cols = tl.arange(0, BLOCK)
    absmax = tl.zeros([BLOCK], tl.float32)
    for start in range(0, n_cols, BLOCK):
        x = tl.load(x_row + start + cols, mask=start + cols < n_cols, other=0.0).to(tl.float32)
        absmax = tl.maximum(absmax, tl.abs(x))
    scale = tl.maximum(tl.math.div_rn(tl.max(absmax, axis=0), FP8_MAX), EPS)
    tl.store(scales_ptr + row, scale)
    q_row = q_ptr + row.to(tl.int64) * stride_q
    for start in range(0, n_cols, BLOCK):
        mask = start + cols < n_cols
        x = tl.load(x_row + start + cols, mask=mask, other=0.0).to(tl.float32)
        q = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -FP8_MAX), FP8_MAX)
        tl.store(q_row + start + cols, _round_to_e4m3(q).to(tl.float8e4nv), mask=mask)


@triton.jit
def _round_to_e4m3(q):  # type: ignore[no-untyped-def]
    """|q| <= 448 rounded to the nearest e4m3 value, ties to even, in fp32: the cast that
    follows is then exact on any target (a GPU's cvt.rn rounds the same way; Triton's
    interpreter rounds wrongly, e.g. 124.3 -> 64). e4m3 has 3 mantissa bits and a smallest
    normal exponent of -6, so the grid step around q is 2^(max(exponent(q), -6) - 3); q / step
    is exact (a power of two) and at most 16, so adding and subtracting 1.5 * 2^23 rounds it
    to an integer, ties to even (on the magnitude; the sign is q's)."""
    bits = q.to(tl.int32, bitcast=True)
    exponent = ((bits >> 23) & 0xFF) - 127
    exponent = tl.maximum(exponent, -6) - 3
    step = ((exponent + 127) << 23).to(tl.float32, bitcast=True)
    inv_step = ((127 - exponent) << 23).to(tl.float32, bitcast=True)
    magic = 12582912.0  # 1.5 * 2^23
    rounded = ((tl.abs(q) * inv_step + magic) - magic) * step
    # q's sign bit on the magnitude: a negative value that rounds to zero stays -0, as in torch
    sign = bits & -2147483648
    return (rounded.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


def quantize_fp8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [n, in] (last dim contiguous) -> (e4m3 [n, in], float32 [n, 1] scales)."""
    if x.dim() != 2 or x.stride(1) != 1:
        raise ValueError(f"x must be [n, in] with contiguous rows, got {tuple(x.shape)}")
    n, cols = x.shape
    q = torch.empty((n, cols), dtype=torch.float8_e4m3fn, device=x.device)
    scales = torch.empty((n, 1), dtype=torch.float32, device=x.device)
    if n:
        block = min(_BLOCK, triton.next_power_of_2(max(cols, 16)))
        _fp8_rows_kernel[(n,)](
            x, q, scales, cols, x.stride(0), q.stride(0),
            EPS=_EPS, FP8_MAX=FP8_MAX, BLOCK=block, num_warps=4 if block >= 512 else 1,
        )  # fmt: skip
    return q, scales
