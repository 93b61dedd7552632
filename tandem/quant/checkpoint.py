"""Quantized HF checkpoints (AWQ, GPTQ, FP8, compressed-tensors) converted into the one
in-memory format, `tandem.quant.weight.QuantizedWeight`.

Which format a checkpoint is in is read from config.json's `quantization_config`
(`read_checkpoint_quant`). A linear layer `prefix` (e.g. `model.layers.0.mlp.down_proj`) is
quantized when its quantized tensors are in the files; otherwise it is stored dense as
`prefix.weight` (the lm_head, an `ignore`/`modules_to_not_convert` list). On disk:

  format           tensors of a quantized layer, [out, in] = the layer's weight shape
  awq (GEMM)       qweight int32 [in, out/8]     eight 4-bit outputs per word, nibble i holding
                                                 output 8c + AWQ_ORDER[i]
                   qzeros  int32 [in/G, out/8]   packed as qweight
                   scales  fp16  [in/G, out]
  gptq (v1, v2)    qweight int32 [in*b/32, out]  32/b inputs per word, input (32/b)r + j in
                                                 bits [b*j, b*j + b) (b = 4 or 8)
                   qzeros  int32 [groups, out*b/32]  packed along the outputs; v1 ("gptq")
                                                 stores zero - 1 (the historical offset)
                   scales  fp16  [groups, out]
                   g_idx   int32 [in]            each input's group (act-order when not i // G)
  fp8              weight  e4m3  [out, in]
                   weight_scale_inv [out/Bo, in/Bi] (block-wise), or weight_scale [] / [1] /
                   [out] / [out, 1]: w = weight * scale
  compressed-      weight  e4m3  [out, in] (float-quantized) or int8 (int-quantized, 8 bits)
  tensors          weight_scale [out, 1] (channel) or [1] (tensor)

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
from tandem.quant.weight import INT4_GROUP_SIZES, QuantizedWeight, WeightScheme, pack_int4

# AWQ's GEMM packing: nibble i of a word holds output 8c + AWQ_ORDER[i].
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)

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
        return _parse_awq(qc)
    if method == "gptq":
        return _parse_gptq(qc)
    if method == "fp8":
        block = qc.get("weight_block_size")
        return CheckpointQuant(
            CheckpointFormat.FP8, 8, None, block_size=None if block is None else _pair(block)
        )
    if method == "compressed-tensors":
        return _parse_compressed(qc)
    raise ValueError(
        f"quantization_config.quant_method {qc.get('quant_method')!r} is not supported; "
        f"supported: {', '.join(f.value for f in CheckpointFormat)}"
    )


def _pair(value: Any) -> tuple[int, int]:
    rows, cols = (int(v) for v in value)
    return rows, cols


def _group(value: Any) -> int | None:
    g = int(value)
    return None if g <= 0 else g  # -1: one group per output channel


def _parse_awq(qc: dict[str, Any]) -> CheckpointQuant:
    bits = int(qc.get("bits", qc.get("w_bit", 4)))
    if bits != 4:
        raise ValueError(f"quantization_config.bits {bits} is not supported for awq (only 4)")
    version = str(qc.get("version", "gemm")).lower()
    if version != "gemm":
        raise ValueError(
            f"quantization_config.version {qc.get('version')!r} is not supported for awq "
            "(only the GEMM packing)"
        )
    if not qc.get("zero_point", True):
        raise ValueError("quantization_config.zero_point false is not supported for awq")
    group = _group(qc.get("group_size", qc.get("q_group_size", 128)))
    return CheckpointQuant(CheckpointFormat.AWQ, 4, group)


def _parse_gptq(qc: dict[str, Any]) -> CheckpointQuant:
    bits = int(qc.get("bits", 4))
    if bits not in (4, 8):
        raise ValueError(f"quantization_config.bits {bits} is not supported for gptq (4 or 8)")
    fmt = str(qc.get("checkpoint_format", qc.get("format", "gptq"))).lower()
    if fmt not in ("gptq", "gptq_v2"):
        raise ValueError(
            f"quantization_config.checkpoint_format {fmt!r} is not supported for gptq "
            "(gptq or gptq_v2)"
        )
    group = _group(qc.get("group_size", 128))
    if bits == 8 and (group is not None or not qc.get("sym", True)):
        raise ValueError(
            "8-bit gptq loads as int8 per channel: quantization_config.group_size must be -1 "
            f"and sym true, got group_size {qc.get('group_size')} and sym {qc.get('sym')}"
        )
    return CheckpointQuant(CheckpointFormat.GPTQ, bits, group, zero_offset=int(fmt == "gptq"))


def _parse_compressed(qc: dict[str, Any]) -> CheckpointQuant:
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
    return CheckpointQuant(CheckpointFormat.COMPRESSED_TENSORS, 8, None, int_weights=kind == "int")


def stored_tensors(
    quant: CheckpointQuant, prefix: str, out: int, inp: int
) -> dict[str, tuple[int, ...] | None]:
    """The tensors of quantized layer `prefix` ([out, in]) and their shapes (None: the
    shape is checked when converted, as fp8 scales come in several)."""
    if quant.format in (CheckpointFormat.AWQ, CheckpointFormat.GPTQ):
        group = quant.group_size or inp
        groups = -(-inp // group)
        if quant.format is CheckpointFormat.AWQ:
            return {
                f"{prefix}.qweight": (inp, out // 8),
                f"{prefix}.qzeros": (groups, out // 8),
                f"{prefix}.scales": (groups, out),
            }
        per_word = 32 // quant.bits
        shapes: dict[str, tuple[int, ...] | None] = {
            f"{prefix}.qweight": (inp // per_word, out),
            f"{prefix}.qzeros": (groups, out // per_word),
            f"{prefix}.scales": (groups, out),
        }
        shapes[f"{prefix}.g_idx"] = (inp,)
        return shapes
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
        return _convert_awq(quant, prefix, copy, out, inp)
    if quant.format is CheckpointFormat.GPTQ:
        return _convert_gptq(quant, prefix, copy, out, inp)
    return _convert_fp8(quant, prefix, copy, out, inp)


def unpack_words(words: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [rows, cols] -> int32 [rows, cols, 32 // bits]: field j = bits [bits*j, ...)."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=words.device)
    return (words.to(torch.int32).unsqueeze(-1) >> shifts) & ((1 << bits) - 1)


def _int4(
    prefix: str,
    q: torch.Tensor,
    zeros: torch.Tensor,
    scales: torch.Tensor,
    group: int,
    g_idx: torch.Tensor | None,
) -> QuantizedWeight:
    """q [out, in] in 0..15, zeros and scales [out, groups] of `group` inputs -> INT4,
    repeating groups down to a supported size when the checkpoint's are larger."""
    inp = q.shape[1]
    if g_idx is not None and torch.equal(
        g_idx.long(), torch.arange(inp, device=g_idx.device) // group
    ):
        g_idx = None  # GPTQ stores g_idx even without act-order
    target = group
    if group not in INT4_GROUP_SIZES:
        fits = [g for g in INT4_GROUP_SIZES if group % g == 0 and inp % g == 0]
        if not fits or g_idx is not None or inp % group:
            raise ValueError(
                f"{prefix}: group_size {group} (in_features {inp}"
                + (", act-order g_idx" if g_idx is not None else "")
                + f") cannot be expressed in int4 groups of {INT4_GROUP_SIZES}"
            )
        target = fits[-1]
        zeros = zeros.repeat_interleave(group // target, dim=1)
        scales = scales.repeat_interleave(group // target, dim=1)
    elif inp % group:
        raise ValueError(f"{prefix}: group_size {group} does not divide in_features {inp}")
    zero_values = zeros.to(torch.int32)
    if bool((zero_values == 8).all()):
        stored_zeros: torch.Tensor | None = None  # symmetric: the format's default zero
    elif int(zero_values.max()) <= 15:
        stored_zeros = zero_values.to(torch.uint8)
    else:
        stored_zeros = zero_values.float()  # GPTQ v1's zero 0 is stored as 15, read as 16
    return QuantizedWeight(
        WeightScheme.INT4,
        pack_int4(q),
        scales.float().contiguous(),
        stored_zeros,
        target,
        None if g_idx is None else g_idx.to(torch.int32).contiguous(),
    )


def _convert_awq(
    quant: CheckpointQuant, prefix: str, read: Callable[[str], torch.Tensor], out: int, inp: int
) -> QuantizedWeight:
    q, zeros, scales = _awq_values(prefix, read)
    return _int4(prefix, q.contiguous(), zeros, scales, quant.group_size or inp, None)


def _awq_values(
    prefix: str, read: Callable[[str], torch.Tensor]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """An AWQ layer's (or the part the reader hands out) values q [out, in], zeros and scales
    [out, groups]."""
    # Undo the nibble order: field i of word c is output 8c + AWQ_ORDER[i].
    where = torch.tensor(AWQ_ORDER, device="cpu").argsort()  # output 8c + k sits in field where[k]

    def unpack(words: torch.Tensor) -> torch.Tensor:  # [rows, out/8] -> [rows, out]
        return unpack_words(words, 4)[:, :, where].flatten(1)

    q = unpack(read(f"{prefix}.qweight")).t()  # [out, in]
    zeros = unpack(read(f"{prefix}.qzeros")).t()  # [out, groups]
    scales = read(f"{prefix}.scales").t()  # [out, groups]
    return q, zeros, scales


def _convert_gptq(
    quant: CheckpointQuant, prefix: str, read: Callable[[str], torch.Tensor], out: int, inp: int
) -> QuantizedWeight:
    q = unpack_words(read(f"{prefix}.qweight").t(), quant.bits).flatten(1)  # [out, in]
    zeros = unpack_words(read(f"{prefix}.qzeros"), quant.bits).flatten(1).t()  # [out, groups]
    scales = read(f"{prefix}.scales").t()  # [out, groups]
    g_idx = read(f"{prefix}.g_idx")
    result = _gptq_from(quant, prefix, q, zeros + quant.zero_offset, scales, g_idx, inp)
    assert isinstance(result, QuantizedWeight)
    return result


def _gptq_from(
    quant: CheckpointQuant,
    prefix: str,
    q: torch.Tensor,
    zeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: torch.Tensor,
    inp: int,
    columns: tuple[int, int] | None = None,
    dense: bool = False,
) -> QuantizedWeight | torch.Tensor:
    """GPTQ values q [out, n] (all `inp` inputs, or with `columns` (a, b) inputs [a, b) only),
    zeros (offset added) and scales [out, groups], g_idx [n] (the inputs' groups) -> the
    layer's QuantizedWeight, or dense (`_int4_columns`)."""
    if int(g_idx.min()) < 0 or int(g_idx.max()) >= scales.shape[1]:
        raise ValueError(f"{prefix}.g_idx names groups outside 0..{scales.shape[1] - 1}")
    if quant.bits == 8:
        # Per channel and symmetric (parse_quant_config): one zero, 128, per output.
        if not bool((zeros == 128).all()):
            raise ValueError(
                f"{prefix}.qzeros: 8-bit gptq with sym true must have zero points 128, got "
                f"{sorted(set(zeros.flatten().tolist()))[:4]}"
            )
        values = (q - 128).to(torch.int8)
        qw = QuantizedWeight(
            WeightScheme.INT8, values, scales[:, 0].float().contiguous(), None, q.shape[1]
        )
        return qw.dequantize(torch.float32) if dense else qw
    group = quant.group_size or inp
    if columns is None:
        qw = _int4(prefix, q.contiguous(), zeros, scales, group, g_idx)
        return qw.dequantize(torch.float32) if dense else qw
    a, b = columns
    standard = torch.equal(g_idx.long(), torch.arange(a, b, device=g_idx.device) // group)
    return _int4_columns(
        prefix, q, zeros, scales, g_idx.long(), columns, inp, group, standard, dense
    )


def _convert_fp8(
    quant: CheckpointQuant,
    prefix: str,
    read: Callable[[str], torch.Tensor],
    out: int,
    inp: int,
    rows: tuple[int, int] | None = None,
) -> QuantizedWeight:
    """fp8 (or compressed-tensors int8) layer [out, in]; `rows` (a, b): the reader hands out
    the weight's rows [a, b) (or, without `rows`, whatever part it was given: a
    tensor-parallel rank's columns) and the scale whole, which is cut to those rows."""
    weight = read(f"{prefix}.weight")
    name = f"{prefix}.{scale_name(quant)}"
    scale = read(name).float()
    cols = int(weight.shape[1])

    def build(scheme: WeightScheme, scale: torch.Tensor) -> QuantizedWeight:
        if rows is not None and scale.numel() != 1:
            scale = scale[rows[0] : rows[1]]
        return QuantizedWeight(scheme, weight, scale.contiguous(), None, cols)

    if quant.int_weights:
        if weight.dtype != torch.int8 or scale.numel() != out:
            raise ValueError(
                f"{prefix}: int-quantized weights must be int8 with {out} scales, got "
                f"{weight.dtype} and scale shape {tuple(scale.shape)}"
            )
        return build(WeightScheme.INT8, scale.reshape(out))
    if weight.dtype != torch.float8_e4m3fn:
        raise ValueError(f"{prefix}.weight must be float8_e4m3fn, got {weight.dtype}")
    if quant.block_size is not None and scale.numel() > 1 and scale.numel() != out:
        block_rows, block_cols = quant.block_size
        grid = (-(-out // block_rows), -(-inp // block_cols))
        if tuple(scale.shape) != grid:
            raise ValueError(
                f"{name} must be {grid} for weight_block_size, got {tuple(scale.shape)}"
            )
        if grid[1] != 1:
            raise ValueError(
                f"{name}: block-wise fp8 scales (quantization_config.weight_block_size "
                f"{list(quant.block_size)}, {grid[1]} blocks along in_features {inp}) are not "
                "supported: the fp8 format holds per-channel or per-tensor scales only"
            )
        scale = scale[:, 0].repeat_interleave(block_rows)[:out]  # one block column: per channel
    if scale.numel() == 1:
        return build(WeightScheme.FP8, scale.reshape(1))
    if scale.numel() != out:
        raise ValueError(f"{name} must hold 1 or {out} scales, got shape {tuple(scale.shape)}")
    return build(WeightScheme.FP8, scale.reshape(out))


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
# (`stored_slices`), converted (`convert_slice`) and holds exactly the values of those rows or
# columns of the whole layer's conversion:
#
#   format  outputs [a, b)                           inputs [a, b)
#   awq     qweight, qzeros: words [a/8, b/8)        qweight: rows [a, b)
#           (rounded out, trimmed after unpacking)   qzeros, scales: groups [a/G, b/G)
#           scales: columns of those words
#   gptq    qweight, scales: columns [a, b)          qweight: words [a/8, b/8) (rounded out)
#           qzeros: words [a/8, b/8) (rounded out)   g_idx: [a, b)
#           g_idx: whole                             qzeros, scales: whole (an act-order
#                                                    g_idx may name any group; 1/G of qweight)
#   fp8     weight: rows [a, b)                      weight: columns [a, b)
#           scale: whole (at most one per row)       scale: whole
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
    -> [out, in]): the table above. Stored tensors not named are read whole."""
    parts: dict[str, TensorSlice] = {}
    for name, (_, inp) in layers.items():
        sl = slices.get(name)
        if sl is not None:
            parts.update(_layer_slices(quant, name.removesuffix(".weight"), inp, sl))
    return parts


def _layer_slices(
    quant: CheckpointQuant, prefix: str, inp: int, sl: TensorSlice
) -> dict[str, TensorSlice]:
    dim, a, b = sl
    if quant.format is CheckpointFormat.AWQ:
        if dim == 0:
            wa, wb = a // 8, -(-b // 8)
            return {
                f"{prefix}.qweight": TensorSlice(1, wa, wb),
                f"{prefix}.qzeros": TensorSlice(1, wa, wb),
                f"{prefix}.scales": TensorSlice(1, 8 * wa, 8 * wb),
            }
        group = quant.group_size or inp
        ga, gb = a // group, -(-b // group)
        return {
            f"{prefix}.qweight": TensorSlice(0, a, b),
            f"{prefix}.qzeros": TensorSlice(0, ga, gb),
            f"{prefix}.scales": TensorSlice(0, ga, gb),
        }
    if quant.format is CheckpointFormat.GPTQ:
        per_word = 32 // quant.bits
        wa, wb = a // per_word, -(-b // per_word)
        if dim == 0:
            return {
                f"{prefix}.qweight": TensorSlice(1, a, b),
                f"{prefix}.qzeros": TensorSlice(1, wa, wb),
                f"{prefix}.scales": TensorSlice(1, a, b),
            }
        return {
            f"{prefix}.qweight": TensorSlice(0, wa, wb),
            f"{prefix}.g_idx": TensorSlice(0, a, b),
        }
    return {f"{prefix}.weight": sl}


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
    got: QuantizedWeight | torch.Tensor
    if quant.format is CheckpointFormat.AWQ:
        q, zeros, scales = _awq_values(prefix, copy)
        group = quant.group_size or inp
        if dim == 0:
            start = a // 8 * 8  # the words read: outputs [start, ...)
            qw = _int4(prefix, q.contiguous(), zeros, scales, group, None)
            got = take_rows(qw, a - start, b - start)
        else:
            groups = torch.arange(a, b, device=q.device) // group - a // group
            return _int4_columns(prefix, q, zeros, scales, groups, (a, b), inp, group, True, dense)
    elif quant.format is CheckpointFormat.GPTQ:
        per_word = 32 // quant.bits
        skip = a % per_word  # values before `a` in the first word read
        q = unpack_words(copy(f"{prefix}.qweight").t(), quant.bits).flatten(1)
        zeros = unpack_words(copy(f"{prefix}.qzeros"), quant.bits).flatten(1)  # [groups, out']
        scales = copy(f"{prefix}.scales").t()  # [out', groups]
        g_idx = copy(f"{prefix}.g_idx")
        if dim == 0:
            zeros = zeros[:, skip : skip + b - a]
            args = (quant, prefix, q, zeros.t() + quant.zero_offset, scales, g_idx, inp)
            return _gptq_from(*args, dense=dense)
        q = q[:, skip : skip + b - a]
        args = (quant, prefix, q, zeros.t() + quant.zero_offset, scales, g_idx, inp)
        return _gptq_from(*args, columns=(a, b), dense=dense)
    else:
        got = _convert_fp8(quant, prefix, copy, out, inp, (a, b) if dim == 0 else None)
    if dense and isinstance(got, QuantizedWeight):
        return got.dequantize(torch.float32)
    return got


def take_rows(qw: QuantizedWeight, start: int, stop: int) -> QuantizedWeight:
    """Rows [start, stop) of a quantized matrix, with their scales and zero points."""
    if (start, stop) == (0, qw.out_features):
        return qw
    per_tensor = qw.scheme is WeightScheme.FP8 and tuple(qw.scales.shape) == (1,)

    def cut(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t[start:stop].contiguous()

    return QuantizedWeight(
        qw.scheme,
        qw.qweight[start:stop].contiguous(),
        qw.scales if per_tensor else qw.scales[start:stop].contiguous(),
        cut(qw.zeros),
        qw.group_size,
        qw.g_idx,
    )


def _int4_columns(
    prefix: str,
    q: torch.Tensor,
    zeros: torch.Tensor,
    scales: torch.Tensor,
    groups: torch.Tensor,
    columns: tuple[int, int],
    inp: int,
    group: int,
    standard: bool,
    dense: bool,
) -> QuantizedWeight | torch.Tensor:
    """Inputs [a, b) (`columns`) of an int4 layer of `inp` inputs in groups of `group`: q
    [out, b - a] values, zeros (offset added) and scales [out, k], `groups` [b - a] each
    input's column of them; `standard`: input i is in group i // `group` (no act-order).

    Raises:
        ValueError: standard groups that no int4 group size splits at `a` (unless `dense`).
    """
    a, b = columns
    n = b - a
    if dense:
        return (q.float() - zeros.float()[:, groups]) * scales.float()[:, groups]
    if standard:
        fits = [t for t in INT4_GROUP_SIZES if group % t == 0 and a % t == 0 and n % t == 0]
        if not fits:
            raise ValueError(
                f"{prefix}: this tensor-parallel rank's input columns [{a}, {b}) of {inp} "
                f"split a quantization group of {group} (int4 groups of "
                f"{'/'.join(map(str, INT4_GROUP_SIZES))} must start at the shard's first "
                "column and lie inside the checkpoint's groups): split o and down by their "
                "outputs instead (tp_exact_sums true, --tp-exact-sums true), read the "
                "checkpoint dequantized (--quantization none), or use a tensor_parallel_size "
                "whose shard boundaries fall on group boundaries"
            )
        cols = groups[:: fits[-1]]  # each int4 group's column
        return _int4(prefix, q.contiguous(), zeros[:, cols], scales[:, cols], fits[-1], None)
    used = torch.unique(groups)  # sorted
    fits = [t for t in INT4_GROUP_SIZES if n % t == 0 and n // t >= used.numel()]
    if not fits:
        return (q.float() - zeros.float()[:, groups]) * scales.float()[:, groups]
    width = n // fits[-1]  # the int4 groups the part has room for
    cols = torch.cat([used, used[-1:].expand(width - used.numel())])
    local = torch.searchsorted(used, groups).to(torch.int32)
    return _int4(prefix, q.contiguous(), zeros[:, cols], scales[:, cols], fits[-1], local)


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
