"""GPTQ checkpoints (v1 "gptq" and v2 "gptq_v2", 4 or 8 bits) read into INT4 (8 bits: INT8
per channel) `tandem.quant.weight.QuantizedWeight`s; `tandem.quant.checkpoint` dispatches here.

A quantized layer [out, in] with b bits, in groups of G inputs (per channel: G = in), is stored as

  qweight  int32 [in*b/32, out]     32/b inputs per word, input (32/b)r + j in
                                    bits [b*j, b*j + b)
  qzeros   int32 [groups, out*b/32] packed along the outputs; v1 ("gptq") stores zero - 1
                                    (the historical offset, `zero_offset` 1)
  scales   fp16  [groups, out]
  g_idx    int32 [in]               each input's group (act-order when not i // G)

and converted to w[o, i] = (q - zero) * scale (`tandem.quant.int4`); 8 bits load only per
channel and symmetric (zero 128), as INT8. A tensor-parallel rank's part (outputs [a, b) or
inputs [a, b): `tandem.quant.checkpoint.stored_slices`) reads

  outputs [a, b)  qweight, scales: columns [a, b); qzeros: words [a/8, b/8) (rounded out);
                  g_idx: whole
  inputs [a, b)   qweight: words [a/8, b/8) (rounded out); g_idx: [a, b); qzeros, scales:
                  whole (an act-order g_idx may name any group; 1/G of qweight)

Act-order input columns that use more groups than their width holds come back dense
(float32), as act-order projections that cannot share one fused matrix do at one rank.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from tandem.parallel.sharding import TensorSlice
from tandem.quant.int4 import int4_columns, int4_weight, parse_group_size, unpack_words
from tandem.quant.weight import QuantizedWeight, WeightScheme


def parse_gptq(qc: dict[str, Any]) -> tuple[int, int | None, int]:
    """Check a gptq `quantization_config`.

    Returns:
        (bits, group_size: inputs per scale or None for one per output channel,
        zero_offset: added to stored zero points, 1 for v1).

    Raises:
        ValueError: bits other than 4 or 8, an unknown checkpoint_format, or 8 bits that are
            not per channel and symmetric.
    """
    bits = int(qc.get("bits", 4))
    if bits not in (4, 8):
        raise ValueError(f"quantization_config.bits {bits} is not supported for gptq (4 or 8)")
    fmt = str(qc.get("checkpoint_format", qc.get("format", "gptq"))).lower()
    if fmt not in ("gptq", "gptq_v2"):
        raise ValueError(
            f"quantization_config.checkpoint_format {fmt!r} is not supported for gptq "
            "(gptq or gptq_v2)"
        )
    group = parse_group_size(qc.get("group_size", 128))
    if bits == 8 and (group is not None or not qc.get("sym", True)):
        raise ValueError(
            "8-bit gptq loads as int8 per channel: quantization_config.group_size must be -1 "
            f"and sym true, got group_size {qc.get('group_size')} and sym {qc.get('sym')}"
        )
    return bits, group, int(fmt == "gptq")


def gptq_tensors(
    prefix: str, out: int, inp: int, bits: int, group_size: int | None
) -> dict[str, tuple[int, ...] | None]:
    """The stored tensors of GPTQ layer `prefix` ([out, in]) and their shapes."""
    group = group_size or inp
    groups = -(-inp // group)
    per_word = 32 // bits
    return {
        f"{prefix}.qweight": (inp // per_word, out),
        f"{prefix}.qzeros": (groups, out // per_word),
        f"{prefix}.scales": (groups, out),
        f"{prefix}.g_idx": (inp,),
    }


def gptq_slices(prefix: str, bits: int, sl: TensorSlice) -> dict[str, TensorSlice]:
    """The parts of GPTQ layer `prefix`'s stored tensors that hold its part `sl` (the module
    doc); those not named are read whole."""
    dim, a, b = sl
    per_word = 32 // bits
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


def convert_gptq(
    prefix: str,
    read: Callable[[str], torch.Tensor],
    inp: int,
    bits: int,
    group_size: int | None,
    zero_offset: int,
) -> QuantizedWeight:
    """GPTQ layer `prefix` (`inp` inputs), its tensors read with `read(name)` -> INT4 (8 bits:
    INT8)."""
    q = unpack_words(read(f"{prefix}.qweight").t(), bits).flatten(1)  # [out, in]
    zeros = unpack_words(read(f"{prefix}.qzeros"), bits).flatten(1).t()  # [out, groups]
    scales = read(f"{prefix}.scales").t()  # [out, groups]
    g_idx = read(f"{prefix}.g_idx")
    result = _gptq_from(prefix, q, zeros + zero_offset, scales, g_idx, inp, bits, group_size)
    assert isinstance(result, QuantizedWeight)
    return result


def convert_gptq_slice(
    prefix: str,
    read: Callable[[str], torch.Tensor],
    inp: int,
    bits: int,
    group_size: int | None,
    zero_offset: int,
    sl: TensorSlice,
    dense: bool,
) -> QuantizedWeight | torch.Tensor:
    """Part `sl` of GPTQ layer `prefix`, from the parts of its tensors `gptq_slices` names:
    INT4 (8 bits: INT8), or with `dense` its dequantization (float32); act-order columns
    whose groups do not fit their width come back dense either way.

    Raises:
        ValueError: without `dense`, input columns that split an int4 group.
    """
    dim, a, b = sl
    skip = a % (32 // bits)  # values before `a` in the first word read
    q = unpack_words(read(f"{prefix}.qweight").t(), bits).flatten(1)
    zeros = unpack_words(read(f"{prefix}.qzeros"), bits).flatten(1)  # [groups, out']
    scales = read(f"{prefix}.scales").t()  # [out', groups]
    g_idx = read(f"{prefix}.g_idx")
    if dim == 0:
        zeros = zeros[:, skip : skip + b - a]
        offset_zeros = zeros.t() + zero_offset
        return _gptq_from(
            prefix, q, offset_zeros, scales, g_idx, inp, bits, group_size, dense=dense
        )
    q = q[:, skip : skip + b - a]
    offset_zeros = zeros.t() + zero_offset
    return _gptq_from(prefix, q, offset_zeros, scales, g_idx, inp, bits, group_size, (a, b), dense)


def _gptq_from(
    prefix: str,
    q: torch.Tensor,
    zeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: torch.Tensor,
    inp: int,
    bits: int,
    group_size: int | None,
    columns: tuple[int, int] | None = None,
    dense: bool = False,
) -> QuantizedWeight | torch.Tensor:
    """GPTQ values q [out, n] (all `inp` inputs, or with `columns` (a, b) inputs [a, b) only),
    zeros (offset added) and scales [out, groups], g_idx [n] (the inputs' groups) -> the
    layer's QuantizedWeight, or dense (`tandem.quant.int4.int4_columns`)."""
    if int(g_idx.min()) < 0 or int(g_idx.max()) >= scales.shape[1]:
        raise ValueError(f"{prefix}.g_idx names groups outside 0..{scales.shape[1] - 1}")
    if bits == 8:
        # Per channel and symmetric (parse_gptq): one zero, 128, per output.
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
    group = group_size or inp
    if columns is None:
        qw = int4_weight(prefix, q.contiguous(), zeros, scales, group, g_idx)
        return qw.dequantize(torch.float32) if dense else qw
    a, b = columns
    standard = torch.equal(g_idx.long(), torch.arange(a, b, device=g_idx.device) // group)
    return int4_columns(
        prefix, q, zeros, scales, g_idx.long(), columns, inp, group, standard, dense
    )
