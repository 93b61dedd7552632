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

oneDNN compiles a kernel for each product shape it meets and keeps it in its primitive cache
(1,024 entries by default), so a oneDNN product of n rows is computed at `onednn_rows(n)`
rows (zero rows appended, their results dropped): exact up to 64 rows (decode batches), then
rounded up to an eighth of n's power of two (at most 12.5% more rows). Unrounded, every
distinct prefill length was a new shape: a long prefill worker churned the cache, compiling
and evicting kernels, and the heap it churned in grew without bound (1.0 -> 1.9 GB in 1,400
products; rounded, 0.39 -> 0.48 GB and flat, as fast; BENCHMARKS.md "The prefill worker's
memory", `benchmarks/bench_memory.py`). The engine's warm-up compiles every count's kernel
for every packed shape (`LlamaModel.compile_matmuls`), so the set is full before traffic.

A packed matrix is an opaque tensor: only `matmul` may read it. A quantized matrix
(`tandem.quant.linear.QuantLinear`, packed at load by its own rule) goes to
`quant_matmul` whatever the kind.
"""

from __future__ import annotations

from enum import StrEnum

import torch

from tandem.quant.linear import QuantLinear, fp8_activations, quant_matmul
from tandem.quant.weight import QuantizedWeight


class MatmulKind(StrEnum):
    PLAIN = "plain"
    ONEDNN = "onednn"


# Products of up to this many rows keep their row count (decode batches: every batch size
# its own kernel, and a row's result as it was).
ONEDNN_EXACT_ROWS = 64
# Above it, row counts are rounded up to a multiple of 2 ** (bit_length - this): eight
# counts per doubling, so at most 1/8 of the rows are padding.
_ONEDNN_STEPS_LOG2 = 4


def onednn_rows(num_rows: int) -> int:
    """The row count a oneDNN product of `num_rows` rows is computed at (>= num_rows; one of
    `onednn_row_counts`' values)."""
    if num_rows <= ONEDNN_EXACT_ROWS:
        return num_rows
    step = 1 << (num_rows.bit_length() - _ONEDNN_STEPS_LOG2)
    return -(-num_rows // step) * step


def onednn_row_counts(max_rows: int) -> list[int]:
    """Every row count a oneDNN product of 1..max_rows rows is computed at, ascending: the
    bound on the shapes per matrix that oneDNN compiles a kernel for."""
    counts = list(range(1, min(max_rows, ONEDNN_EXACT_ROWS) + 1))
    n = ONEDNN_EXACT_ROWS + 1
    while n <= max_rows:
        counts.append(onednn_rows(n))
        n = counts[-1] + 1
    return counts


def onednn_bf16_available() -> bool:
    """oneDNN is built in and this CPU runs bfloat16 natively (AVX512-BF16 or AMX)."""
    mkldnn = torch.backends.mkldnn
    return bool(mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())


CPU_MATMULS = ("auto", "plain", "onednn")


def choose_matmul(
    device: torch.device, dtype: torch.dtype, onednn_bf16: bool, cpu_matmul: str = "auto"
) -> MatmulKind:
    """The matmul for a model on `device` in `dtype`; `onednn_bf16`: `onednn_bf16_available()`;
    `cpu_matmul` (EngineConfig.cpu_matmul): "auto" (oneDNN for bfloat16 on a CPU that runs
    it natively, else plain), "plain" or "onednn" (a CPU in float32, or bfloat16 natively).

    Raises:
        ValueError: "onednn" where oneDNN cannot run this dtype.
    """
    if cpu_matmul not in CPU_MATMULS:
        raise ValueError(f"cpu_matmul must be one of {', '.join(CPU_MATMULS)}, got {cpu_matmul!r}")
    if device.type != "cpu" or cpu_matmul == "plain":
        return MatmulKind.PLAIN
    if cpu_matmul == "onednn":
        if dtype == torch.float32 or (dtype == torch.bfloat16 and onednn_bf16):
            return MatmulKind.ONEDNN
        raise ValueError(
            f"cpu_matmul onednn runs float32, or bfloat16 on a CPU with AVX512-BF16 or AMX; "
            f"not {dtype} here: use cpu_matmul auto or plain"
        )
    if dtype == torch.bfloat16 and onednn_bf16:
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
    QuantizedWeight not packed (`tandem.quant.linear.pack_quantized`) is dequantized per call."""
    if isinstance(w, QuantLinear):
        return quant_matmul(x, w, bias)
    if isinstance(w, QuantizedWeight):
        y = fp8_activations(x, w.scheme) @ w.dequantize(x.dtype).t()
        return y if bias is None else y + bias
    if kind is MatmulKind.ONEDNN:
        n = x.shape[0]
        rows = onednn_rows(n)
        if rows != n:
            x = torch.nn.functional.pad(x, (0, 0, 0, rows - n))  # x [rows, in], zero rows
        return torch.ops.mkldnn._linear_pointwise(x, w, bias, "none", [], "")[:n]
    return x @ w if bias is None else torch.addmm(bias, x, w)


def lm_head_matmul(
    x: torch.Tensor, w: torch.Tensor | QuantLinear | QuantizedWeight, kind: MatmulKind
) -> torch.Tensor:
    """`matmul` for the lm_head. A tied lm_head is the embedding transposed, [vocab, hid]
    row-major underneath: for 2+ rows on a CPU, MKL streams it once as (W @ x^T)^T, about
    2.2x faster than x @ W^T over the view (SmolLM2's 49k x 576 in float32, 5 rows: 12.5-13.6
    against 26.6-30.4 ms; BENCHMARKS.md issue 45): what a speculative verify row and a decode
    batch take. One row keeps x @ W^T."""
    if (
        kind is MatmulKind.PLAIN
        and isinstance(w, torch.Tensor)
        and x.shape[0] > 1
        and x.device.type == "cpu"
        and w.t().is_contiguous()
    ):
        return torch.mm(w.t(), x.t()).t()
    return matmul(x, w, kind)
