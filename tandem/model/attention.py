"""Paged attention: the seam between the model and the attention kernels.

The model calls `AttentionBackend.forward` once per layer with the step's new q/k/v. The
backend writes the new k/v into the paged cache and attends over each request's context.
`TorchAttention` is the CPU path (plain torch ops); the Triton kernels of `kernels/` plug in
behind the same interface for CUDA.

Token layout of one step (built by the runner): decode rows first, then prefill chunks.

    flat tokens:  [d0 d1 ... d(B-1) | p0 p0 p0 p0 | p1 p1 ...]
                   one token each     chunk of request p0, ...
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F


@dataclass(frozen=True, slots=True)
class PrefillSpan:
    """One request's prefill chunk inside the flat token batch.

    Attributes:
        token_start: index of the chunk's first token in the flat batch.
        num_new_tokens: tokens in the chunk.
        context_len: tokens the chunk attends to (cached prefix + earlier chunks + itself).
        block_ids: [num_context_blocks] int64, the request's blocks covering the context.
    """

    token_start: int
    num_new_tokens: int
    context_len: int
    block_ids: torch.Tensor


@dataclass(slots=True)
class AttentionMetadata:
    """Where this step's tokens go in the cache and what each one attends to.

    Attributes:
        slot_block_ids: [num_tokens] block of each new token's KV slot.
        slot_offsets: [num_tokens] offset inside that block.
        num_decode_tokens: decode rows occupy flat indices [0, num_decode_tokens).
        decode_block_tables: [num_decode, max_blocks] padded block tables of the decode rows.
        decode_context_lens: [num_decode] tokens each decode row attends to.
        decode_mask: [num_decode, 1, 1, max_blocks * block_size], True where a key is valid.
        prefills: the prefill chunks, after the decode rows.
    """

    slot_block_ids: torch.Tensor
    slot_offsets: torch.Tensor
    num_decode_tokens: int = 0
    decode_block_tables: torch.Tensor | None = None
    decode_context_lens: torch.Tensor | None = None
    decode_mask: torch.Tensor | None = None
    prefills: list[PrefillSpan] = field(default_factory=list)


class AttentionBackend(Protocol):
    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_layer: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        """Store k/v in the cache and attend.

        Args:
            q: [num_tokens, num_q_heads, head_dim]
            k, v: [num_tokens, num_kv_heads, head_dim]
            kv_layer: [num_blocks, 2, block_size, num_kv_heads, head_dim], this layer's cache.
            meta: the step's metadata (shared by all layers).
            scale: softmax scale.

        Returns:
            [num_tokens, num_q_heads, head_dim]
        """
        ...


class TorchAttention:
    """CPU attention with torch ops: gather the context's blocks, then SDPA."""

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_layer: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        k_cache = kv_layer[:, 0]  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache = kv_layer[:, 1]
        k_cache[meta.slot_block_ids, meta.slot_offsets] = k
        v_cache[meta.slot_block_ids, meta.slot_offsets] = v
        out = torch.empty_like(q)
        num_dec = meta.num_decode_tokens
        if num_dec:
            out[:num_dec] = self._decode(q[:num_dec], k_cache, v_cache, meta, scale)
        for span in meta.prefills:
            end = span.token_start + span.num_new_tokens
            out[span.token_start : end] = self._prefill(
                q[span.token_start : end],
                k[span.token_start : end],
                v[span.token_start : end],
                k_cache,
                v_cache,
                span,
                scale,
            )
        return out

    @staticmethod
    def _decode(
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        assert meta.decode_block_tables is not None and meta.decode_mask is not None
        tables = meta.decode_block_tables
        num_rows, max_blocks = tables.shape
        block_size, num_kv_heads, head_dim = k_cache.shape[1:]
        # The gather copies each row's blocks into one contiguous [T, heads, dim] run.
        keys = k_cache[tables].view(num_rows, max_blocks * block_size, num_kv_heads, head_dim)
        values = v_cache[tables].view(num_rows, max_blocks * block_size, num_kv_heads, head_dim)
        out = F.scaled_dot_product_attention(
            q.unsqueeze(2),  # [rows, q_heads, 1, dim]
            keys.transpose(1, 2),  # [rows, kv_heads, T, dim]
            values.transpose(1, 2),
            attn_mask=meta.decode_mask,
            scale=scale,
            enable_gqa=True,
        )
        return out.squeeze(2)

    @staticmethod
    def _prefill(
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        span: PrefillSpan,
        scale: float,
    ) -> torch.Tensor:
        num_new, ctx = span.num_new_tokens, span.context_len
        if ctx == num_new:
            # Nothing cached before this chunk: attend over the chunk itself, causally.
            keys, values, mask, causal = k, v, None, True
        else:
            num_kv_heads, head_dim = k_cache.shape[2:]
            keys = k_cache[span.block_ids].view(-1, num_kv_heads, head_dim)[:ctx]
            values = v_cache[span.block_ids].view(-1, num_kv_heads, head_dim)[:ctx]
            # Query i sits at position ctx - num_new + i and sees keys at positions <= that.
            q_pos = torch.arange(ctx - num_new, ctx).unsqueeze(1)
            mask, causal = torch.arange(ctx).unsqueeze(0) <= q_pos, False
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1),  # [q_heads, num_new, dim]
            keys.transpose(0, 1),  # [kv_heads, ctx, dim]
            values.transpose(0, 1),
            attn_mask=mask,
            is_causal=causal,
            scale=scale,
            enable_gqa=True,
        )
        return out.transpose(0, 1)
