"""The layer's element-wise work between GEMMs as one kernel each, for CUDA (the CPU's bfloat16
path has its native twins in cpu_ops.c):

  add_rms_norm  h += y (the residual add, in place), then RMSNorm(h) * weight: two reads
                of the row and two writes, one launch, where torch takes eight
  rope          q and k heads rotated together (the rotate-half form of `apply_rotary`)
  silu_mul      SiLU(gate) * up from the fused gate/up GEMM's output

An eager decode step of a 32-layer model launched ~20 element-wise kernels per layer for
these; each is ~5-10 us of host time on a GPU, which CUDA graphs hide for pure-decode steps
only (issue 41).

The roundings are torch's, step by step: each bfloat16/float16 operation computes in fp32
and rounds to the tensor's dtype where torch's element-wise op would (RMSNorm: the
normalized row rounded before the weight multiplies it, as HF does), and fp32 products are
not contracted into FMAs (enable_fp_fusion=False), so the results equal torch's up to the
RMSNorm's sum of squares, which sums in another order (fp32 ulps).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@triton.jit
def _add_rms_norm_kernel(  # type: ignore[no-untyped-def]
    h_ptr,  # [n, hidden], updated in place when HAS_Y
    y_ptr,  # [n, hidden] (read only when HAS_Y)
    w_ptr,  # [hidden]
    out_ptr,  # [n, hidden]
    hidden,
    stride_h,
    stride_y,
    stride_o,
    eps,
    HAS_Y: tl.constexpr,
    BLOCK: tl.constexpr,  # >= hidden, a power of two
):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < hidden
    h_row = h_ptr + row.to(tl.int64) * stride_h
    h = tl.load(h_row + cols, mask=mask, other=0.0)
    if HAS_Y:
        y = tl.load(y_ptr + row.to(tl.int64) * stride_y + cols, mask=mask, other=0.0)
        h = (h.to(tl.float32) + y.to(tl.float32)).to(h_ptr.dtype.element_ty)
        tl.store(h_row + cols, h, mask=mask)
    x = h.to(tl.float32)
    mean_sq = tl.sum(x * x, axis=0) / hidden
    normed = (x * tl.math.rsqrt(mean_sq + eps)).to(h_ptr.dtype.element_ty)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    out = (w.to(tl.float32) * normed.to(tl.float32)).to(out_ptr.dtype.element_ty)
    tl.store(out_ptr + row.to(tl.int64) * stride_o + cols, out, mask=mask)


def add_rms_norm(
    h: torch.Tensor, y: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """h += y in place (when y is given), then weight * RMSNorm(h): [n, hidden] in h's dtype
    (`tandem.model.llama.rms_norm`'s order of operations).

    Raises:
        ValueError: shapes, dtypes or strides that do not fit.
    """
    if h.dim() != 2 or h.dtype not in _DTYPES or h.stride(1) != 1:
        raise ValueError(f"h must be [n, hidden] with contiguous rows, got {tuple(h.shape)}")
    n, hidden = h.shape
    if y is not None and (y.shape != h.shape or y.dtype != h.dtype or y.stride(1) != 1):
        raise ValueError(f"y must be h's shape and dtype, got {tuple(y.shape)} {y.dtype}")
    if weight.shape != (hidden,) or weight.dtype != h.dtype:
        raise ValueError(f"weight must be [{hidden}] {h.dtype}, got {tuple(weight.shape)}")
    out = torch.empty_like(h)
    if n:
        block = triton.next_power_of_2(hidden)
        _add_rms_norm_kernel[(n,)](
            h, y if y is not None else h, weight, out, hidden,
            h.stride(0), y.stride(0) if y is not None else 0, out.stride(0), eps,
            HAS_Y=y is not None, BLOCK=block, num_warps=_warps(block), enable_fp_fusion=False,
        )  # fmt: skip
    return out


@triton.jit
def _rope_kernel(  # type: ignore[no-untyped-def]
    x_ptr,  # [n, heads, head_dim]
    cos_ptr,  # [n, head_dim] (a [n, 1, head_dim] table)
    sin_ptr,
    out_ptr,  # [n, heads, head_dim], contiguous
    heads,
    stride_xt,
    stride_xh,
    stride_ct,
    stride_st,
    HALF: tl.constexpr,  # head_dim // 2, a power of two
    BLOCK_H: tl.constexpr,  # heads, padded to a power of two
):
    tok = tl.program_id(0)
    hs = tl.arange(0, BLOCK_H)
    ds = tl.arange(0, HALF)
    mask = (hs < heads)[:, None]
    x_tok = x_ptr + tok.to(tl.int64) * stride_xt + hs[:, None] * stride_xh
    lo = tl.load(x_tok + ds[None, :], mask=mask, other=0.0)  # [BLOCK_H, HALF]
    hi = tl.load(x_tok + HALF + ds[None, :], mask=mask, other=0.0)
    dtype = out_ptr.dtype.element_ty
    # the tables repeat their first half (emb = cat(freqs, freqs)); each half read as stored
    c_lo = tl.load(cos_ptr + tok.to(tl.int64) * stride_ct + ds)[None, :].to(tl.float32)
    c_hi = tl.load(cos_ptr + tok.to(tl.int64) * stride_ct + HALF + ds)[None, :].to(tl.float32)
    s_lo = tl.load(sin_ptr + tok.to(tl.int64) * stride_st + ds)[None, :].to(tl.float32)
    s_hi = tl.load(sin_ptr + tok.to(tl.int64) * stride_st + HALF + ds)[None, :].to(tl.float32)
    lo32, hi32 = lo.to(tl.float32), hi.to(tl.float32)
    # x * cos + rotate_half(x) * sin, rotate_half(x) = cat(-x_hi, x_lo); each product rounded
    out_lo = (lo32 * c_lo).to(dtype).to(tl.float32) + (-hi32 * s_lo).to(dtype).to(tl.float32)
    out_hi = (hi32 * c_hi).to(dtype).to(tl.float32) + (lo32 * s_hi).to(dtype).to(tl.float32)
    o_tok = out_ptr + tok.to(tl.int64) * heads * 2 * HALF + hs[:, None] * 2 * HALF
    tl.store(o_tok + ds[None, :], out_lo.to(dtype), mask=mask)
    tl.store(o_tok + HALF + ds[None, :], out_hi.to(dtype), mask=mask)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`tandem.model.rope.apply_rotary` in one kernel: x [n, heads, head_dim] (head_dim a
    power of two, the last dim contiguous), cos/sin [n, 1, head_dim] in x's dtype; a new
    contiguous [n, heads, head_dim].

    Raises:
        ValueError: shapes, dtypes or strides that do not fit.
    """
    if x.dim() != 3 or x.dtype not in _DTYPES or x.stride(2) != 1:
        raise ValueError(f"x must be [n, heads, head_dim] with contiguous dims, got {x.shape}")
    n, heads, head_dim = x.shape
    if head_dim < 2 or head_dim & (head_dim - 1):
        raise ValueError(f"head_dim must be a power of two, got {head_dim}")
    for name, t in (("cos", cos), ("sin", sin)):
        if t.shape != (n, 1, head_dim) or t.dtype != x.dtype or t.stride(2) != 1:
            raise ValueError(f"{name} must be [{n}, 1, {head_dim}] {x.dtype}, got {t.shape}")
    out = torch.empty((n, heads, head_dim), dtype=x.dtype, device=x.device)
    if n:
        block_h = triton.next_power_of_2(heads)
        _rope_kernel[(n,)](
            x, cos, sin, out, heads, x.stride(0), x.stride(1), cos.stride(0), sin.stride(0),
            HALF=head_dim // 2, BLOCK_H=block_h, num_warps=_warps(block_h * head_dim),
            enable_fp_fusion=False,
        )  # fmt: skip
    return out


@triton.jit
def _silu_mul_kernel(  # type: ignore[no-untyped-def]
    gu_ptr,  # [n, 2 * inter]: gate, then up
    out_ptr,  # [n, inter]
    inter,
    stride_gu,
    stride_o,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < inter
    gu_row = gu_ptr + row.to(tl.int64) * stride_gu
    gate = tl.load(gu_row + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(gu_row + inter + cols, mask=mask, other=0.0).to(tl.float32)
    dtype = out_ptr.dtype.element_ty
    act = (gate / (1.0 + tl.exp(-gate))).to(dtype)  # F.silu, rounded as torch rounds it
    tl.store(out_ptr + row.to(tl.int64) * stride_o + cols, (act.to(tl.float32) * up).to(dtype),
             mask=mask)  # fmt: skip


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """F.silu(gate) * up for gate_up [n, 2 * inter] (gate, then up; the last dim
    contiguous): [n, inter] in its dtype.

    Raises:
        ValueError: shapes, dtypes or strides that do not fit.
    """
    if gate_up.dim() != 2 or gate_up.dtype not in _DTYPES or gate_up.stride(1) != 1:
        raise ValueError(f"gate_up must be [n, 2 * inter], got {tuple(gate_up.shape)}")
    n, two_inter = gate_up.shape
    if two_inter % 2:
        raise ValueError(f"gate_up's width must be even, got {two_inter}")
    inter = two_inter // 2
    out = torch.empty((n, inter), dtype=gate_up.dtype, device=gate_up.device)
    if n and inter:
        block = min(1024, triton.next_power_of_2(inter))
        _silu_mul_kernel[(n, triton.cdiv(inter, block))](
            gate_up, out, inter, gate_up.stride(0), out.stride(0),
            BLOCK=block, num_warps=_warps(block), enable_fp_fusion=False,
        )  # fmt: skip
    return out


def _warps(elements: int) -> int:
    return 1 if elements <= 256 else 4 if elements <= 2048 else 8
