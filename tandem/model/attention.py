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


@dataclass(frozen=True, slots=True)
class DecodeGroup:
    """Decode rows [start, end) of the flat batch, attended together (padded to one length).

    Attributes:
        block_tables: [rows, max_blocks] padded block tables.
        mask: [rows, 1, 1, max_blocks * block_size], True where a key is valid.
    """

    start: int
    end: int
    block_tables: torch.Tensor
    mask: torch.Tensor


@dataclass(slots=True)
class AttentionMetadata:
    """Where this step's tokens go in the cache and what each one attends to.

    Attributes:
        slot_block_ids: [num_tokens] block of each new token's KV slot.
        slot_offsets: [num_tokens] offset inside that block.
        decode_groups: decode rows, which occupy the first flat indices, split into groups
            of similar context length so that padding wastes little work.
        prefills: the prefill chunks, after the decode rows.
    """

    slot_block_ids: torch.Tensor
    slot_offsets: torch.Tensor
    decode_groups: list[DecodeGroup] = field(default_factory=list)
    prefills: list[PrefillSpan] = field(default_factory=list)
    paged: PagedBatch | None = None  # set for backends with `needs_paged_batch`


@dataclass(frozen=True, slots=True)
class PagedBatch:
    """The step as paged-attention kernels take it: one padded int32 block table per kind of
    row, no groups and no masks. Built once per step by the runner (shared by all layers).

    Attributes:
        num_decode: decode rows (the first flat indices, one token each).
        decode_block_tables: [num_decode, max_blocks] int32.
        decode_context_lens: [num_decode] int32, context including the new token.
        prefill_block_tables: [num_prefill, max_blocks] int32.
        prefill_query_starts: [num_prefill + 1] int32, cumulative, relative to num_decode.
        prefill_context_lens: [num_prefill] int32.
        max_query_len: longest prefill chunk (host-side, sizes the kernel grid).
        max_decode_context_len: longest decode context (host-side, sets the decode kernel's
            split count); a CUDA graph's step names the longest any replay may hold.
    """

    num_decode: int
    decode_block_tables: torch.Tensor
    decode_context_lens: torch.Tensor
    prefill_block_tables: torch.Tensor
    prefill_query_starts: torch.Tensor
    prefill_context_lens: torch.Tensor
    max_query_len: int
    max_decode_context_len: int


class AttentionBackend(Protocol):
    # True: the runner also builds `AttentionMetadata.paged` for this backend.
    needs_paged_batch: bool

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

    def warm_up(self, kv_layer: torch.Tensor, num_q_heads: int, max_context_len: int) -> None:
        """Before traffic: compile whatever a step with contexts of up to `max_context_len`
        tokens could need that the warm-up steps may not have hit (e.g. kernel variants)."""
        ...


class TorchAttention:
    """CPU attention with torch ops: gather the context's blocks, then SDPA.

    Gathers go into a reused workspace: a fresh multi-MB tensor per layer costs page faults
    that take ~8x longer than the copy itself.
    """

    needs_paged_batch = False

    def __init__(self) -> None:
        # Allocated on first use, on the cache's device and in its dtype.
        self._workspace: torch.Tensor | None = None

    def warm_up(self, kv_layer: torch.Tensor, num_q_heads: int, max_context_len: int) -> None:
        """Nothing to compile: torch's ops have no variants to build ahead of time."""

    def _gather(self, cache: torch.Tensor, block_ids: torch.Tensor, slot: int) -> torch.Tensor:
        """Copy blocks `block_ids` ([n]) of `cache` ([num_blocks, block_size, heads, dim]).

        Returns [n, block_size, heads, dim], a view of workspace half `slot` (0: K, 1: V).
        """
        row = cache[0].numel()
        n = block_ids.numel()
        ws = self._workspace
        if (
            ws is None
            or ws.numel() < 2 * n * row
            or ws.dtype != cache.dtype
            or ws.device != cache.device
        ):
            ws = torch.empty(2 * n * row, dtype=cache.dtype, device=cache.device)
            self._workspace = ws
        half = ws.numel() // 2
        out = ws[slot * half : slot * half + n * row].view(n, row)
        torch.index_select(cache.flatten(1), 0, block_ids, out=out)
        return out.view(n, *cache.shape[1:])

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
        for group in meta.decode_groups:
            out[group.start : group.end] = self._decode(
                q[group.start : group.end], k_cache, v_cache, group, scale
            )
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

    def _decode(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        group: DecodeGroup,
        scale: float,
    ) -> torch.Tensor:
        tables = group.block_tables
        num_rows, max_blocks = tables.shape
        block_size, num_kv_heads, head_dim = k_cache.shape[1:]
        flat = tables.flatten()
        shape = (num_rows, max_blocks * block_size, num_kv_heads, head_dim)
        keys = self._gather(k_cache, flat, 0).view(shape)
        values = self._gather(v_cache, flat, 1).view(shape)
        # One query per row: two batched matmuls and a softmax beat SDPA's fused CPU kernel,
        # whose per-call set-up dominates at this size. Query heads are grouped by the KV
        # head they share (GQA: q head h reads kv head h // group).
        group_size = q.shape[1] // num_kv_heads
        qg = q.view(num_rows, num_kv_heads, group_size, head_dim)
        scores = torch.matmul(qg, keys.permute(0, 2, 3, 1)).float()  # [rows, kv, g, T]
        scores = scores.mul_(scale).masked_fill_(~group.mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(values.dtype)
        out = torch.matmul(probs, values.transpose(1, 2))  # [rows, kv, g, dim]
        return out.view(num_rows, num_kv_heads * group_size, head_dim)

    def _prefill(
        self,
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
            keys = self._gather(k_cache, span.block_ids, 0).view(-1, num_kv_heads, head_dim)
            values = self._gather(v_cache, span.block_ids, 1).view(-1, num_kv_heads, head_dim)
            keys, values = keys[:ctx], values[:ctx]
            # Query i sits at position ctx - num_new + i and sees keys at positions <= that.
            q_pos = torch.arange(ctx - num_new, ctx, device=q.device).unsqueeze(1)
            mask, causal = torch.arange(ctx, device=q.device).unsqueeze(0) <= q_pos, False
        # A leading batch dimension of 1 lets SDPA pick its fused CPU kernel (3-D inputs
        # take the slow unfused path).
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1).unsqueeze(0),  # [1, q_heads, num_new, dim]
            keys.transpose(0, 1).unsqueeze(0),  # [1, kv_heads, ctx, dim]
            values.transpose(0, 1).unsqueeze(0),
            attn_mask=mask,
            is_causal=causal,
            scale=scale,
            enable_gqa=True,
        )
        return out.squeeze(0).transpose(0, 1)
