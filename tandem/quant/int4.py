"""The int4 side of AWQ and GPTQ checkpoints (`tandem.quant.awq`, `tandem.quant.gptq`):
unpacking their int32 words, turning values, zero points and scales into an INT4
`tandem.quant.weight.QuantizedWeight`, and a tensor-parallel rank's rows or columns of one.

Both formats compute w[o, i] = (q - zero) * scale over groups of G inputs. A group size larger
than int4's (`INT4_GROUP_SIZES`; per channel: G = in) repeats each scale and zero, which is
exact; what cannot be expressed exactly is refused with a ValueError naming the layer.
"""

from __future__ import annotations

from typing import Any

import torch

from tandem.quant.weight import INT4_GROUP_SIZES, QuantizedWeight, WeightScheme, pack_int4


def parse_group_size(value: Any) -> int | None:
    """A `quantization_config` group_size -> inputs per group, or None: one group per output
    channel (stored as -1)."""
    g = int(value)
    return None if g <= 0 else g  # -1: one group per output channel


def unpack_words(words: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [rows, cols] -> int32 [rows, cols, 32 // bits]: field j = bits [bits*j, ...)."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=words.device)
    return (words.to(torch.int32).unsqueeze(-1) >> shifts) & ((1 << bits) - 1)


def int4_weight(
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


def int4_columns(
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

    A rank's columns hold int4 groups that start at its first column and lie inside the
    checkpoint's groups. Act-order columns that use more groups than their width holds come
    back dense (float32 [out, b - a]), as does everything with `dense`.

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
        return int4_weight(prefix, q.contiguous(), zeros[:, cols], scales[:, cols], fits[-1], None)
    used = torch.unique(groups)  # sorted
    fits = [t for t in INT4_GROUP_SIZES if n % t == 0 and n // t >= used.numel()]
    if not fits:
        return (q.float() - zeros.float()[:, groups]) * scales.float()[:, groups]
    width = n // fits[-1]  # the int4 groups the part has room for
    cols = torch.cat([used, used[-1:].expand(width - used.numel())])
    local = torch.searchsorted(used, groups).to(torch.int32)
    return int4_weight(prefix, q.contiguous(), zeros[:, cols], scales[:, cols], fits[-1], local)
