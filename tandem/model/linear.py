"""How the model multiplies activations by its weight matrices, chosen once per device and
dtype (`choose_matmul`), logged at load.

  plain    `x @ w` with w stored [in_features, out_features] (torch's batch-1 CPU path reads
           that layout ~1.4x faster than `F.linear`'s [out, in]); every CUDA dtype, and CPU
           float32.
  onednn   CPU bfloat16: each matrix reordered once, at load, into oneDNN's blocked layout
           (`torch.ops.mkldnn._reorder_linear_weight`) and applied with oneDNN's linear
           (AVX512-BF16 or AMX where the CPU has them). Measured on this project's 2-core
           AVX512-BF16 box over SmolLM2-135M's 120 layer matrices (BENCHMARKS.md, issue 24):
           1.4x (1 thread) to 2.2x (2 threads) faster than float32 `x @ w` at batch 1, 3-4.5x
           at batch 4-16, 2.4x for a 256-1024-token prefill; unpacked bfloat16 `x @ w` is
           slower than float32 at batch 1.

A packed matrix is an opaque tensor: only `matmul` may read it. A quantized matrix
(`tandem.model.quant_linear.QuantLinear`, packed at load by its own rule) goes to
`quant_matmul` whatever the kind.
"""

from __future__ import annotations

from enum import StrEnum

import torch

from tandem.model.quant import QuantizedWeight
from tandem.model.quant_linear import QuantLinear, fp8_activations, quant_matmul


class MatmulKind(StrEnum):
    PLAIN = "plain"
    ONEDNN = "onednn"


def onednn_bf16_available() -> bool:
    """oneDNN is built in and this CPU runs bfloat16 natively (AVX512-BF16 or AMX)."""
    mkldnn = torch.backends.mkldnn
    return bool(mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def choose_matmul(device: torch.device, dtype: torch.dtype, onednn_bf16: bool) -> MatmulKind:
    """The matmul for a model on `device` in `dtype`; `onednn_bf16`: `onednn_bf16_available()`."""
    if device.type == "cpu" and dtype == torch.bfloat16 and onednn_bf16:
        return MatmulKind.ONEDNN
    return MatmulKind.PLAIN


def pack(w: torch.Tensor, kind: MatmulKind) -> torch.Tensor:
    """A weight matrix [in, out] in the form `matmul(x, ., kind)` takes."""
    if kind is MatmulKind.PLAIN:
        return w
    # oneDNN's linear takes [out, in]. The batch hint picks the layout, and with it the
    # kernels each row count gets. Packed for 1 row, a row's result is bitwise the same
    # whatever the rows around it for matrices of up to 576 inputs (measured: all of
    # SmolLM2's and the tiny presets' but their down projections); with 1536 inputs or more
    # (down, Llama-3-8B's shapes) 5-128-row products round differently. So bfloat16 is held
    # to a tolerance, float32 to token identity. Packed for 256 rows, 256-1024-row products
    # run 1.25x faster, but most shapes then round 1-36-row batches differently, lm_head
    # included, and 1-16-row products ran up to 8% slower: not taken (BENCHMARKS.md, issue
    # 24, `bench_cpu_engine.py --parts prefill`).
    return torch.ops.mkldnn._reorder_linear_weight(w.t().contiguous(), 1)


def matmul(
    x: torch.Tensor,
    w: torch.Tensor | QuantLinear | QuantizedWeight,
    kind: MatmulKind,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [n, in] times a `pack`ed matrix, plus `bias` ([out]) if given: [n, out]. A
    QuantizedWeight not packed (`quant_linear.pack_quantized`) is dequantized per call."""
    if isinstance(w, QuantLinear):
        return quant_matmul(x, w, bias)
    if isinstance(w, QuantizedWeight):
        y = fp8_activations(x, w.scheme) @ w.dequantize(x.dtype).t()
        return y if bias is None else y + bias
    if kind is MatmulKind.ONEDNN:
        return torch.ops.mkldnn._linear_pointwise(x, w, bias, "none", [], "")
    return x @ w if bias is None else torch.addmm(bias, x, w)
