"""Attention of sliding-window layers and of layers with sinks (Gemma 3, gpt-oss) on the
CPU backend (tandem.model.attention.TorchAttention calls these for such layers).

A sliding layer's query at position p attends to keys at (p - window, p]; a sink is a learned
logit per head that joins the softmax's denominator and is attached to no value. Decode rows
read only their window's blocks (`DecodeGroup.windowed`); a prefill chunk is computed in tiles
of queries, each over the keys it can see.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from tandem.quant.kv import dequantize_kv


def prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    context_len: int,
    block_ids: torch.Tensor,
    scale: float,
    kv_scales: tuple[float, float] | None,
    window: int | None,
    sinks: torch.Tensor | None,
    gather: Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor],
) -> torch.Tensor:
    """A chunk of a sliding layer or one with sinks, in tiles of PREFILL_TILE queries:
    each tile reads only the keys its queries can see (with a window, its last
    `window` - 1 positions before the tile and the tile itself), so memory and work
    grow with chunk x window, not chunk x context. The chunk (q's rows) holds the last
    positions of `context_len`, whose blocks are `block_ids`; `gather` is the backend's."""
    num_new, ctx = q.shape[0], context_len
    start = ctx - num_new  # the chunk's first position
    block_size, num_kv_heads, head_dim = k_cache.shape[1:]
    first_key = 0 if window is None else max(0, start - window + 1)
    if first_key >= start:  # every key the chunk reads is in the chunk itself
        keys, values, key_start = k, v, start
    else:
        first_block = first_key // block_size
        key_start = first_block * block_size
        ids = block_ids[first_block:]
        keys = gather(k_cache, ids, 0).view(-1, num_kv_heads, head_dim)[: ctx - key_start]
        values = gather(v_cache, ids, 1).view(-1, num_kv_heads, head_dim)[: ctx - key_start]
        if kv_scales is not None:
            keys = dequantize_kv(keys, kv_scales[0], q.dtype)
            values = dequantize_kv(values, kv_scales[1], q.dtype)
    out = torch.empty_like(q)
    for lo in range(0, num_new, PREFILL_TILE):
        hi = min(num_new, lo + PREFILL_TILE)
        # keys of the tile: from its first query's window start to its last query
        k_lo = 0 if window is None else max(0, start + lo - window + 1 - key_start)
        k_hi = start + hi - key_start
        q_pos = torch.arange(start + lo, start + hi, device=q.device)[:, None]
        k_pos = torch.arange(key_start + k_lo, key_start + k_hi, device=q.device)[None, :]
        seen = k_pos <= q_pos
        if window is not None:
            seen &= k_pos > q_pos - window
        out[lo:hi] = masked_sdpa(q[lo:hi], keys[k_lo:k_hi], values[k_lo:k_hi], seen, scale, sinks)
    return out


# Queries per tile of a sliding or sink layer's prefill (`prefill`).
PREFILL_TILE = 256


def softmax(scores: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """softmax over the last dim of float32 `scores`; with `sinks` (broadcast to the scores'
    shape less their last dim) each row's sink logit joins the denominator (transformers'
    gpt-oss: the sink as one more column, dropped after the softmax)."""
    if sinks is None:
        return torch.softmax(scores, dim=-1)
    sink = sinks.float().unsqueeze(-1).expand(*scores.shape[:-1], 1)
    return torch.softmax(torch.cat((scores, sink), dim=-1), dim=-1)[..., :-1]


def masked_sdpa(
    q: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    seen: torch.Tensor,
    scale: float,
    sinks: torch.Tensor | None,
) -> torch.Tensor:
    """q [n, q_heads, dim] over keys/values [m, kv_heads, dim] where `seen` [n, m]. Sinks
    ride as one more key: zero key and value, its score the head's sink logit (through a
    float mask), so it adds exp(sink) to the denominator and nothing to the output."""
    mask: torch.Tensor = seen
    if sinks is not None:
        zero = keys.new_zeros(1, *keys.shape[1:])
        keys, values = torch.cat((keys, zero)), torch.cat((values, zero))
        heads = q.shape[1]
        bias = torch.zeros(heads, *seen.shape, dtype=q.dtype, device=q.device)
        bias.masked_fill_(~seen, float("-inf"))
        sink = sinks.to(q.dtype).view(heads, 1, 1).expand(heads, seen.shape[0], 1)
        mask = torch.cat((bias, sink), dim=-1).unsqueeze(0)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1).unsqueeze(0),
        keys.transpose(0, 1).unsqueeze(0),
        values.transpose(0, 1).unsqueeze(0),
        attn_mask=mask,
        scale=scale,
        enable_gqa=True,
    )
    return out.squeeze(0).transpose(0, 1)
