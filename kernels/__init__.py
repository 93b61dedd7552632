"""Attention and dequant-GEMM kernels: Triton kernels for CUDA and the pure-torch references
they are tested against.

- `reference`: pure-torch ground truth (imports no Triton).
- `kv_write.write_kv`: store a step's new K/V into their slots of the paged cache.
- `prefill_attention.paged_prefill_attention`: causal varlen prefill over block tables.
- `decode_attention.paged_decode_attention`: one query token per request, split-K (flash
  decoding) over block tables, GQA groups sharing each K/V load.
- `fused_moe.fused_moe` (import it from its module, which has its name): mixture-of-experts
  SwiGLU experts as grouped GEMMs over expert-sorted tokens, routing weights applied in the
  epilogue.

The Triton kernels are exported lazily: importing `kernels` (for `kernels.reference`) does
not import Triton, so the CPU path never loads it.
"""

from __future__ import annotations

import importlib
from typing import Any

# Exported name -> module that defines it, imported on first access.
_LAZY_EXPORTS = {
    "write_kv": "kernels.kv_write",
    "paged_prefill_attention": "kernels.prefill_attention",
    "paged_decode_attention": "kernels.decode_attention",
    "int4_matmul": "kernels.quant_matmul",
    "scaled_matmul": "kernels.quant_matmul",
    "quantized_linear": "kernels.quant_matmul",
}

__all__ = ["reference", *_LAZY_EXPORTS]


def __getattr__(name: str) -> Any:
    if name in _LAZY_EXPORTS:
        return getattr(importlib.import_module(_LAZY_EXPORTS[name]), name)
    raise AttributeError(f"module 'kernels' has no attribute {name!r}")
