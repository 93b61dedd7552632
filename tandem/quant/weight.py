"""Quantized weight matrices: the one in-memory format every loader produces and every matmul
path (CPU, Triton) consumes, with the reference quantizers and the reference dequantization
that the kernels and loaders are tested against.

A matrix is stored output-major, as checkpoints store it ([out_features, in_features]):

  scheme  qweight                               scales                      zeros
  int8    int8  [out, in]                       fp32 [out]                  None (symmetric)
  int4    uint8 [out, in // 2], two per byte:   fp32 [out, in // group]     [out, in // group]:
          input 2j in the low nibble, 2j + 1                                uint8 0..15 (AWQ,
          in the high nibble                                                GPTQ), fp32 (GGUF
                                                                            Q4_1's -min/scale,
                                                                            online int4's),
                                                                            or None: 8
  fp8     float8_e4m3fn [out, in]               fp32 [out] (per channel)    None
                                                or [1] (per tensor)

  w[o, i] = (q[o, i] - zero[o, g(i)]) * scale[o, g(i)]      (int4; g(i) = i // group, or
                                                            g_idx[i] for GPTQ's act-order)
  w[o, i] = q[o, i] * scale[o]                              (int8, fp8)

The model multiplies activations [n, in] by w transposed: y = x @ w.T, i.e. [n, out]. int8
and int4 are weight-only (W8A16, W4A16: x stays in the model's dtype). fp8 is W8A8: every
path quantizes the activations too, dynamically, one scale per token (row) of x
(`quantize_fp8_activations`), as vLLM's FP8 and `torch._scaled_mm`'s row-wise scaling do:

  y[t, o] = sum_i e4m3(x[t, i] / sx[t]) * q[o, i] * sx[t] * scale[o],  sx[t] = max_i |x[t, i]| / 448

(`fp8_reference_matmul` is that product in float32, what the fp8 kernels are tested against.)
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

import torch

INT4_GROUP_SIZES = (32, 64, 128)
FP8_MAX = 448.0  # largest finite float8_e4m3fn
_EPS = 1e-12  # scale floor: an all-zero channel or group still gets a finite scale


class WeightScheme(StrEnum):
    NONE = "none"  # the checkpoint's (or --dtype's) floating point
    INT8 = "int8"  # W8A16, per output channel, symmetric
    INT4 = "int4"  # W4A16, group-wise along the input, asymmetric (zero points)
    FP8 = "fp8"  # W8A8: e4m3 weights (per channel or per tensor scales), e4m3 activations
    # quantized dynamically per token


@dataclass(frozen=True, slots=True)
class QuantizedWeight:
    """One weight matrix in a quantized scheme (layout in the module docstring).

    Attributes:
        scheme: INT8, INT4 or FP8.
        qweight: the quantized values, [out, in] (int4: [out, in // 2] packed).
        scales: fp32, [out] (int8, fp8 per channel), [1] (fp8 per tensor) or
            [out, in // group_size] (int4).
        zeros: int4 only: [out, in // group_size] zero points, uint8 in 0..15 or float32
            (fractional, as GGUF Q4_1's offsets); None means 8.
        group_size: int4: inputs per scale (32, 64 or 128); others: in_features.
        g_idx: int4 only, GPTQ's act-order: int32 [in], the group of each input (None: input
            i is in group i // group_size).
    """

    scheme: WeightScheme
    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None
    group_size: int
    g_idx: torch.Tensor | None = None

    def __post_init__(self) -> None:
        out, width = self.qweight.shape
        in_features = width * 2 if self.scheme is WeightScheme.INT4 else width
        want = {
            WeightScheme.INT8: torch.int8,
            WeightScheme.INT4: torch.uint8,
            WeightScheme.FP8: torch.float8_e4m3fn,
        }
        if self.scheme not in want:
            raise ValueError(f"scheme must be int8, int4 or fp8, got {self.scheme!r}")
        if self.qweight.dtype != want[self.scheme]:
            raise ValueError(
                f"{self.scheme} qweight must be {want[self.scheme]}, got {self.qweight.dtype}"
            )
        if self.scales.dtype != torch.float32:
            raise ValueError(f"scales must be float32, got {self.scales.dtype}")
        if self.scheme is WeightScheme.INT4:
            if self.group_size not in INT4_GROUP_SIZES or in_features % self.group_size:
                raise ValueError(
                    f"int4 group_size must be one of {INT4_GROUP_SIZES} and divide "
                    f"in_features {in_features}, got {self.group_size}"
                )
            groups = (out, in_features // self.group_size)
            if tuple(self.scales.shape) != groups:
                raise ValueError(f"int4 scales must be {groups}, got {tuple(self.scales.shape)}")
            if self.zeros is not None and (
                tuple(self.zeros.shape) != groups
                or self.zeros.dtype not in (torch.uint8, torch.float32)
            ):
                raise ValueError(
                    f"int4 zeros must be uint8 or float32 {groups}, got {self.zeros.dtype} "
                    f"{tuple(self.zeros.shape)}"
                )
            if self.g_idx is not None and (
                tuple(self.g_idx.shape) != (in_features,) or self.g_idx.dtype != torch.int32
            ):
                raise ValueError(
                    f"int4 g_idx must be int32 [{in_features}], got {self.g_idx.dtype} "
                    f"{tuple(self.g_idx.shape)}"
                )
        else:
            if self.zeros is not None or self.g_idx is not None:
                raise ValueError(f"{self.scheme} has no zero points or g_idx")
            if self.group_size != in_features:
                raise ValueError(f"{self.scheme} group_size must be in_features {in_features}")
            per_tensor = self.scheme is WeightScheme.FP8 and tuple(self.scales.shape) == (1,)
            if tuple(self.scales.shape) != (out,) and not per_tensor:
                raise ValueError(
                    f"{self.scheme} scales must be [{out}]"
                    + (" or [1]" if self.scheme is WeightScheme.FP8 else "")
                    + f", got {tuple(self.scales.shape)}"
                )

    @property
    def out_features(self) -> int:
        return int(self.qweight.shape[0])

    @property
    def in_features(self) -> int:
        width = int(self.qweight.shape[1])
        return width * 2 if self.scheme is WeightScheme.INT4 else width

    def num_bytes(self) -> int:
        """Bytes held: values, scales and zero points."""
        parts = [self.qweight, self.scales, self.zeros, self.g_idx]
        return sum(t.numel() * t.element_size() for t in parts if t is not None)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The reference: the matrix as [out, in] in `dtype` (computed in float32)."""
        if self.scheme is WeightScheme.INT4:
            q = unpack_int4(self.qweight).float()  # [out, in]
            zeros = (
                self.zeros.float() if self.zeros is not None else torch.full_like(self.scales, 8.0)
            )
            if self.g_idx is not None:
                group = self.g_idx.long()
            else:
                group = torch.arange(self.in_features, device=q.device) // self.group_size
            w = (q - zeros[:, group]) * self.scales[:, group]
        else:
            w = self.qweight.float() * self.scales.view(-1, 1)
        return w.to(dtype)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """[out, in] integers in 0..15 -> uint8 [out, in // 2] (input 2j low nibble, 2j + 1 high)."""
    if q.shape[-1] % 2:
        raise ValueError(f"int4 packing needs an even in_features, got {q.shape[-1]}")
    q = q.to(torch.uint8)
    return q[:, 0::2] | (q[:, 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [out, in // 2] -> uint8 [out, in] values in 0..15."""
    low, high = packed & 0xF, packed >> 4
    return torch.stack((low, high), dim=-1).flatten(-2)


def quantize_int8(w: torch.Tensor, absmax: torch.Tensor | None = None) -> QuantizedWeight:
    """Reference int8: per output channel, symmetric, scale = absmax / 127. w: [out, in];
    `absmax` ([out] float32): each row's largest |value| when w holds only some of its
    columns (a tensor-parallel rank's shard of a row-parallel matrix: the whole row's)."""
    wf = w.float()
    if absmax is None:
        absmax = wf.abs().amax(dim=1)
    scales = (absmax / 127.0).clamp_min(_EPS)  # [out]
    q = torch.round(wf / scales[:, None]).clamp_(-127, 127).to(torch.int8)
    return QuantizedWeight(WeightScheme.INT8, q, scales, None, int(w.shape[1]))


def quantize_int4(w: torch.Tensor, group_size: int = 128) -> QuantizedWeight:
    """Reference int4: per (output channel, input group of `group_size`), asymmetric min/max
    with a float zero point (llama.cpp Q4_1's rule, HQQ's): scale = (max - min) / 15,
    zero = -min / scale (float32), q = round(w / scale + zero) in 0..15, so the group's
    extremes are its grid's ends. w: [out, in].

    An integer zero point in 0..15 (AWQ's and GPTQ's, which also stretch the range to hold 0)
    moves the grid by up to half a step and clips an end by as much; on the default model it
    cost twice the perplexity of the float one (lm_head alone in int4, group 64: +13.0%
    against +8.4%, BENCHMARKS.md). Checkpoints with integer zero points load as stored.
    """
    out, in_features = w.shape
    if group_size not in INT4_GROUP_SIZES or in_features % group_size:
        raise ValueError(
            f"group_size must be one of {INT4_GROUP_SIZES} and divide {in_features}, "
            f"got {group_size}"
        )
    wg = w.float().view(out, in_features // group_size, group_size)
    lo, hi = wg.amin(dim=2), wg.amax(dim=2)
    scales = ((hi - lo) / 15.0).clamp_min(_EPS)  # [out, groups]
    zeros = -lo / scales
    q = torch.round(wg / scales[..., None] + zeros[..., None]).clamp_(0, 15)
    packed = pack_int4(q.view(out, in_features))
    return QuantizedWeight(WeightScheme.INT4, packed, scales, zeros, group_size)


def quantize_fp8(
    w: torch.Tensor, per_tensor: bool = False, absmax: torch.Tensor | None = None
) -> QuantizedWeight:
    """Reference fp8 (e4m3): scale = absmax / 448 per output channel (or for the whole
    tensor), values rounded to the nearest e4m3. w: [out, in]; `absmax` as int8's (per
    channel)."""
    wf = w.float()
    if absmax is None:
        absmax = wf.abs().amax().view(1) if per_tensor else wf.abs().amax(dim=1)
    scales = (absmax / FP8_MAX).clamp_min(_EPS)
    q = (wf / scales.view(-1, 1)).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return QuantizedWeight(WeightScheme.FP8, q, scales, None, int(w.shape[1]))


def quantize_fp8_activations(
    x: torch.Tensor, absmax: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """fp8's dynamic activation quantization: x [n, in] -> (e4m3 [n, in], float32 [n, 1]
    scales), one scale per token (row), absmax / 448, so each row's largest value is e4m3's
    largest and no row's range depends on another's (a per-tensor scale would push the
    tokens with small activations into e4m3's subnormals: +1 point of perplexity more on
    SmolLM2-135M, BENCHMARKS.md).

    The scale is the IEEE quotient absmax / 448 on every device: dividing by a tensor, since
    torch on CUDA turns a division by a Python scalar into a multiplication by its reciprocal
    (one bit off at times), which made the H200's result differ from the fused kernel's
    (`tandem.kernels.fp8_quant`, which divides exactly) in a few activations.

    `absmax` ([n, 1] float32): each row's largest |value| when x holds only some of its
    columns (a tensor-parallel rank's input to a row-parallel matrix: the whole row's)."""
    xf = x.float()
    if absmax is None:
        absmax = xf.abs().amax(dim=-1, keepdim=True)
    scales = (absmax / absmax.new_tensor(FP8_MAX)).clamp_min(_EPS)
    return (xf / scales).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scales


def fp8_reference_matmul(x: torch.Tensor, w: QuantizedWeight) -> torch.Tensor:
    """The fp8 (W8A8) product in float32: x [n, in] quantized per token, times the
    dequantized weight transposed: [n, out] float32 (module docstring)."""
    if w.scheme is not WeightScheme.FP8:
        raise ValueError(f"fp8_reference_matmul needs fp8 weights, got {w.scheme}")
    xq, sx = quantize_fp8_activations(x)
    return (xq.float() @ w.qweight.float().t()) * sx * w.scales.view(1, -1)


def quantize(
    w: torch.Tensor,
    scheme: WeightScheme,
    group_size: int = 128,
    absmax: torch.Tensor | None = None,
) -> QuantizedWeight:
    """Quantize an [out, in] matrix with the reference algorithm of `scheme`; `absmax`: the
    rows' largest |value| for the per-channel schemes (int8, fp8) when w is part of its
    rows (int4's groups lie inside a row's part: it takes none)."""
    if scheme is WeightScheme.INT8:
        return quantize_int8(w, absmax)
    if scheme is WeightScheme.INT4:
        if absmax is not None:
            raise ValueError("int4 scales are per input group: no whole-row absmax")
        return quantize_int4(w, group_size)
    if scheme is WeightScheme.FP8:
        return quantize_fp8(w, absmax=absmax)
    raise ValueError(f"scheme must be int8, int4 or fp8, got {scheme!r}")
