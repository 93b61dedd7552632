"""FP8 checkpoints (quant_method "fp8": e4m3 weights with per-tensor, per-channel or
DeepSeek's block-wise scales) read into FP8 `tandem.quant.weight.QuantizedWeight`s;
`tandem.quant.checkpoint` dispatches here, and compressed-tensors' float-quantized weights
(`tandem.quant.compressed_tensors`) are read here too.

A quantized layer [out, in] is stored as

  weight            e4m3 [out, in]
  weight_scale_inv  [out/Bo, in/Bi] (block-wise, weight_block_size [Bo, Bi]), or
  weight_scale      [] / [1] / [out] / [out, 1]

and converted to w = weight * scale (block-wise despite the `_inv`). The FP8 format holds one
scale per tensor or per output row: block-wise scales load when there is one block along the
inputs (each row takes its block's scale), and are refused otherwise. A tensor-parallel rank's
part (`tandem.quant.checkpoint.stored_slices`) reads

  outputs [a, b)  weight: rows [a, b); scale: whole (at most one per row, cut here)
  inputs [a, b)   weight: columns [a, b); scale: whole (per row: any columns keep it)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from tandem.quant.weight import QuantizedWeight, WeightScheme


def parse_fp8(qc: dict[str, Any]) -> tuple[int, int] | None:
    """An fp8 `quantization_config`'s block-wise scale size [rows, cols]
    (weight_block_size), or None: per-tensor or per-channel scales."""
    block = qc.get("weight_block_size")
    if block is None:
        return None
    rows, cols = (int(v) for v in block)
    return rows, cols


def convert_fp8(
    prefix: str,
    read: Callable[[str], torch.Tensor],
    out: int,
    inp: int,
    scale_name: str,
    block_size: tuple[int, int] | None,
    rows: tuple[int, int] | None = None,
) -> QuantizedWeight:
    """fp8 layer `prefix` ([out, in]) with scale tensor `prefix.scale_name` -> FP8; `rows`
    (a, b): the reader hands out the weight's rows [a, b) (or, without `rows`, whatever part
    it was given: a tensor-parallel rank's columns) and the scale whole, cut to those rows.

    Raises:
        ValueError: a weight that is not e4m3, a scale of the wrong shape, or block-wise
            scales with more than one block along the inputs.
    """
    weight = read(f"{prefix}.weight")
    name = f"{prefix}.{scale_name}"
    scale = read(name).float()
    if weight.dtype != torch.float8_e4m3fn:
        raise ValueError(f"{prefix}.weight must be float8_e4m3fn, got {weight.dtype}")
    if block_size is not None and scale.numel() > 1 and scale.numel() != out:
        block_rows, block_cols = block_size
        grid = (-(-out // block_rows), -(-inp // block_cols))
        if tuple(scale.shape) != grid:
            raise ValueError(
                f"{name} must be {grid} for weight_block_size, got {tuple(scale.shape)}"
            )
        if grid[1] != 1:
            raise ValueError(
                f"{name}: block-wise fp8 scales (quantization_config.weight_block_size "
                f"{list(block_size)}, {grid[1]} blocks along in_features {inp}) are not "
                "supported: the fp8 format holds per-channel or per-tensor scales only"
            )
        scale = scale[:, 0].repeat_interleave(block_rows)[:out]  # one block column: per channel
    if scale.numel() == 1:
        return row_scaled(WeightScheme.FP8, weight, scale.reshape(1), rows)
    if scale.numel() != out:
        raise ValueError(f"{name} must hold 1 or {out} scales, got shape {tuple(scale.shape)}")
    return row_scaled(WeightScheme.FP8, weight, scale.reshape(out), rows)


def row_scaled(
    scheme: WeightScheme,
    weight: torch.Tensor,
    scale: torch.Tensor,
    rows: tuple[int, int] | None,
) -> QuantizedWeight:
    """`weight` as read (the layer or a rank's part of it) with one `scale` per output row or
    one in all; `rows` (a, b): the weight holds rows [a, b) of the layer and per-row scales
    are cut to them."""
    if rows is not None and scale.numel() != 1:
        scale = scale[rows[0] : rows[1]]
    return QuantizedWeight(scheme, weight, scale.contiguous(), None, int(weight.shape[1]))
