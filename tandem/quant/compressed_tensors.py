"""compressed-tensors checkpoints (llm-compressor's quant_method "compressed-tensors", format
float-quantized, int-quantized or naive-quantized) with one symmetric 8-bit weights scheme in
every config group; `tandem.quant.checkpoint` dispatches here.

A quantized layer [out, in] is stored as

  weight        e4m3 [out, in] (float-quantized) or int8 (int-quantized, 8 bits)
  weight_scale  [out, 1] (strategy channel) or [1] (tensor; float weights only)

and converted to w = weight * scale. Float weights have fp8's layout and are read by
`tandem.quant.fp8`; int8 weights are read here into INT8 `QuantizedWeight`s (one scale per
output row). A tensor-parallel rank's part reads as fp8's does: the weight's rows or columns,
the scale whole.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import torch

from tandem.quant.fp8 import row_scaled
from tandem.quant.weight import QuantizedWeight, WeightScheme


def parse_compressed(qc: dict[str, Any]) -> bool:
    """Check a compressed-tensors `quantization_config`.

    Returns:
        whether its weights are int8 (int-quantized), not e4m3.

    Raises:
        ValueError: an unknown format, config groups with differing weights schemes, or a
            scheme other than symmetric 8-bit float (channel or tensor) or int (channel).
    """
    fmt = qc.get("format")
    if fmt not in ("float-quantized", "int-quantized", "naive-quantized"):
        raise ValueError(
            f"quantization_config.format {fmt!r} is not supported for compressed-tensors "
            "(float-quantized, int-quantized or naive-quantized)"
        )
    groups = qc.get("config_groups") or {}
    schemes = {json.dumps(g.get("weights"), sort_keys=True) for g in groups.values()}
    if len(schemes) != 1:
        raise ValueError(
            f"quantization_config.config_groups must give every group one weights scheme, "
            f"got {len(schemes)}"
        )
    weights = next(iter(groups.values())).get("weights") or {}
    kind, bits, strategy = weights.get("type"), weights.get("num_bits"), weights.get("strategy")
    if (kind, bits) not in (("float", 8), ("int", 8)):
        raise ValueError(
            f"quantization_config.config_groups weights type {kind!r} num_bits {bits!r} is not "
            "supported (float or int, 8 bits)"
        )
    if strategy not in ("channel", "tensor") or (kind == "int" and strategy != "channel"):
        raise ValueError(
            f"quantization_config.config_groups weights strategy {strategy!r} is not supported "
            f"for {kind} weights (channel{' or tensor' if kind == 'float' else ''})"
        )
    if not weights.get("symmetric", True):
        raise ValueError(
            "quantization_config.config_groups weights symmetric false is not supported"
        )
    return kind == "int"


def convert_int8(
    prefix: str,
    read: Callable[[str], torch.Tensor],
    out: int,
    scale_name: str,
    rows: tuple[int, int] | None = None,
) -> QuantizedWeight:
    """int-quantized layer `prefix` ([out, in]) with scale tensor `prefix.scale_name` -> INT8;
    `rows` as `tandem.quant.fp8.convert_fp8`'s.

    Raises:
        ValueError: a weight that is not int8, or not one scale per output row.
    """
    weight = read(f"{prefix}.weight")
    scale = read(f"{prefix}.{scale_name}").float()
    if weight.dtype != torch.int8 or scale.numel() != out:
        raise ValueError(
            f"{prefix}: int-quantized weights must be int8 with {out} scales, got "
            f"{weight.dtype} and scale shape {tuple(scale.shape)}"
        )
    return row_scaled(WeightScheme.INT8, weight, scale.reshape(out), rows)
