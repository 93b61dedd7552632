"""Split-K matmul for decode batches: y[m, n] = x[m, k] @ w[k, n] with few rows (1-16), w in
the engine's layout ([in, out], outputs contiguous: `tandem.model.linear`'s plain path).

At 1-16 rows a projection is a read of its weights; cuBLAS reached 0.43-0.68 of the device's
copy rate there on an H200 (BENCHMARKS.md "GPU check": qkv 0.51, o 0.43), against ~0.9 on
large matrices, because a tile grid over the outputs alone leaves the SMs short of loads in
flight. Here the inputs are split as well: a program owns BLOCK_N outputs and one of
`split_k` runs of the inputs, so (outputs / BLOCK_N) x split_k programs stream the matrix,
each writing an fp32 partial; the partials are summed in a fixed order (no atomics: the
result does not depend on scheduling).

    w [k, n]:   k runs 0..split_k-1 down, BLOCK_N columns across
                +-----+-----+-----+
      run 0     | p00 | p01 | p02 |   program (column tile j, run r) -> partial[r, :, tile j]
      run 1     | p10 | p11 | p12 |   y = sum over r of partial[r]   (then x's dtype)
                +-----+-----+-----+

A candidate, not the engine's default: the GPU check's quant part times it against cuBLAS
(`x @ w` in the engine's layout and `F.linear`) at 1-16 rows and says which is faster.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

X_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
BLOCK_M = 16  # tl.dot's least rows: a decode batch of up to 16 is one row tile
MAX_ROWS = 16
BLOCK_N = 64
BLOCK_K = 64  # 128 spills on sm_90 (80 registers a thread) with 4 warps
# Programs per SM to aim for: enough loads in flight to cover memory latency.
PROGRAMS_PER_SM = 4


@triton.jit
def _splitk_kernel(  # type: ignore[no-untyped-def]
    x_ptr,  # [m, k], inputs contiguous
    w_ptr,  # [k, n], outputs contiguous
    part_ptr,  # [split_k, m, n] fp32, out
    m,
    n,
    k,
    k_per_split,  # inputs per run, a multiple of BLOCK_K
    stride_xm,
    stride_wk,
    stride_pk,  # part.stride(0)
    stride_pm,  # part.stride(1)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_FP32: tl.constexpr,  # fp32 operands (the interpreter's dots; fp32 inputs)
):
    pid_n = tl.program_id(0)
    run = tl.program_id(1)
    rows = tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    row_ok = rows < m
    col_ok = cols < n
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_start = run * k_per_split
    k_end = tl.minimum(k_start + k_per_split, k)
    for k0 in range(k_start, k_end, BLOCK_K):
        kk = k0 + ks
        k_ok = kk < k_end
        x = tl.load(x_ptr + rows[:, None] * stride_xm + kk[None, :],
                    mask=row_ok[:, None] & k_ok[None, :], other=0.0)  # fmt: skip
        w = tl.load(w_ptr + kk.to(tl.int64)[:, None] * stride_wk + cols[None, :],
                    mask=k_ok[:, None] & col_ok[None, :], other=0.0)  # fmt: skip
        if DOT_FP32:
            acc = tl.dot(x.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(x, w, acc)
    part = part_ptr + run * stride_pk + rows[:, None] * stride_pm + cols[None, :]
    tl.store(part, acc, mask=row_ok[:, None] & col_ok[None, :])


def choose_split_k(n: int, k: int, num_sms: int) -> int:
    """Runs of the inputs so that about PROGRAMS_PER_SM programs per SM stream the matrix:
    a power of two, at most one run per BLOCK_K inputs, at least 1."""
    tiles = -(-n // BLOCK_N)
    want = max(1, (PROGRAMS_PER_SM * num_sms) // tiles)
    steps = -(-k // BLOCK_K)
    split = 1
    while split * 2 <= min(want, steps):
        split *= 2
    return split


def splitk_matmul(x: torch.Tensor, w: torch.Tensor, split_k: int | None = None) -> torch.Tensor:
    """x [m, k] @ w [k, n] for m <= MAX_ROWS, in x's dtype (fp32 accumulation, the runs'
    partials summed in order).

    Args:
        x: [m, k] float16/bfloat16/float32, inputs contiguous.
        w: [k, n] in x's dtype, outputs contiguous (the engine's layout).
        split_k: runs of the inputs; default `choose_split_k` for the device's SMs.

    Raises:
        ValueError: shapes, dtypes or strides that do not fit, or more than MAX_ROWS rows.
    """
    if x.dim() != 2 or x.dtype not in X_DTYPES or x.stride(1) != 1:
        raise ValueError(f"x must be [m, k] with contiguous inputs, got {tuple(x.shape)} {x.dtype}")
    m, k = x.shape
    if m > MAX_ROWS:
        raise ValueError(f"splitk_matmul takes at most {MAX_ROWS} rows, got {m}")
    if w.dim() != 2 or w.shape[0] != k or w.dtype != x.dtype or w.stride(1) != 1:
        raise ValueError(
            f"w must be [{k}, n] {x.dtype} with contiguous outputs, got {tuple(w.shape)} "
            f"{w.dtype} strides {w.stride()}"
        )
    n = w.shape[1]
    if k == 0:
        return torch.zeros((m, n), dtype=x.dtype, device=x.device)
    if split_k is None:
        from tandem.kernels.decode_attention import device_num_sms

        split_k = choose_split_k(n, k, device_num_sms(x.device))
    k_per_split = triton.cdiv(triton.cdiv(k, split_k), BLOCK_K) * BLOCK_K  # whole K steps
    split_k = triton.cdiv(k, k_per_split)  # no empty run
    part = torch.empty((split_k, m, n), dtype=torch.float32, device=x.device)
    if m and n:
        _splitk_kernel[(triton.cdiv(n, BLOCK_N), split_k)](
            x, w, part, m, n, k, k_per_split, x.stride(0), w.stride(0),
            part.stride(0), part.stride(1),
            BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
            DOT_FP32=x.device.type == "cpu" or x.dtype == torch.float32, num_warps=4,
        )  # fmt: skip
    return part.sum(0).to(x.dtype)
