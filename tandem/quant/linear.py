"""Quantized weight matrices applied by the model: `pack_quantized` turns a `QuantizedWeight`
into the form its device's fastest path reads (`QuantLinear`, chosen once at load), and
`quant_matmul` applies it. `tandem.model.linear.matmul` dispatches here.

  path          where                     how
  int4_packed   CPU, bfloat16 activations torch's W4A16 kernel (`_weight_int4pack_mm_for_cpu`)
                                          up to INT4_PACKED_MAX_ROWS rows (decode); above,
                                          dequantized into a reused bfloat16 buffer and one
                                          bfloat16 GEMM (prefill)
  int8_packed   CPU, bfloat16 activations torch's W8A16 kernel (`_weight_int8pack_mm`) up to
                                          INT8_PACKED_MAX_ROWS rows; above, the int8 values
                                          cast into a reused buffer, one GEMM, the channel
                                          scales applied to the output
  fp8_decoded   CPU                       activations quantized per token to e4m3, both
                                          operands cast (exactly) to the activations' dtype
                                          (the weight into a reused buffer), one GEMM, the
                                          token and channel scales on the output in float32
                                          (torch's CPU `_scaled_mm` computes the same, ~2x
                                          slower here)
  fp8_scaled_mm CUDA, compute capability  `torch._scaled_mm`: e4m3 x e4m3 on FP8 tensor cores,
                >= 8.9, bfloat16          row-wise scales (token x channel); the activations
                                          quantized by one kernel (`tandem.kernels.fp8_quant`);
                                          up to FP8_TRITON_MAX_ROWS rows (decode) the Triton
                                          W8A8 kernel instead, which quantizes the activations
                                          itself: one launch
  int4_tinygemm CUDA, bfloat16, no g_idx  torch's tensor-core W4A16 kernel
                                          (`_weight_int4pack_mm`, gpt-fast's tinygemm) up to
                                          TINYGEMM_MAX_ROWS rows; above, dequantized and one
                                          cuBLAS GEMM
  dequant       everywhere else           the reference dequantization, then x @ w.T: CPU
                                          float32 (exact to float32 rounding), CUDA without
                                          Triton
  triton        CUDA                      the dequant-GEMM kernels
                                          (`tandem.kernels.quant_matmul.quantized_linear`) up to
                                          TRITON_MAX_ROWS rows (decode); above, the matrix
                                          dequantized to the activations' dtype and one
                                          cuBLAS GEMM (prefill)

fp8 is W8A8 on every path (`tandem.quant.weight`): the paths that multiply in the activations'
dtype (dequant, triton) give it the per-token e4m3 activations dequantized to that dtype (the
Triton kernel quantizes them itself).

torch's CUDA int4 layout (`_convert_weight_to_int4pack`) takes [out, in // 2] bytes with input
2j in the HIGH nibble (ours holds it in the low one: `tinygemm_nibbles` swaps them) and the
same per-group (scale, zero) floats as the CPU layout below.

Measured on SmolLM2-135M's 120 layer matrices (BENCHMARKS.md, issue 28): at batch 1 the
packed int4 kernel is ~2.6x faster than oneDNN's bfloat16 and int8's ~1.2x; both grow
linearly with the rows (their GEMM is not blocked for many rows), so past a few dozen rows a
dequantization per call plus the bfloat16 GEMM wins.

torch's CPU int4 layout (`_convert_weight_to_int4pack_for_cpu`, AVX512 build), probed:
output rows in blocks of 64, each block stored [in, 32] bytes:

    byte [n // 64, k, j]:  low nibble = q[64 * (n // 64) + j, k]
                           high nibble = q[64 * (n // 64) + 32 + j, k]        (j < 32)

and its per-group floats [in // group, out, 2] = (scale, zero) with
w = (q - 8) * scale + zero, i.e. zero = (8 - zero_point) * scale in our terms.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

import torch

from tandem.quant.weight import QuantizedWeight, WeightScheme, quantize_fp8_activations

# Rows (tokens in a step) up to which the packed CPU kernels beat dequantize-then-GEMM
# (BENCHMARKS.md, issue 28: int4 crosses at ~64-100 rows, int8 at ~8-16).
INT4_PACKED_MAX_ROWS = 64
INT8_PACKED_MAX_ROWS = 8
# Above this many rows the CUDA int8/int4 Triton kernels lose to dequantizing the matrix and
# one cuBLAS GEMM: on an H200 (benchmarks/results/gpu/run2 and run3, Llama-3-8B shapes vs
# bf16 F.linear) the kernels ran 0.7-1.6x bf16's speed at 16 rows (int8; int4 0.2-0.3x),
# 0.35-0.5x at 256 (int4 0.03-0.06x) and 0.4x at 4096 (int4 0.03x: 45 ms for gate_up where
# bf16 takes 1.2 ms). A dequantization reads the matrix once and writes it in 16 bits, about
# as long as one bf16 GEMV, so from a few hundred rows it is the smaller cost; 256 is the
# row count vLLM's AWQ switches at. Not itself measured here (the device time was spent).
TRITON_MAX_ROWS = 256
# Decode batches: up to this many rows fp8 takes the Triton W8A8 kernel (one launch) rather
# than the activation kernel + `_scaled_mm` (two, and cuBLASLt pads M to 16). NOT YET
# MEASURED: the GPU check's quant part times both at 1-64 rows (`fp8_paths`) to set it.
FP8_TRITON_MAX_ROWS = 16
# tinygemm is built for few rows (16-row m tiles); above, one dequantization plus cuBLAS.
# NOT YET MEASURED: the quant part's `int4_paths` times tinygemm, Triton and dequantize +
# cuBLAS at 1-4096 rows to set it.
TINYGEMM_MAX_ROWS = 64
TINYGEMM_GROUP_SIZES = (32, 64, 128, 256)
_INT4_BLOCK_N = 64  # output rows per block of torch's CPU int4 layout
_TINYGEMM_BLOCK_N = 8  # output rows per tile of torch's CUDA int4 layout
_TINYGEMM_K_TILE = 16  # inputs per k tile; 2, 4 or 8 tiles are packed together


class QuantPath(StrEnum):
    INT4_PACKED = "int4_packed"
    INT8_PACKED = "int8_packed"
    FP8_DECODED = "fp8_decoded"
    FP8_SCALED_MM = "fp8_scaled_mm"
    INT4_TINYGEMM = "int4_tinygemm"
    DEQUANT = "dequant"
    TRITON = "triton"


@dataclass(slots=True)
class Workspace:
    """The buffers per-call dequantizations write into (one per dtype), shared by a model's
    matrices (a step runs them one at a time), grown to the largest and reused."""

    bufs: dict[torch.dtype, torch.Tensor] = field(default_factory=dict)

    def take(
        self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
    ) -> torch.Tensor:
        n = 1
        for d in shape:
            n *= d
        buf = self.bufs.get(dtype)
        if buf is None or buf.numel() < n or buf.device != device:
            self.bufs.pop(dtype, None)  # free the old one first
            buf = self.bufs[dtype] = torch.empty(n, dtype=dtype, device=device)
        return buf[:n].view(shape)


@dataclass(frozen=True, slots=True)
class QuantLinear:
    """A quantized matrix in the form its path reads; only `quant_matmul` reads it.

    Attributes:
        scheme: the weight scheme.
        path: how it is applied.
        out_features, in_features: the matrix's shape ([out, in]).
        weight: the shared-format matrix (dequant, triton, int8_packed); None for int4_packed,
            which keeps only torch's layout.
        packed: int4_packed: torch's uint8 layout (module docstring); int4_tinygemm: torch's
            CUDA int32 tiles; int8_packed: the int8 [out, in] values (the same tensor as
            weight.qweight).
        packed_scales: int4_packed, int4_tinygemm: [in // group, out, 2] (scale, zero) in
            the activations' dtype; int8_packed: [out] scales in the activations' dtype;
            fp8_scaled_mm: [1, out] float32 channel scales (_scaled_mm's scale_b).
        group_size: int4: inputs per scale.
        workspace: the buffer per-call dequantizations reuse.
    """

    scheme: WeightScheme
    path: QuantPath
    out_features: int
    in_features: int
    weight: QuantizedWeight | None
    packed: torch.Tensor | None
    packed_scales: torch.Tensor | None
    group_size: int
    workspace: Workspace

    def num_bytes(self) -> int:
        """Bytes held (a tensor shared by `weight` and `packed` counts once)."""
        seen: set[int] = set()
        total = 0
        parts: list[torch.Tensor | None] = [self.packed, self.packed_scales]
        if self.weight is not None:
            w = self.weight
            parts += [w.qweight, w.scales, w.zeros, w.g_idx]
        for t in parts:
            if t is not None and t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                total += t.numel() * t.element_size()
        return total


def choose_path(w: QuantizedWeight, device: torch.device, dtype: torch.dtype) -> QuantPath:
    """The path for `w` applied to `dtype` activations on `device` (see the module doc)."""
    if device.type == "cuda":
        if (
            w.scheme is WeightScheme.FP8
            and dtype == torch.bfloat16
            and torch.cuda.get_device_capability(device) >= (8, 9)
            and w.out_features % 16 == 0
            and w.in_features % 16 == 0
        ):
            return QuantPath.FP8_SCALED_MM
        if tinygemm_fits(w, dtype):
            return QuantPath.INT4_TINYGEMM
        return QuantPath.TRITON if triton_available() else QuantPath.DEQUANT
    if device.type == "cpu" and dtype == torch.bfloat16:
        if (
            w.scheme is WeightScheme.INT4
            and w.g_idx is None
            and w.out_features % _INT4_BLOCK_N == 0
        ):
            return QuantPath.INT4_PACKED
        if w.scheme is WeightScheme.INT8:
            return QuantPath.INT8_PACKED
    if device.type == "cpu" and w.scheme is WeightScheme.FP8:
        return QuantPath.FP8_DECODED
    return QuantPath.DEQUANT


def tinygemm_fits(w: QuantizedWeight, dtype: torch.dtype) -> bool:
    """torch's CUDA int4 kernel takes `w`: bfloat16 activations, groups in order of a size it
    knows, whole 8-output tiles and inputs in pairs of 16-input k tiles."""
    return (
        w.scheme is WeightScheme.INT4
        and dtype == torch.bfloat16
        and w.g_idx is None
        and w.group_size in TINYGEMM_GROUP_SIZES
        and w.out_features % _TINYGEMM_BLOCK_N == 0
        and w.in_features % (2 * _TINYGEMM_K_TILE) == 0
    )


def tinygemm_inner_k_tiles(in_features: int) -> int:
    """k tiles packed side by side (8, 4 or 2: 16-, 8- or 4-byte loads), the most that
    divide the inputs."""
    return next(t for t in (8, 4, 2) if in_features % (t * _TINYGEMM_K_TILE) == 0)


def tinygemm_nibbles(qweight: torch.Tensor) -> torch.Tensor:
    """Our packed int4 bytes (input 2j in the low nibble) as `_convert_weight_to_int4pack`
    reads them (input 2j in the high nibble): [out, in // 2] uint8, contiguous."""
    return ((qweight & 0xF) << 4 | (qweight >> 4)).contiguous()


def int4_scale_zero(w: QuantizedWeight, dtype: torch.dtype) -> torch.Tensor:
    """torch's int4 group floats, CPU and CUDA alike: [in // group, out, 2] (scale, zero) in
    `dtype` with w = (q - 8) * scale + zero, i.e. zero = (8 - zero_point) * scale."""
    zp = torch.full_like(w.scales, 8.0) if w.zeros is None else w.zeros.float()
    zero = (8.0 - zp) * w.scales
    return torch.stack((w.scales.t(), zero.t()), dim=-1).to(dtype).contiguous()


def triton_available() -> bool:
    try:
        import tandem.kernels.quant_matmul  # noqa: F401
    except ImportError:
        return False
    return True


def pack_quantized(
    w: QuantizedWeight,
    dtype: torch.dtype,
    workspace: Workspace,
    path: QuantPath | None = None,
) -> QuantLinear:
    """`w` in the form `path` reads (default: `choose_path` for its device and `dtype`).

    Raises:
        ValueError: a path that cannot apply `w` (int4_packed with g_idx or an output count
            not a multiple of 64; a packed path for another scheme).
    """
    device = w.qweight.device
    path = choose_path(w, device, dtype) if path is None else path
    shape = (w.out_features, w.in_features)
    if path is QuantPath.INT4_PACKED:
        if w.scheme is not WeightScheme.INT4 or w.g_idx is not None or shape[0] % _INT4_BLOCK_N:
            raise ValueError(
                f"int4_packed needs int4 without g_idx and out_features a multiple of "
                f"{_INT4_BLOCK_N}, got {w.scheme} {shape} g_idx={w.g_idx is not None}"
            )
        from tandem.quant.weight import unpack_int4

        q = unpack_int4(w.qweight).to(torch.int32)  # [out, in]
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
        del q
        sz = int4_scale_zero(w, dtype)
        return QuantLinear(w.scheme, path, *shape, None, packed, sz, w.group_size, workspace)
    if path is QuantPath.INT4_TINYGEMM:
        if not tinygemm_fits(w, dtype):
            raise ValueError(
                f"int4_tinygemm needs int4 without g_idx, bfloat16 activations, a group of "
                f"{TINYGEMM_GROUP_SIZES}, out_features a multiple of {_TINYGEMM_BLOCK_N} and "
                f"in_features of {2 * _TINYGEMM_K_TILE}, got {w.scheme} {shape} group "
                f"{w.group_size} {dtype} g_idx={w.g_idx is not None}"
            )
        packed = torch.ops.aten._convert_weight_to_int4pack(
            tinygemm_nibbles(w.qweight), tinygemm_inner_k_tiles(w.in_features)
        )
        # `weight` stays for the rows above TINYGEMM_MAX_ROWS (dequantize + cuBLAS)
        sz = int4_scale_zero(w, dtype)
        return QuantLinear(w.scheme, path, *shape, w, packed, sz, w.group_size, workspace)
    if path is QuantPath.INT8_PACKED:
        if w.scheme is not WeightScheme.INT8:
            raise ValueError(f"int8_packed needs int8 weights, got {w.scheme}")
        return QuantLinear(
            w.scheme, path, *shape, w, w.qweight, w.scales.to(dtype), w.group_size, workspace
        )
    if path is QuantPath.FP8_SCALED_MM:
        # _scaled_mm's row-wise scale_b: [1, out] float32, built once here, not per call
        scale_b = w.scales.float().expand(w.out_features).reshape(1, -1).contiguous()
        return QuantLinear(w.scheme, path, *shape, w, None, scale_b, w.group_size, workspace)
    return QuantLinear(w.scheme, path, *shape, w, None, None, w.group_size, workspace)


def quant_matmul(
    x: torch.Tensor,
    ql: QuantLinear,
    bias: torch.Tensor | None = None,
    act_absmax: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [n, in] times the matrix transposed, plus `bias` ([out]) if given: [n, out].
    `act_absmax` (fp8, [n, 1]): the rows' largest |value| over all their columns, when x is
    a tensor-parallel rank's columns of them (`quantize_fp8_activations`)."""
    if ql.path is QuantPath.INT4_PACKED:
        assert ql.packed is not None and ql.packed_scales is not None
        if x.shape[0] <= INT4_PACKED_MAX_ROWS:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(
                x.contiguous(), ql.packed, ql.group_size, ql.packed_scales
            )
        else:
            y = x @ _dequant_int4_packed(ql, x.dtype)
    elif ql.path is QuantPath.INT8_PACKED:
        assert ql.packed is not None and ql.packed_scales is not None
        if x.shape[0] <= INT8_PACKED_MAX_ROWS:
            y = torch.ops.aten._weight_int8pack_mm(x.contiguous(), ql.packed, ql.packed_scales)
        else:
            wq = ql.workspace.take((ql.out_features, ql.in_features), x.dtype, x.device)
            wq.copy_(ql.packed)  # int8 -> bf16 is exact
            y = (x @ wq.t()).mul_(ql.packed_scales)
    elif ql.path is QuantPath.FP8_DECODED:
        assert ql.weight is not None
        xq, sx = quantize_fp8_activations(x, act_absmax)
        w = ql.workspace.take((ql.out_features, ql.in_features), x.dtype, x.device)
        w.copy_(ql.weight.qweight)  # e4m3 -> bf16/fp32 is exact
        y = (xq.to(x.dtype) @ w.t()).float().mul_(sx).mul_(ql.weight.scales).to(x.dtype)
    elif ql.path is QuantPath.INT4_TINYGEMM and x.shape[0] <= TINYGEMM_MAX_ROWS:
        assert ql.packed is not None and ql.packed_scales is not None
        y = torch.ops.aten._weight_int4pack_mm(
            x.contiguous(), ql.packed, ql.group_size, ql.packed_scales
        )
    elif act_absmax is None and _fp8_in_kernel(ql, x.shape[0]):
        from tandem.kernels.quant_matmul import quantized_linear

        y = quantized_linear(x.contiguous(), ql.weight, quantize_x=True)
    elif ql.path is QuantPath.FP8_SCALED_MM:
        y = fp8_scaled_mm(x, ql, act_absmax)
    elif ql.path is QuantPath.TRITON and x.shape[0] <= TRITON_MAX_ROWS:
        from tandem.kernels.quant_matmul import quantized_linear

        y = quantized_linear(fp8_activations(x, ql.scheme, act_absmax).contiguous(), ql.weight)
    else:
        assert ql.weight is not None
        y = fp8_activations(x, ql.scheme, act_absmax) @ ql.weight.dequantize(x.dtype).t()
    return y if bias is None else y.add_(bias)


def fp8_scaled_mm(
    x: torch.Tensor, ql: QuantLinear, act_absmax: torch.Tensor | None = None
) -> torch.Tensor:
    """fp8_scaled_mm's product through `torch._scaled_mm` whatever the rows (quant_matmul
    sends decode batches to the Triton kernel instead; the GPU check times both)."""
    assert ql.weight is not None and ql.packed_scales is not None
    from tandem.kernels.fp8_quant import quantize_fp8_rows

    # One kernel for what quantize_fp8_activations does in eight (the same values).
    if act_absmax is None:
        xq, sx = quantize_fp8_rows(x if x.stride(-1) == 1 else x.contiguous())
    else:
        xq, sx = quantize_fp8_activations(x, act_absmax)
    return torch._scaled_mm(
        xq, ql.weight.qweight.t(), scale_a=sx, scale_b=ql.packed_scales, out_dtype=x.dtype
    )


def _fp8_in_kernel(ql: QuantLinear, num_rows: int) -> bool:
    """fp8 rows the Triton W8A8 kernel takes, activations quantized inside it: decode
    batches on fp8_scaled_mm's path, everything the Triton path keeps."""
    if ql.scheme is not WeightScheme.FP8:
        return False
    if ql.path is QuantPath.FP8_SCALED_MM:
        return num_rows <= FP8_TRITON_MAX_ROWS
    return ql.path is QuantPath.TRITON and num_rows <= TRITON_MAX_ROWS


def fp8_activations(
    x: torch.Tensor, scheme: WeightScheme, absmax: torch.Tensor | None = None
) -> torch.Tensor:
    """fp8: x quantized per token to e4m3 and back in x's dtype (the W8A8 product's
    activations, for the paths that multiply in that dtype); other schemes: x."""
    if scheme is not WeightScheme.FP8:
        return x
    xq, sx = quantize_fp8_activations(x, absmax)
    return (xq.float() * sx).to(x.dtype)


def _dequant_int4_packed(ql: QuantLinear, dtype: torch.dtype) -> torch.Tensor:
    """The matrix transposed, [in, out] in `dtype`, decoded from torch's CPU int4 layout into
    the workspace (module docstring): w.T[k, n] = (q[n, k] - 8) * scale + zero, computed in
    float32 (torch's bfloat16 element-wise ops are ~10x slower here) and rounded once."""
    assert ql.packed is not None and ql.packed_scales is not None
    n_out, k_in, g = ql.out_features, ql.in_features, ql.group_size
    device = ql.packed.device
    blocks = ql.packed.view(n_out // _INT4_BLOCK_N, k_in, 32)  # [out // 64, in, 32]
    wt = ql.workspace.take((k_in, n_out // _INT4_BLOCK_N, 2, 32), torch.float32, device)
    wt[:, :, 0].copy_((blocks & 0xF).permute(1, 0, 2))
    wt[:, :, 1].copy_((blocks >> 4).permute(1, 0, 2))
    grouped = wt.view(k_in // g, g, n_out)
    sz = ql.packed_scales.float()
    scale, zero = sz[..., 0].unsqueeze(1), sz[..., 1].unsqueeze(1)  # [in // group, 1, out]
    torch.addcmul(zero, grouped.sub_(8), scale, out=grouped)
    if dtype == torch.float32:
        return wt.view(k_in, n_out)
    out = ql.workspace.take((k_in, n_out), dtype, device)
    return out.copy_(wt.view(k_in, n_out))
