"""The profile steps that size a GPU's KV cache: the two largest steps the scheduler can
produce, run through a small scratch cache, so that the memory peak they leave behind is
the weights plus the largest activations and attention workspaces (`memory.gpu_kv_bytes`);
and `size_kv_cache`, which chooses the cache's size from them (or from the configuration).

Each step's metadata is the kind the model's attention backend reads: TorchAttention's
prefill spans and masked decode groups, or the Triton kernels' `PagedBatch`, so the profile
runs the kernels (and allocates the workspaces) that serving will.
"""

from __future__ import annotations

import torch

from tandem.config import CacheConfig, SchedulerConfig
from tandem.engine.kv_cache import allocate_kv_cache, block_bytes
from tandem.engine.kv_manager import cdiv
from tandem.engine.memory import KVSizing, blocks_for_bytes, gpu_kv_bytes
from tandem.engine.runner import MAX_DECODE_GROUPS, MIN_DECODE_GROUP_ROWS
from tandem.model.attention import AttentionMetadata, DecodeGroup, PagedBatch, PrefillSpan
from tandem.model.linear_attention import Chunk, StateRows
from tandem.model.llama import LlamaModel


def prefill_metadata(
    num_tokens: int, block_size: int, paged: bool, device: torch.device
) -> AttentionMetadata:
    """One request's prefill of `num_tokens` from position 0, over blocks 0, 1, ..."""
    positions = torch.arange(num_tokens, device=device)
    num_blocks = cdiv(num_tokens, block_size)
    meta = AttentionMetadata(
        slot_block_ids=positions // block_size, slot_offsets=positions % block_size
    )
    # An MLA model reads the span with the paged batch too (tandem.model.mla's prefill)
    blocks = torch.arange(num_blocks, device=device)
    meta.prefills.append(PrefillSpan(0, num_tokens, num_tokens, blocks))
    if not paged:
        return meta
    i32 = torch.int32
    meta.paged = PagedBatch(
        num_decode=0,
        decode_block_tables=torch.zeros((0, 1), dtype=i32, device=device),
        decode_context_lens=torch.zeros(0, dtype=i32, device=device),
        prefill_block_tables=torch.arange(num_blocks, dtype=i32, device=device).view(1, -1),
        prefill_query_starts=torch.tensor([0, num_tokens], dtype=i32, device=device),
        prefill_context_lens=torch.tensor([num_tokens], dtype=i32, device=device),
        max_query_len=num_tokens,
        max_decode_context_len=0,
    )
    return meta


def decode_metadata(
    num_rows: int, context_len: int, block_size: int, paged: bool, device: torch.device
) -> AttentionMetadata:
    """`num_rows` decode rows at `context_len` tokens each, every block table entry naming
    block 0: the attention workspaces are sized by the context, not by what it holds."""
    i64, i32 = torch.int64, torch.int32
    meta = AttentionMetadata(
        slot_block_ids=torch.zeros(num_rows, dtype=i64, device=device),
        slot_offsets=torch.zeros(num_rows, dtype=i64, device=device),
    )
    ctx_blocks = cdiv(context_len, block_size)
    if paged:
        meta.paged = PagedBatch(
            num_decode=num_rows,
            decode_block_tables=torch.zeros((num_rows, ctx_blocks), dtype=i32, device=device),
            decode_context_lens=torch.full((num_rows,), context_len, dtype=i32, device=device),
            prefill_block_tables=torch.zeros((0, 1), dtype=i32, device=device),
            prefill_query_starts=torch.zeros(1, dtype=i32, device=device),
            prefill_context_lens=torch.zeros(0, dtype=i32, device=device),
            max_query_len=0,
            max_decode_context_len=context_len,
        )
        return meta
    # The runner's grouping of decode rows (one padded group per run of similar lengths).
    num_groups = max(1, min(MAX_DECODE_GROUPS, num_rows // MIN_DECODE_GROUP_ROWS))
    size = cdiv(num_rows, num_groups)
    for start in range(0, num_rows, size):
        end = min(num_rows, start + size)
        tables = torch.zeros(end - start, ctx_blocks, dtype=i64, device=device)
        lens = torch.full((end - start,), ctx_blocks * block_size, dtype=i64, device=device)
        meta.decode_groups.append(DecodeGroup.build(start, tables, lens, block_size))
    return meta


def profile_steps(
    model: LlamaModel,
    sched: SchedulerConfig,
    block_size: int,
    dtype: torch.dtype,
    max_model_len: int,
    device: torch.device,
) -> int:
    """Run the two largest steps through a scratch KV cache: a prefill of the whole token
    budget, and a decode step of max_num_seqs rows at the full context (every row reads the
    same scratch blocks). Returns the scratch cache's bytes, part of the peak but not of the
    steady state."""
    paged = model.attention.needs_paged_batch
    n = max(1, min(sched.max_num_batched_tokens, max_model_len - 1))
    scratch = allocate_kv_cache(model.config, cdiv(n, block_size), block_size, dtype, device)
    ids = torch.zeros(n, dtype=torch.int64, device=device)
    positions = torch.arange(n, device=device)
    # every KV table over the same scratch blocks: sizes, not contents, matter here
    others = max(model.config.kv_layout.num_tables - 1, 0)
    meta = prefill_metadata(n, block_size, paged, device)
    meta.tables = (meta,) * others
    rows = min(sched.max_num_seqs, sched.max_num_batched_tokens)
    states = model.linear_states  # linear-attention layers: scratch states in slots 0..
    if states is not None:
        states.reserve(rows)
        none = torch.zeros(0, dtype=torch.int64, device=device)
        meta.state_rows = StateRows(none, (Chunk(0, n, 0),))
    model.compute_logits(model.forward(ids, positions, meta, scratch)[-1:])
    meta = decode_metadata(rows, max_model_len, block_size, paged, device)
    meta.tables = (meta,) * others
    if states is not None:
        meta.state_rows = StateRows(torch.arange(rows, device=device), ())
    positions = torch.full((rows,), max_model_len - 1, device=device)
    ids = torch.zeros(rows, dtype=torch.int64, device=device)
    model.compute_logits(model.forward(ids, positions, meta, scratch))
    return scratch.numel() * scratch.element_size()


def size_kv_cache(
    model: LlamaModel,
    cache: CacheConfig,
    sched: SchedulerConfig,
    dtype: torch.dtype,
    max_model_len: int,
    device: torch.device,
) -> KVSizing:
    """Blocks for the KV cache: explicit (`num_blocks`), the CPU byte budget, or on a GPU
    what the memory budget leaves after the weights and the profile steps at full batch."""
    per_block = block_bytes(model.config, cache.block_size, dtype)
    if cache.num_blocks is not None:
        n = cache.num_blocks
        return KVSizing(n, n * cache.block_size, n * per_block, "num_blocks")
    if device.type != "cuda":
        return blocks_for_bytes(cache.kv_cache_bytes, per_block, "kv_cache_bytes", cache.block_size)
    peak, scratch = _profile_peak_bytes(
        model, sched, cache.block_size, dtype, max_model_len, device
    )
    total = torch.cuda.get_device_properties(device).total_memory
    kv_bytes = gpu_kv_bytes(total, cache.gpu_memory_utilization, peak, scratch)
    return blocks_for_bytes(kv_bytes, per_block, "gpu_memory_utilization", cache.block_size)


def _profile_peak_bytes(
    model: LlamaModel,
    sched: SchedulerConfig,
    block_size: int,
    dtype: torch.dtype,
    max_model_len: int,
    device: torch.device,
) -> tuple[int, int]:
    """(peak bytes allocated, scratch KV bytes) over the profile steps on a GPU: the
    weights plus the largest step's activations and attention workspaces."""
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    try:
        scratch_bytes = profile_steps(model, sched, block_size, dtype, max_model_len, device)
    except torch.cuda.OutOfMemoryError:
        raise ValueError(
            f"a step at max_num_batched_tokens={sched.max_num_batched_tokens} or "
            f"max_num_seqs={sched.max_num_seqs} decode rows of {max_model_len} tokens does not "
            f"fit {device}: lower them or max_model_len"
        ) from None
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    torch.cuda.empty_cache()
    return peak, scratch_bytes
