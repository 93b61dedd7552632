"""GGUF layer matrices kept quantized: Q8_0 -> int8, Q4_0/Q4_1 -> int4 with group 32, read
from the GGUF's blocks into `QuantizedWeight` without a float copy of the matrix.

  Q4_0  x = d * (q - 8)      -> int4, scales d, zeros None (8)           exact
  Q4_1  x = d * q + m        -> int4, scales d, float zeros -m / d       exact up to fp32
                                                                         rounding of -m/d
  Q8_0  x = d_b * q          -> int8 per output channel: the int8 format has one scale per
        (d_b per 32 inputs)     row, so each row is quantized again from its blocks' values
                                with scale max|x| / 127: every value moves by at most half a
                                step of the row's scale (max_b d_b * max|q| / 254), a relative
                                error of the order of Q8_0's own when the row's block scales are
                                alike (`tests/unit/test_gguf_quant.py` pins the bound)

Nibbles: GGUF's byte j of a block holds element j (low) and j + 16 (high); ours hold inputs
2j (low) and 2j + 1 (high) (`tandem.quant.weight.pack_int4`), so the nibbles are re-paired.
Q and K rows are put back in HF's rotary order (`gguf.unpermute_rotary`) by permuting rows,
which carry their own scales.

A GGUF converted by `tandem.weights.fetch` is kept next to the model directory's files as
`model.gguf`; `GGUFMatrices` serves its matrices to the loader (`tandem.quant.online`)
when `--quantization` names their scheme.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
from gguf import GGMLQuantizationType, GGUFReader

from tandem.parallel.sharding import TensorSlice
from tandem.quant.weight import QuantizedWeight, WeightScheme, pack_int4, quantize_int8
from tandem.weights.gguf import QK, hf_tensor_name, tensor_shape, unpermute_rotary

GGUF_FILE = "model.gguf"  # the source GGUF, kept in a converted model directory
SOURCE_MARKER = "tandem-source.json"  # tandem.weights.fetch's record of a converted GGUF

logger = logging.getLogger(__name__)

NATIVE_SCHEMES = {
    GGMLQuantizationType.Q8_0: WeightScheme.INT8,
    GGMLQuantizationType.Q4_0: WeightScheme.INT4,
    GGMLQuantizationType.Q4_1: WeightScheme.INT4,
}
_BLOCK_BYTES = {
    GGMLQuantizationType.Q8_0: 2 + QK,
    GGMLQuantizationType.Q4_0: 2 + QK // 2,
    GGMLQuantizationType.Q4_1: 4 + QK // 2,
}
_LAYER_MATRICES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def quantized_tensor(
    raw: npt.NDArray[Any], qtype: GGMLQuantizationType, shape: tuple[int, int]
) -> QuantizedWeight:
    """A Q8_0/Q4_0/Q4_1 matrix's stored bytes -> QuantizedWeight [out, in] (`shape`, torch
    order), as in the module docstring.

    Raises:
        ValueError: another type, or a byte count that does not match `shape`.
    """
    if qtype not in NATIVE_SCHEMES:
        raise ValueError(f"{qtype.name} has no quantized scheme here; Q8_0, Q4_0, Q4_1 do")
    out, inp = shape
    blocks = _blocks(raw, qtype, shape)  # [out, blocks per row, block_bytes]
    d = _f16(blocks, 0)  # [out, in // 32]
    if qtype == GGMLQuantizationType.Q8_0:
        return quantize_int8(_q8_0_values(blocks, d))
    start = 2 if qtype == GGMLQuantizationType.Q4_0 else 4
    packed = blocks[..., start:]  # [out, in // 32, 16]
    low, high = packed & np.uint8(0xF), packed >> np.uint8(4)
    q = torch.from_numpy(np.concatenate([low, high], axis=-1)).view(out, inp)  # element order
    if qtype == GGMLQuantizationType.Q4_0:
        return QuantizedWeight(WeightScheme.INT4, pack_int4(q), d, None, QK)
    m = _f16(blocks, 2)
    safe = torch.where(d == 0, torch.ones_like(d), d)
    # d == 0: every value is m; scale 0 and zero 0 would lose it, so a tiny scale with the
    # zero point that lands q = 0..15 on m (to fp32 rounding).
    scales = torch.where(d == 0, torch.full_like(d, 1e-12), d)
    zeros = torch.where(d == 0, -m / 1e-12, -m / safe)
    return QuantizedWeight(WeightScheme.INT4, pack_int4(q), scales, zeros, QK)


def _blocks(
    raw: npt.NDArray[Any], qtype: GGMLQuantizationType, shape: tuple[int, int]
) -> npt.NDArray[np.uint8]:
    """A matrix's stored bytes as [out, blocks per row, block bytes]."""
    out, inp = shape
    block_bytes = _BLOCK_BYTES[qtype]
    buf = np.ascontiguousarray(raw).reshape(-1).view(np.uint8)
    if inp % QK or buf.size != out * inp // QK * block_bytes:
        raise ValueError(f"{qtype.name} tensor of shape {shape}: {buf.size} bytes do not fit")
    return buf.reshape(out, inp // QK, block_bytes)


def _q8_0_values(blocks: npt.NDArray[np.uint8], d: torch.Tensor) -> torch.Tensor:
    """Q8_0 blocks [out, n, 34] and their scales d [out, n] -> float32 values [out, n * 32]."""
    q8 = torch.from_numpy(np.ascontiguousarray(blocks[..., 2:]).view(np.int8))
    # [out, in // 32, 32] -> float per row, one row block at a time would save memory;
    # a matrix's worth of float32 is the loader's transient either way.
    return (q8.float() * d.unsqueeze(-1)).view(blocks.shape[0], -1)


def quantized_slice(
    raw: npt.NDArray[Any],
    qtype: GGMLQuantizationType,
    shape: tuple[int, int],
    sl: TensorSlice,
    row_absmax: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> QuantizedWeight:
    """A tensor-parallel rank's part `sl` (rows, dim 0, or columns, dim 1, of [out, in] =
    `shape`) of a Q8_0/Q4_0/Q4_1 matrix, from only the blocks that hold it (`raw` is
    GGUFReader's memory map: the other bytes are never read): exactly those rows or columns
    of `quantized_tensor`'s. Q8_0 columns take the whole rows' int8 scales from
    `row_absmax`, each row's largest |value| over every rank (a MAX all-reduce).

    Raises:
        ValueError: Q4_x columns that split a block of 32 (int4 groups start at a shard's
            first column), or Q8_0 columns without `row_absmax`.
    """
    out, inp = shape
    dim, a, b = sl
    rows = np.asarray(raw).reshape(out, -1)  # [out, bytes per row], still the memory map
    block_bytes = _BLOCK_BYTES[qtype]
    if dim == 0:
        return quantized_tensor(rows[a:b], qtype, (b - a, inp))
    first, last = a // QK, -(-b // QK)
    if qtype == GGMLQuantizationType.Q8_0:
        if row_absmax is None:
            raise ValueError(
                "a Q8_0 matrix's columns need the whole rows' largest values (the "
                "tensor-parallel group's MAX all-reduce) to take one matrix's int8 scales"
            )
        covering = rows[:, first * block_bytes : last * block_bytes]  # whole blocks
        blocks = _blocks(covering, qtype, (out, (last - first) * QK))
        values = _q8_0_values(blocks, _f16(blocks, 0))[:, a - first * QK : b - first * QK]
        return quantize_int8(values, row_absmax(values.abs().amax(dim=1)))
    if a % QK or b % QK:
        raise ValueError(
            f"{qtype.name} blocks of {QK} inputs: this tensor-parallel rank's input columns "
            f"[{a}, {b}) of {inp} split a block (int4 groups must start at the shard's first "
            "column): split o and down by their outputs instead (tp_exact_sums true, "
            "--tp-exact-sums true), serve the dequantized weights (--quantization none), or "
            "use a tensor_parallel_size whose shard boundaries fall on multiples of 32"
        )
    return quantized_tensor(rows[:, first * block_bytes : last * block_bytes], qtype, (out, b - a))


def _f16(blocks: npt.NDArray[np.uint8], start: int) -> torch.Tensor:
    """The f16 at bytes [start, start + 2) of every block, as float32 [out, blocks per row]."""
    raw = np.ascontiguousarray(blocks[..., start : start + 2]).view("<f2")[..., 0]
    return torch.from_numpy(raw.astype(np.float32))


def permute_rows(qw: QuantizedWeight, num_heads: int) -> QuantizedWeight:
    """`unpermute_rotary` on a quantized matrix: its rows, with their scales and zeros."""
    rows = torch.arange(qw.out_features, device=qw.qweight.device).view(-1, 1)
    order = unpermute_rotary(rows, num_heads).view(-1)

    def take(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t[order].contiguous()

    return QuantizedWeight(
        qw.scheme, qw.qweight[order].contiguous(), qw.scales[order].contiguous(),
        take(qw.zeros), qw.group_size, qw.g_idx,
    )  # fmt: skip


class GGUFMatrices:
    """The loader's source for a converted GGUF directory: layer matrices whose GGUF type
    maps to `scheme` come from the GGUF's blocks (`read_quantized`); every other tensor
    from `dense` (the directory's safetensors). `layers`: the names served quantized.

    A tensor-parallel rank's loader sets `slices` (HF name -> its part,
    tandem.parallel.sharding.tensor_slices) and `row_absmax` (the group's MAX all-reduce):
    those matrices come back as that part only (`quantized_slice`)."""

    def __init__(self, path: Path, dense: Any, scheme: WeightScheme, config: Any) -> None:
        self.reader = GGUFReader(str(path))
        self.dense = dense
        self.num_heads = config.num_q_heads
        self.num_kv_heads = config.num_kv_heads
        self.tensors = {}
        self.layers: dict[str, tuple[int, int]] = {}
        self.slices: dict[str, TensorSlice] = {}
        self.row_absmax: Callable[[torch.Tensor], torch.Tensor] | None = None
        for t in self.reader.tensors:
            name = hf_tensor_name(t.name)
            if name.split(".")[-2] not in _LAYER_MATRICES:
                continue
            if NATIVE_SCHEMES.get(t.tensor_type) is scheme:
                shape = tensor_shape(t)
                self.tensors[name] = t
                self.layers[name] = (shape[0], shape[1])

    def read_quantized(self, name: str) -> QuantizedWeight:
        t = self.tensors[name]
        out, inp = self.layers[name]
        sl = self.slices.get(name)
        if sl is None:
            qw = quantized_tensor(t.data, t.tensor_type, (out, inp))
        else:
            qw = quantized_slice(t.data, t.tensor_type, (out, inp), sl, self.row_absmax)
        # Q and K rows: permuted within each head, so a rank's whole heads are its own rows
        if ".self_attn.q_proj." in name:
            qw = permute_rows(qw, self.num_heads * qw.out_features // out)
        elif ".self_attn.k_proj." in name:
            qw = permute_rows(qw, self.num_kv_heads * qw.out_features // out)
        return qw

    def read(self, name: str) -> torch.Tensor:
        return self.dense.read(name)


def gguf_matrices(
    model_dir: Path, dense: Any, scheme: WeightScheme, config: Any
) -> GGUFMatrices | None:
    """`GGUFMatrices` of `model_dir`'s kept GGUF when it has one with matrices in `scheme`
    (logged: how many, from which block types, and that they are not quantized again).
    A directory converted from a GGUF that did not keep it gets a warning: its layer
    matrices will be quantized from their dequantization, a second rounding."""
    path = model_dir / GGUF_FILE
    if scheme is WeightScheme.NONE:
        return None
    if not path.is_file():
        if _converted_from_gguf(model_dir):
            logger.warning(
                "%s was converted from a GGUF but does not keep it (%s): --quantization %s "
                "quantizes its dequantized weights again, rounding them twice; fetch or "
                "convert the model again to serve the GGUF's own blocks",
                model_dir, GGUF_FILE, scheme.value,
            )  # fmt: skip
        return None
    source = GGUFMatrices(path, dense, scheme, config)
    if not source.layers:
        return None
    types = sorted({source.tensors[n].tensor_type.name for n in source.layers})
    how = (
        "their 4-bit values, scales and offsets as stored, group 32"
        if scheme is WeightScheme.INT4
        else "their 8-bit values re-scaled per row, within half a step"
    )
    logger.info(
        "--quantization %s: %d layer matrices served from %s's own %s blocks (%s; not "
        "quantized again: --quantization-group-size applies only to matrices quantized at "
        "load)",
        scheme.value, len(source.layers), GGUF_FILE, "/".join(types), how,
    )  # fmt: skip
    return source


def _converted_from_gguf(model_dir: Path) -> bool:
    try:
        marker = json.loads((model_dir / SOURCE_MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    if not isinstance(marker, dict):
        return False
    return str(marker.get("member") or marker.get("path") or "").endswith(".gguf")
