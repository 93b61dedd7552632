"""Quantized HF checkpoints (AWQ, GPTQ, FP8, compressed-tensors) converted into the one
in-memory format, `tandem.quant.weight.QuantizedWeight`: what the formats share, and the
dispatch to each format's own module.

Which format a checkpoint is in is read from config.json's `quantization_config`
(`read_checkpoint_quant`). A linear layer `prefix` (e.g. `model.layers.0.mlp.down_proj`) is
quantized when its quantized tensors are in the files; otherwise it is stored dense as
`prefix.weight` (the lm_head, an `ignore`/`modules_to_not_convert` list). Each format's module
checks its config, and its docstring gives its on-disk layout and what a tensor-parallel rank
reads:

  format              module                           tensors of a quantized layer
  awq (GEMM)          tandem.quant.awq                 qweight, qzeros, scales
  gptq (v1, v2)       tandem.quant.gptq                qweight, qzeros, scales, g_idx
  fp8                 tandem.quant.fp8                 weight (e4m3), weight_scale(_inv)
  compressed-tensors  tandem.quant.compressed_tensors  weight (e4m3 or int8), weight_scale

AWQ and GPTQ share their int4 unpacking and conversion (`tandem.quant.int4`).

Converted: w[o, i] = (q - zero) * scale, exactly as the checkpoint's own kernels compute it.
A group size larger than the format's (per channel: G = in) repeats each scale and zero, which
is exact. What cannot be expressed exactly is refused with a ValueError naming the field.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

import torch

from tandem.parallel.sharding import TensorSlice
from tandem.quant.awq import awq_slices, awq_tensors, convert_awq, convert_awq_slice, parse_awq
from tandem.quant.compressed_tensors import convert_int8, parse_compressed
from tandem.quant.fp8 import convert_fp8, parse_fp8
from tandem.quant.gptq import (
    convert_gptq,
    convert_gptq_slice,
    gptq_slices,
    gptq_tensors,
    parse_gptq,
)
from tandem.quant.weight import QuantizedWeight

# Layers a checkpoint may quantize (suffixes of their HF names).
LINEAR_SUFFIXES = (
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)


class CheckpointFormat(StrEnum):
    AWQ = "awq"
    GPTQ = "gptq"
    FP8 = "fp8"
    COMPRESSED_TENSORS = "compressed-tensors"


@dataclass(frozen=True, slots=True)
class CheckpointQuant:
    """A checked `quantization_config`.

    Attributes:
        format: the checkpoint's quant_method.
        bits: 4 or 8 (awq, gptq); 8 (fp8, compressed-tensors).
        group_size: inputs per scale; None: one scale per output channel (or per tensor).
        zero_offset: added to stored zero points (GPTQ v1: 1).
        block_size: fp8 block-wise scales [rows, cols] (weight_block_size), or None.
        int_weights: compressed-tensors int-quantized (int8 weights), not float.
    """

    format: CheckpointFormat
    bits: int
    group_size: int | None
    zero_offset: int = 0
    block_size: tuple[int, int] | None = None
    int_weights: bool = False


def read_checkpoint_quant(model_dir: Path) -> CheckpointQuant | None:
    """The quantization of the checkpoint in `model_dir`, or None when it has none."""
    raw = json.loads((Path(model_dir) / "config.json").read_text())
    qc = raw.get("quantization_config") if isinstance(raw, dict) else None
    return None if qc is None else parse_quant_config(qc)


def parse_quant_config(qc: dict[str, Any]) -> CheckpointQuant:
    """Check a `quantization_config` dict.

    Raises:
        ValueError: an unknown quant_method or a layout this loader cannot convert exactly,
            naming the field.
    """
    method = str(qc.get("quant_method", "")).lower()
    if method == "awq":
        return CheckpointQuant(CheckpointFormat.AWQ, 4, parse_awq(qc))
    if method == "gptq":
        bits, group, zero_offset = parse_gptq(qc)
        return CheckpointQuant(CheckpointFormat.GPTQ, bits, group, zero_offset=zero_offset)
    if method == "fp8":
        return CheckpointQuant(CheckpointFormat.FP8, 8, None, block_size=parse_fp8(qc))
    if method == "compressed-tensors":
        int_weights = parse_compressed(qc)
        return CheckpointQuant(
            CheckpointFormat.COMPRESSED_TENSORS, 8, None, int_weights=int_weights
        )
    raise ValueError(
        f"quantization_config.quant_method {qc.get('quant_method')!r} is not supported; "
        f"supported: {', '.join(f.value for f in CheckpointFormat)}"
    )


def stored_tensors(
    quant: CheckpointQuant, prefix: str, out: int, inp: int
) -> dict[str, tuple[int, ...] | None]:
    """The tensors of quantized layer `prefix` ([out, in]) and their shapes (None: the
    shape is checked when converted, as fp8 scales come in several)."""
    if quant.format is CheckpointFormat.AWQ:
        return awq_tensors(prefix, out, inp, quant.group_size)
    if quant.format is CheckpointFormat.GPTQ:
        return gptq_tensors(prefix, out, inp, quant.bits, quant.group_size)
    return {f"{prefix}.weight": (out, inp), f"{prefix}.{scale_name(quant)}": None}


def scale_name(quant: CheckpointQuant) -> str:
    """The fp8 scale's tensor name (DeepSeek's block-wise layout calls it `_inv`, yet
    multiplies by it)."""
    if quant.format is CheckpointFormat.FP8 and quant.block_size is not None:
        return "weight_scale_inv"
    return "weight_scale"


def is_quantized(quant: CheckpointQuant, prefix: str, names: set[str] | dict[str, Any]) -> bool:
    """Whether layer `prefix` is stored quantized (else dense, as `prefix.weight`)."""
    marker = "qweight" if quant.format in (CheckpointFormat.AWQ, CheckpointFormat.GPTQ) else None
    if marker is not None:
        return f"{prefix}.{marker}" in names
    # fp8: the older per-tensor checkpoints call the scale weight_scale even without blocks.
    return any(f"{prefix}.{n}" in names for n in ("weight_scale", "weight_scale_inv"))


def convert(
    quant: CheckpointQuant, prefix: str, read: Callable[[str], torch.Tensor], out: int, inp: int
) -> QuantizedWeight:
    """Read layer `prefix`'s tensors with `read(name)` and convert them (the module doc).

    Raises:
        ValueError: a layout the format cannot hold exactly, naming the tensor or field.
    """

    def copy(name: str) -> torch.Tensor:  # a reader may hand out views of one shared buffer
        return read(name).clone()

    if quant.format is CheckpointFormat.AWQ:
        return convert_awq(prefix, copy, inp, quant.group_size)
    if quant.format is CheckpointFormat.GPTQ:
        return convert_gptq(prefix, copy, inp, quant.bits, quant.group_size, quant.zero_offset)
    return _convert_scaled(quant, prefix, copy, out, inp)


def _convert_scaled(
    quant: CheckpointQuant,
    prefix: str,
    read: Callable[[str], torch.Tensor],
    out: int,
    inp: int,
    rows: tuple[int, int] | None = None,
) -> QuantizedWeight:
    """An fp8 or compressed-tensors layer: a weight and its scale (`rows`: convert_fp8's)."""
    if quant.int_weights:
        return convert_int8(prefix, read, out, scale_name(quant), rows)
    return convert_fp8(prefix, read, out, inp, scale_name(quant), quant.block_size, rows)


def stored_shapes(
    quant: CheckpointQuant,
    shapes: dict[str, tuple[int, ...]],
    entries: dict[str, Any],
) -> tuple[dict[str, tuple[int, ...]], dict[str, tuple[int, int]]]:
    """What to read for a model whose dense tensors are `shapes` (loader.expected_shapes).

    Returns:
        (stored name -> shape, in read order; dense weight name -> [out, in] of each layer
        stored quantized). fp8 scales take the shape in the file (checked when converted).

    Raises:
        ValueError: a dense weight stored as fp8 with no scale.
    """
    stored: dict[str, tuple[int, ...]] = {}
    layers: dict[str, tuple[int, int]] = {}
    for name, shape in shapes.items():
        prefix = name.removesuffix(".weight")
        linear = name.endswith(".weight") and (
            prefix == "lm_head" or prefix.endswith(LINEAR_SUFFIXES)
        )
        if not (linear and is_quantized(quant, prefix, entries)):
            entry = entries.get(name)
            if entry is not None and entry.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
                raise ValueError(f"tensor {name!r} is {entry.dtype} but has no weight_scale")
            stored[name] = shape
            continue
        out, inp = shape
        layers[name] = (out, inp)
        for part, part_shape in stored_tensors(quant, prefix, out, inp).items():
            found = entries.get(part)
            stored[part] = part_shape or (found.shape if found is not None else ())
    return stored, layers


# -- tensor parallelism: a rank's slice of a quantized layer ----------------------------------
#
# A rank's part of a layer (tandem.parallel.sharding.tensor_slices: outputs [a, b), dim 0 of
# [out, in], or inputs [a, b), dim 1) is read as parts of the stored tensors
# (`stored_slices`: each format module's docstring lists which), converted (`convert_slice`)
# and holds exactly the values of those rows or columns of the whole layer's conversion.
#
# Outputs always split exactly. Inputs split int4's groups: a rank's columns hold int4 groups
# of 32/64/128 that start at its first column and lie inside the checkpoint's groups; when
# none fits (a shard boundary inside a group, as with 48 columns in groups of 32) the layer is
# refused (ValueError naming the alternatives) unless it is read dense. GPTQ act-order ranks
# whose columns use more groups than their width holds come back dense (float32), as act-order
# projections that cannot share one fused matrix do at one rank. int8 and fp8 scales are per
# output row: any columns keep them.


def stored_slices(
    quant: CheckpointQuant,
    layers: Mapping[str, tuple[int, int]],
    slices: Mapping[str, TensorSlice],
) -> dict[str, TensorSlice]:
    """The parts of the stored tensors a tensor-parallel rank reads for its `slices` (dense
    weight name -> its part, in [out, in] terms) of the quantized `layers` (dense weight name
    -> [out, in]): the section above. Stored tensors not named are read whole."""
    parts: dict[str, TensorSlice] = {}
    for name, (_, inp) in layers.items():
        sl = slices.get(name)
        if sl is not None:
            parts.update(_layer_slices(quant, name.removesuffix(".weight"), inp, sl))
    return parts


def _layer_slices(
    quant: CheckpointQuant, prefix: str, inp: int, sl: TensorSlice
) -> dict[str, TensorSlice]:
    if quant.format is CheckpointFormat.AWQ:
        return awq_slices(prefix, inp, quant.group_size, sl)
    if quant.format is CheckpointFormat.GPTQ:
        return gptq_slices(prefix, quant.bits, sl)
    return {f"{prefix}.weight": sl}  # fp8, compressed-tensors: the scale is read whole


def convert_slice(
    quant: CheckpointQuant,
    prefix: str,
    read: Callable[[str], torch.Tensor],
    out: int,
    inp: int,
    sl: TensorSlice,
    dense: bool = False,
) -> QuantizedWeight | torch.Tensor:
    """Layer `prefix` ([out, in])'s part `sl`, from its stored tensors' parts as
    `stored_slices` names them (`read(name)` hands those out): a QuantizedWeight of exactly
    those rows or columns of `convert`'s, or with `dense` its dequantization (float32, the
    part's shape), which any part has. A GPTQ act-order part whose groups do not fit its
    width comes back dense either way (the section's comment).

    Raises:
        ValueError: what `convert` refuses; without `dense`, int4 columns that split a group.
    """

    def copy(name: str) -> torch.Tensor:  # a reader may hand out views of one shared buffer
        return read(name).clone()

    dim, a, b = sl
    if quant.format is CheckpointFormat.AWQ:
        return convert_awq_slice(prefix, copy, inp, quant.group_size, sl, dense)
    if quant.format is CheckpointFormat.GPTQ:
        return convert_gptq_slice(
            prefix, copy, inp, quant.bits, quant.group_size, quant.zero_offset, sl, dense
        )
    got = _convert_scaled(quant, prefix, copy, out, inp, (a, b) if dim == 0 else None)
    return got.dequantize(torch.float32) if dense else got


class QuantizedReader:
    """Reads a quantized checkpoint for the loader: a quantized layer's weight is converted
    (`read_quantized`) and, through `read`, handed back dequantized to float32 [out, in] (the
    model's dense fallback); every other tensor as stored.

    `slices` (tensor parallelism: dense weight name -> this rank's part, tandem.parallel.sharding):
    those layers come back as that part only, from the parts of their stored tensors that
    `stored_slices` gave `reader` (`convert_slice`)."""

    def __init__(
        self,
        reader: Any,
        quant: CheckpointQuant,
        layers: dict[str, tuple[int, int]],
        slices: Mapping[str, TensorSlice] | None = None,
    ) -> None:
        self.reader = reader  # has read(name) -> tensor (safetensors_io.TensorReader)
        self.quant = quant
        self.layers = layers
        self.slices = dict(slices or {})

    def read_quantized(self, name: str) -> QuantizedWeight | torch.Tensor:
        """Dense weight name (`prefix.weight`) of a quantized layer -> its QuantizedWeight
        (this rank's part with `slices`), or float32 [out, in] where the part has no int4
        form (GPTQ act-order columns: `convert_slice`)."""
        out, inp = self.layers[name]
        prefix = name.removesuffix(".weight")
        sl = self.slices.get(name)
        if sl is None:
            return convert(self.quant, prefix, self.reader.read, out, inp)
        return convert_slice(self.quant, prefix, self.reader.read, out, inp, sl)

    def read(self, name: str) -> torch.Tensor:
        if name not in self.layers:
            return self.reader.read(name)
        sl = self.slices.get(name)
        if sl is None:
            return convert(
                self.quant, name.removesuffix(".weight"), self.reader.read, *self.layers[name]
            ).dequantize(torch.float32)
        out, inp = self.layers[name]
        got = convert_slice(
            self.quant, name.removesuffix(".weight"), self.reader.read, out, inp, sl, dense=True
        )
        assert isinstance(got, torch.Tensor)
        return got
