"""AWQ checkpoints (AutoAWQ's GEMM packing: 4 bits, with zero points) read into INT4
`tandem.quant.weight.QuantizedWeight`s; `tandem.quant.checkpoint` dispatches here.

A quantized layer [out, in] in groups of G inputs (per channel: G = in) is stored as

  qweight  int32 [in, out/8]    eight 4-bit outputs per word, nibble i holding output
                                8c + AWQ_ORDER[i]
  qzeros   int32 [in/G, out/8]  packed as qweight
  scales   fp16  [in/G, out]

and converted to w[o, i] = (q - zero) * scale (`tandem.quant.int4`). A tensor-parallel
rank's part (outputs [a, b) or inputs [a, b): `tandem.quant.checkpoint.stored_slices`) reads

  outputs [a, b)  qweight, qzeros: words [a/8, b/8) (rounded out, trimmed after unpacking);
                  scales: the columns of those words
  inputs [a, b)   qweight: rows [a, b); qzeros, scales: groups [a/G, b/G)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from tandem.parallel.sharding import TensorSlice
from tandem.quant.int4 import int4_columns, int4_weight, parse_group_size, take_rows, unpack_words
from tandem.quant.weight import QuantizedWeight

# AWQ's GEMM packing: nibble i of a word holds output 8c + AWQ_ORDER[i].
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def parse_awq(qc: dict[str, Any]) -> int | None:
    """Check an awq `quantization_config`.

    Returns:
        its group size: inputs per scale, or None for one scale per output channel.

    Raises:
        ValueError: bits other than 4, a packing other than GEMM, or no zero points.
    """
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
    return parse_group_size(qc.get("group_size", qc.get("q_group_size", 128)))


def awq_tensors(
    prefix: str, out: int, inp: int, group_size: int | None
) -> dict[str, tuple[int, ...] | None]:
    """The stored tensors of AWQ layer `prefix` ([out, in]) and their shapes."""
    group = group_size or inp
    groups = -(-inp // group)
    return {
        f"{prefix}.qweight": (inp, out // 8),
        f"{prefix}.qzeros": (groups, out // 8),
        f"{prefix}.scales": (groups, out),
    }


def awq_slices(
    prefix: str, inp: int, group_size: int | None, sl: TensorSlice
) -> dict[str, TensorSlice]:
    """The parts of AWQ layer `prefix`'s stored tensors that hold its part `sl` (the module
    doc)."""
    dim, a, b = sl
    if dim == 0:
        wa, wb = a // 8, -(-b // 8)
        return {
            f"{prefix}.qweight": TensorSlice(1, wa, wb),
            f"{prefix}.qzeros": TensorSlice(1, wa, wb),
            f"{prefix}.scales": TensorSlice(1, 8 * wa, 8 * wb),
        }
    group = group_size or inp
    ga, gb = a // group, -(-b // group)
    return {
        f"{prefix}.qweight": TensorSlice(0, a, b),
        f"{prefix}.qzeros": TensorSlice(0, ga, gb),
        f"{prefix}.scales": TensorSlice(0, ga, gb),
    }


def convert_awq(
    prefix: str, read: Callable[[str], torch.Tensor], inp: int, group_size: int | None
) -> QuantizedWeight:
    """AWQ layer `prefix` (`inp` inputs), its tensors read with `read(name)` -> INT4."""
    q, zeros, scales = _awq_values(prefix, read)
    return int4_weight(prefix, q.contiguous(), zeros, scales, group_size or inp, None)


def convert_awq_slice(
    prefix: str,
    read: Callable[[str], torch.Tensor],
    inp: int,
    group_size: int | None,
    sl: TensorSlice,
    dense: bool,
) -> QuantizedWeight | torch.Tensor:
    """Part `sl` of AWQ layer `prefix`, from the parts of its tensors `awq_slices` names:
    INT4, or with `dense` its dequantization (float32).

    Raises:
        ValueError: without `dense`, input columns that split an int4 group.
    """
    dim, a, b = sl
    q, zeros, scales = _awq_values(prefix, read)
    group = group_size or inp
    if dim == 0:
        start = a // 8 * 8  # the words read: outputs [start, ...)
        qw = int4_weight(prefix, q.contiguous(), zeros, scales, group, None)
        got = take_rows(qw, a - start, b - start)
        return got.dequantize(torch.float32) if dense else got
    groups = torch.arange(a, b, device=q.device) // group - a // group
    return int4_columns(prefix, q, zeros, scales, groups, (a, b), inp, group, True, dense)


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
