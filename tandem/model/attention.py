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

import ctypes
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F

from tandem.kernels import cpu_ops
from tandem.model import windowed
from tandem.model.linear_attention import StateRows
from tandem.quant.kv import KVScales, dequantize_kv, layer_index, quantize_kv

# Up to this many KV heads, CPU decode attention multiplies block-diagonal queries (one
# contiguous batched matmul per product; measured 1.5-1.8x faster than per-head products at
# SmolLM2's 3 KV heads, 1 and 16 rows of 300 keys, BENCHMARKS.md issue 24). Above it the
# zeros' wasted FLOPs grow with the head count, and per-head products are used.
BLOCK_DIAGONAL_MAX_KV_HEADS = 4


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

    @staticmethod
    def build(
        rows: Sequence[tuple[int, int, Sequence[int]]],
        token_start: int,
        block_size: int,
        device: torch.device,
    ) -> list[PrefillSpan]:
        """Spans of prefill rows (first new position, new tokens, the row's blocks), laid
        out from flat index `token_start` in order."""
        spans = []
        for start, num_new, blocks in rows:
            ctx = start + num_new
            ids = torch.tensor(blocks[: -(-ctx // block_size)], dtype=torch.int64, device=device)
            spans.append(PrefillSpan(token_start, num_new, ctx, ids))
            token_start += num_new
        return spans


@dataclass(frozen=True, slots=True)
class DecodeGroup:
    """Decode rows [start, end) of the flat batch, attended together (padded to one length).

    Attributes:
        block_tables: [rows, max_blocks] padded block tables (padding: any valid block id).
        key_bias: [rows, 1, max_blocks * block_size] float32, added to the scores: 0 where a
            key is in the row's context, -inf past it. Built once per step, read by every
            layer.
        context_lens: [rows] int64, each row's context including its new token (what the
            native kernel reads instead of the padding and bias); None: torch ops only.
    """

    start: int
    end: int
    block_tables: torch.Tensor
    key_bias: torch.Tensor
    context_lens: torch.Tensor | None = None
    # window -> (tables, bias) over only the blocks that window reads (`windowed`)
    _windows: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(
        default_factory=dict, compare=False, repr=False
    )

    @staticmethod
    def build(
        start: int, block_tables: torch.Tensor, context_lens: torch.Tensor, block_size: int
    ) -> DecodeGroup:
        """The group of rows [start, start + len(block_tables)); `context_lens`: [rows]."""
        key_pos = torch.arange(block_tables.shape[1] * block_size, device=block_tables.device)
        past = key_pos[None, :] >= context_lens[:, None]  # [rows, keys]
        bias = torch.zeros(past.shape, dtype=torch.float32, device=block_tables.device)
        bias.masked_fill_(past, float("-inf"))
        end = start + block_tables.shape[0]
        return DecodeGroup(start, end, block_tables, bias.unsqueeze(1), context_lens)

    def windowed(self, window: int, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(block tables, key bias) of a sliding layer with `window`: each row's table starts
        at the block holding its window's first key and is at most cdiv(window, block_size)
        + 1 blocks wide, the bias -inf outside [context - window, context). Built once per
        step and window (every sliding layer of the step shares it)."""
        if window in self._windows:
            return self._windows[window]
        tables = self.block_tables
        rows, max_blocks = tables.shape
        lens = self.context_lens
        if lens is None:
            lens = (self.key_bias[:, 0] == 0).sum(-1)
        first_key = (lens - window).clamp(min=0)
        width = min(max_blocks, -(-window // block_size) + 1)
        idx = (first_key // block_size)[:, None] + torch.arange(width, device=tables.device)
        windowed = tables.gather(1, idx.clamp(max=max_blocks - 1))
        offsets = torch.arange(block_size, device=tables.device)
        key_pos = (idx[:, :, None] * block_size + offsets).flatten(1)  # [rows, width * bs]
        outside = (key_pos < first_key[:, None]) | (key_pos >= lens[:, None])
        bias = torch.zeros(outside.shape, dtype=torch.float32, device=tables.device)
        bias.masked_fill_(outside, float("-inf"))
        self._windows[window] = (windowed, bias.unsqueeze(1))
        return self._windows[window]


@dataclass(slots=True)
class AttentionMetadata:
    """Where this step's tokens go in the cache and what each one attends to.

    Attributes:
        slot_block_ids: [num_tokens] block of each new token's KV slot.
        slot_offsets: [num_tokens] offset inside that block.
        decode_groups: decode rows, which occupy the first flat indices, split into groups
            of similar context length so that padding wastes little work.
        prefills: the prefill chunks, after the decode rows.
        kv_offset: table * slots of the KV table this metadata's blocks are (tandem.model.
            layer_groups.KVLayout): added to a layer's slot it indexes per-layer data.
        tables: with several KV tables, the metadata of tables 1, 2, ... (this is table 0's).
    """

    slot_block_ids: torch.Tensor
    slot_offsets: torch.Tensor
    decode_groups: list[DecodeGroup] = field(default_factory=list)
    prefills: list[PrefillSpan] = field(default_factory=list)
    paged: PagedBatch | None = None  # set for backends with `needs_paged_batch`
    # each request's linear-attention state slot (Qwen3-Next; None for other models)
    state_rows: StateRows | None = None
    kv_offset: int = 0
    tables: tuple[AttentionMetadata, ...] = ()

    def table(self, index: int) -> AttentionMetadata:
        """The metadata of KV table `index` (the same step, that table's blocks)."""
        return self if index == 0 else self.tables[index - 1]


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
        window: int | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Store k/v in the cache and attend.

        Args:
            q: [num_tokens, num_q_heads, head_dim]
            k, v: [num_tokens, num_kv_heads, head_dim]
            kv_layer: [num_blocks, 2, block_size, num_kv_heads, head_dim], this layer's cache.
            meta: the step's metadata for the layer's KV table (shared by its layers).
            scale: softmax scale.
            window: a sliding layer's window: a query at position p attends to keys at
                (p - window, p] only. None: all keys up to p.
            sinks: [num_q_heads] float32 learned sink logits (gpt-oss): exp(sink) joins each
                head's softmax denominator, attached to no value.

        Returns:
            [num_tokens, num_q_heads, head_dim]
        """
        ...

    def use_fp8_kv(self, scales: KVScales, dtype: torch.dtype) -> None:
        """The cache is float8_e4m3fn with `scales` (tandem.quant.kv): quantize K/V on
        write, dequantize to the model's `dtype` on read. Called before the first step."""
        ...

    def warm_up(self, kv_layer: torch.Tensor, num_q_heads: int, max_context_len: int) -> None:
        """Before traffic: compile whatever a step with contexts of up to `max_context_len`
        tokens could need that the warm-up steps may not have hit (e.g. kernel variants)."""
        ...


class TorchAttention:
    """CPU attention with torch ops: gather the context's blocks, then SDPA; decode rows
    through `decode_kernel` (tandem.kernels.cpu_ops: paged, reading blocks in place) when
    one is given and takes the cache.

    Gathers go into a reused workspace: a fresh multi-MB tensor per layer costs page faults
    that take ~8x longer than the copy itself.
    """

    needs_paged_batch = False

    def __init__(self, decode_kernel: ctypes.CDLL | None = None) -> None:
        self.decode_kernel = decode_kernel
        # Allocated on first use, on the cache's device and in its dtype.
        self._workspace: torch.Tensor | None = None
        # Set by the engine for an FP8 cache (tandem.quant.kv): K/V are quantized on
        # write and dequantized after each gather.
        self.kv_scales: KVScales | None = None

    def use_fp8_kv(self, scales: KVScales, dtype: torch.dtype) -> None:
        """The cache is float8_e4m3fn with `scales`; reads dequantize to q's dtype."""
        self.kv_scales = scales

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
        window: int | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        k_cache = kv_layer[:, 0]  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache = kv_layer[:, 1]
        kv_scales: tuple[float, float] | None = None
        if self.kv_scales is not None:
            layer = meta.kv_offset + layer_index(kv_layer)
            kv_scales = (self.kv_scales.k[layer], self.kv_scales.v[layer])
            k8, v8 = quantize_kv(k, kv_scales[0]), quantize_kv(v, kv_scales[1])
            k_cache[meta.slot_block_ids, meta.slot_offsets] = k8
            v_cache[meta.slot_block_ids, meta.slot_offsets] = v8
            # A chunk attends over its own K/V as the cache holds them, so that its output
            # does not depend on whether a prefix came from the cache or was just computed.
            k = dequantize_kv(k8, kv_scales[0], q.dtype)
            v = dequantize_kv(v8, kv_scales[1], q.dtype)
        else:
            k_cache[meta.slot_block_ids, meta.slot_offsets] = k
            v_cache[meta.slot_block_ids, meta.slot_offsets] = v
        out = torch.empty_like(q)
        for group in meta.decode_groups:
            rows = out[group.start : group.end]
            result = self._decode(
                q[group.start : group.end], k_cache, v_cache, group, scale, kv_scales, rows,
                window, sinks,
            )  # fmt: skip
            if result is not rows:  # the torch ops made their own tensor
                rows.copy_(result)
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
                kv_scales,
                window,
                sinks,
            )
        return out

    def _decode(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        group: DecodeGroup,
        scale: float,
        kv_scales: tuple[float, float] | None = None,
        out: torch.Tensor | None = None,
        window: int | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The group's attention output; the native kernel writes it into `out` (the
        layer's output rows) when given, the torch ops return their own tensor. A sliding
        layer reads only its window's blocks (`DecodeGroup.windowed`)."""
        lib = self.decode_kernel
        if lib is not None and group.context_lens is not None and cpu_ops.supports(q, k_cache):
            return cpu_ops.decode_attention(
                lib, q, k_cache, v_cache, group.block_tables, group.context_lens, scale,
                out=out, window=window, sinks=sinks,
            )  # fmt: skip
        block_size, num_kv_heads, head_dim = k_cache.shape[1:]
        tables, bias = group.block_tables, group.key_bias
        if window is not None:
            tables, bias = group.windowed(window, block_size)
        num_rows, max_blocks = tables.shape
        flat = tables.flatten()
        num_keys = max_blocks * block_size
        # Gathered as stored: [rows, keys, kv_heads * head_dim], each row one contiguous matrix.
        keys = self._gather(k_cache, flat, 0).view(num_rows, num_keys, num_kv_heads * head_dim)
        values = self._gather(v_cache, flat, 1).view(num_rows, num_keys, num_kv_heads * head_dim)
        if kv_scales is not None:
            keys = dequantize_kv(keys, kv_scales[0], q.dtype)
            values = dequantize_kv(values, kv_scales[1], q.dtype)
        group_size = q.shape[1] // num_kv_heads
        if num_kv_heads > BLOCK_DIAGONAL_MAX_KV_HEADS:
            return self._decode_per_head(q, keys, values, bias, scale, num_kv_heads, sinks)
        # One query per row. The keys stay in their stored order, so that both products are
        # single contiguous batched matmuls (a head-major view would be copied once more by
        # matmul): the queries become a block-diagonal matrix, each query head's row holding
        # its values only in the columns of the KV head it reads (GQA: q head h reads kv head
        # h // group_size), zeros elsewhere. The zeros cost num_kv_heads x the (tiny) FLOPs
        # and add exact zeros, so every score is the per-head product's sum, in the order the
        # CPU's GEMM sums it (bit for bit on an Intel Xeon; the last float32 bit on AMD EPYC).
        #   q_blocks[r, kv, g, kv', :] = q[r, kv * group_size + g, :] if kv == kv' else 0
        q_blocks = q.new_zeros(num_rows, num_kv_heads, group_size, num_kv_heads, head_dim)
        q_blocks.diagonal(dim1=1, dim2=3).copy_(
            q.view(num_rows, num_kv_heads, group_size, head_dim).permute(0, 2, 3, 1)
        )
        q_rows = q_blocks.view(num_rows, num_kv_heads * group_size, num_kv_heads * head_dim)
        scores = torch.bmm(q_rows, keys.transpose(1, 2)).float()  # [rows, q_heads, keys]
        scores = scores.mul_(scale).add_(bias)
        probs = windowed.softmax(scores, sinks).to(values.dtype)
        # Every query head against every KV head's values; keep the diagonal blocks.
        out = torch.bmm(probs, values)  # [rows, q_heads, kv_heads * head_dim]
        out = out.view(num_rows, num_kv_heads, group_size, num_kv_heads, head_dim)
        out = out.diagonal(dim1=1, dim2=3)  # [rows, group_size, head_dim, kv_heads]
        return out.permute(0, 3, 1, 2).reshape(num_rows, num_kv_heads * group_size, head_dim)

    def _decode_per_head(
        self,
        q: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        bias: torch.Tensor,
        scale: float,
        num_kv_heads: int,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Many KV heads: the block-diagonal queries would waste num_kv_heads x the FLOPs, so
        products per KV head over head-major views (matmul copies them)."""
        num_rows, num_keys, _ = keys.shape
        head_dim = q.shape[-1]
        group_size = q.shape[1] // num_kv_heads
        qg = q.view(num_rows, num_kv_heads, group_size, head_dim)
        k4 = keys.view(num_rows, num_keys, num_kv_heads, head_dim)
        v4 = values.view(num_rows, num_keys, num_kv_heads, head_dim)
        scores = torch.matmul(qg, k4.permute(0, 2, 3, 1)).float()  # [rows, kv, g, keys]
        scores = scores.mul_(scale).add_(bias.unsqueeze(1))
        heads = None if sinks is None else sinks.view(num_kv_heads, group_size)
        probs = windowed.softmax(scores, heads).to(values.dtype)
        out = torch.matmul(probs, v4.transpose(1, 2))  # [rows, kv, g, dim]
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
        kv_scales: tuple[float, float] | None = None,
        window: int | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        num_new, ctx = span.num_new_tokens, span.context_len
        if window is not None or sinks is not None:
            return windowed.prefill(
                q, k, v, k_cache, v_cache, ctx, span.block_ids, scale, kv_scales, window, sinks,
                self._gather,
            )  # fmt: skip
        if ctx == num_new:
            # Nothing cached before this chunk: attend over the chunk itself, causally.
            keys, values, mask, causal = k, v, None, True
        else:
            num_kv_heads, head_dim = k_cache.shape[2:]
            keys = self._gather(k_cache, span.block_ids, 0).view(-1, num_kv_heads, head_dim)
            values = self._gather(v_cache, span.block_ids, 1).view(-1, num_kv_heads, head_dim)
            keys, values = keys[:ctx], values[:ctx]
            if kv_scales is not None:
                keys = dequantize_kv(keys, kv_scales[0], q.dtype)
                values = dequantize_kv(values, kv_scales[1], q.dtype)
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
