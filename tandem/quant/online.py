"""Weights quantized as they load (`--quantization int8|int4|fp8`): each layer matrix is read,
quantized with the reference quantizer of its scheme (`tandem.quant.weight`) and its
full-precision copy dropped before the next is read, so peak memory is the quantized model
plus one full-precision tensor, never both models. A fused matrix (qkv, gate_up) is
quantized part by part and its parts' rows concatenated: every scheme's scales are per
output row (int4: per row and input group), so that equals quantizing the fused matrix.

A checkpoint that already holds a matrix in the asked scheme (an AWQ/GPTQ/fp8 checkpoint
through `tandem.quant.checkpoint`, a GGUF's Q8_0/Q4_x blocks through
`tandem.quant.gguf`) hands it over as stored; one in another scheme is dequantized and
quantized again (logged: that costs accuracy twice).

What stays in the model's dtype: embeddings (a row gather, not a matmul), norms and biases
(a few thousand values), and lm_head: it is tied to the embedding in most small models
(SmolLM2: one tensor serves both), and its errors land directly on the logits that sampling
reads; peers (vLLM, AWQ, GPTQ) keep it dense by default too.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

from tandem.quant.weight import QuantizedWeight, WeightScheme, quantize

logger = logging.getLogger(__name__)


class MatrixSource(Protocol):
    """What `quantized_matrix` reads: `read(name)` gives a dense tensor (any dtype, host or
    device; it may be a view that the next read overwrites)."""

    def read(self, name: str) -> torch.Tensor: ...


def quantized_matrix(
    source: MatrixSource,
    names: Sequence[str],
    scheme: WeightScheme,
    group_size: int,
    device: torch.device,
    dtype: torch.dtype = torch.float32,
    row_absmax: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> QuantizedWeight | torch.Tensor:
    """The rows of `names`' matrices ([out_i, in] each) concatenated, as one QuantizedWeight
    [sum(out_i), in] on `device`: kept as stored where `source` holds one in `scheme`
    (`source.read_quantized(name)`, for the names in `source.layers`), else quantized here.
    Stored int4 parts whose groups differ (GPTQ act-order with a g_idx per projection) cannot
    share one matrix: they come back dequantized, dense [in, out] in `dtype` (logged),
    rather than rounded a second time; so does a part `source` hands back dense (a
    tensor-parallel rank's columns of GPTQ act-order groups: checkpoint.convert_slice).
    A stored part in another scheme is dequantized and quantized again, with `row_absmax`
    like a dense part.

    `row_absmax`, for a tensor-parallel rank's columns of a row-parallel matrix: maps each
    row's largest |value| in this rank's columns to the whole row's (a MAX all-reduce over
    the ranks), so per-channel scales (int8, fp8) are the unsplit matrix's and every rank's
    values those of one quantized matrix. Called once per part, in the same order on every
    rank. int4's groups lie inside a rank's columns and need none.

    Raises:
        ValueError: int4 with a group size that does not divide the input features.
    """
    stored = getattr(source, "layers", None) or {}
    split = row_absmax is not None and scheme in (WeightScheme.INT8, WeightScheme.FP8)
    parts: list[QuantizedWeight | torch.Tensor] = []
    for name in names:
        if name in stored:
            read_quantized = source.read_quantized  # type: ignore[attr-defined]
            got: QuantizedWeight | torch.Tensor = read_quantized(name)
            if isinstance(got, torch.Tensor) and scheme is WeightScheme.INT4:
                parts.append(got.to(device=device, dtype=torch.float32))  # kept dense
                continue
            if isinstance(got, QuantizedWeight):
                if got.scheme is scheme:
                    parts.append(to_device(got, device))
                    continue
                logger.warning(
                    "%s is stored as %s: dequantized and quantized again as %s",
                    name, got.scheme.value, scheme.value,
                )  # fmt: skip
                got = got.dequantize(torch.float32)
            dense = got.to(device=device, dtype=torch.float32)
        else:
            dense = source.read(name).to(device=device, dtype=torch.float32)
        absmax = None
        if split and row_absmax is not None:
            absmax = row_absmax(dense.abs().amax(dim=1))
        parts.append(quantize(dense, scheme, group_size, absmax))
        del dense
    quantized = [p for p in parts if isinstance(p, QuantizedWeight)]
    fused = cat_rows(quantized) if len(quantized) == len(parts) else None
    if fused is None:
        logger.warning(
            "%s: int4 parts with different groups (GPTQ act-order) are kept dense",
            ", ".join(names),
        )
        return (
            torch.cat(
                [p if isinstance(p, torch.Tensor) else p.dequantize(torch.float32) for p in parts]
            )
            .t()
            .contiguous()
            .to(dtype)
        )
    return fused


def to_device(qw: QuantizedWeight, device: torch.device) -> QuantizedWeight:
    if qw.qweight.device == device:
        return qw

    def move(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.to(device)

    return QuantizedWeight(
        qw.scheme,
        qw.qweight.to(device),
        qw.scales.to(device),
        move(qw.zeros),
        qw.group_size,
        move(qw.g_idx),
    )


def cat_rows(parts: Sequence[QuantizedWeight]) -> QuantizedWeight | None:
    """Matrices with the same input features stacked by rows, in one scheme; None for int4
    parts whose groups differ (group size, g_idx): one matrix cannot hold them.

    fp8 per-tensor scales become per-row ones (a part's scale repeated over its rows); int4
    parts with no zero points get 8.
    """
    if len(parts) == 1:
        return parts[0]
    first = parts[0]
    scheme = first.scheme
    assert all(p.scheme is scheme for p in parts), [p.scheme for p in parts]
    if scheme is not WeightScheme.INT4:
        scales = [p.scales.expand(p.out_features) for p in parts]
        return QuantizedWeight(
            scheme,
            torch.cat([p.qweight for p in parts]),
            torch.cat(scales).contiguous(),
            None,
            first.in_features,
        )
    same_groups = all(
        p.group_size == first.group_size
        and (p.g_idx is None) == (first.g_idx is None)
        and (p.g_idx is None or torch.equal(p.g_idx, first.g_idx))  # type: ignore[arg-type]
        for p in parts
    )
    if not same_groups:
        return None
    zeros: Any = None
    if any(p.zeros is not None for p in parts):
        floats = any(p.zeros is not None and p.zeros.dtype == torch.float32 for p in parts)
        zdtype = torch.float32 if floats else torch.uint8
        zeros = torch.cat(
            [
                torch.full_like(p.scales, 8, dtype=zdtype) if p.zeros is None
                else p.zeros.to(zdtype)
                for p in parts
            ]
        )  # fmt: skip
    return QuantizedWeight(
        WeightScheme.INT4,
        torch.cat([p.qweight for p in parts]),
        torch.cat([p.scales for p in parts]),
        zeros,
        first.group_size,
        first.g_idx,
    )
