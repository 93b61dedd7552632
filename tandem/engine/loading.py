"""What every rank of an engine builds the same way: its model (or its shard of it) and its
KV cache, sized (on a GPU, after the profile steps) and allocated. Rank 0 (`LLMEngine`) and
the other ranks of a tensor-parallel worker (`tandem.engine.ranks`) both call
`load_model_and_cache`, so their collectives happen in the same order.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time
from pathlib import Path
from typing import NamedTuple

import torch

from tandem.config import EngineConfig, EngineRole
from tandem.engine.kv_cache import allocate_kv_cache, block_bytes, map_kv_file, shared_kv_path
from tandem.engine.memory import blocks_needed, fit_context
from tandem.engine.profile import size_kv_cache
from tandem.model.config import ModelConfig
from tandem.model.llama import LlamaModel
from tandem.model.triton_attention import make_attention
from tandem.parallel.group import TPGroup
from tandem.parallel.sharding import Shard, check_shardable, kv_heads
from tandem.quant.kv import FP8_DTYPE, KVScales, kv_format, load_kv_scales
from tandem.weights.loader import DTYPES, ProgressFn, load_model

log = logging.getLogger(__name__)


class LoadedModel(NamedTuple):
    model: LlamaModel  # this rank's shard (its config: its heads; tandem.parallel.sharding)
    kv_cache: torch.Tensor  # [num_blocks (+1 with graphs), layers, 2, block, kv_heads, dim]
    kv_scales: KVScales | None  # an FP8 cache's scales
    kv_format: str  # what the registry advertises (dtype, scaled or not)
    num_blocks: int  # the pool's blocks (a graph's scratch block is not one)
    max_model_len: int  # the context the cache can honour
    graphs_wanted: bool  # warm-up captures decode CUDA graphs
    # Rank 0 of a tensor-parallel worker on a CPU: every rank's cache (rank 0's first) and
    # the first model KV head it holds, mapped here (`kv_share`); empty otherwise.
    rank_kv: tuple[tuple[torch.Tensor, int], ...] = ()


def wants_decode_graphs(config: EngineConfig, paged_backend: bool) -> bool:
    """Whether warm-up captures CUDA graphs of decode steps: on CUDA, with a backend whose
    launch grids depend only on shapes (`paged_backend`), unless the role never decodes (a
    prefill worker hands each request off after its first token). With tensor parallelism
    too: every rank captures the same graphs, the NCCL collectives inside
    (tandem.engine.ranks). The same answer on every rank (the same config)."""
    return (
        config.cuda_graphs
        and paged_backend
        and torch.device(config.device).type == "cuda"
        and config.role != EngineRole.PREFILL
    )


def shard_for(config: EngineConfig, rank: int) -> Shard:
    """Rank `rank`'s place in the engine's tensor-parallel group, with its split options."""
    return Shard(
        rank,
        config.tensor_parallel_size,
        expert_parallel=config.expert_parallel,
        replicate_attention=config.replicate_attention,
        exact_sums=(
            torch.device(config.device).type == "cpu"
            if config.tp_exact_sums is None
            else config.tp_exact_sums
        ),
    )


def check_tensor_parallel(model: ModelConfig, config: EngineConfig) -> None:
    """Raise ValueError unless `config.tensor_parallel_size` ranks can serve `model`."""
    check_shardable(model, config.tensor_parallel_size)


def compile_matmuls(model: LlamaModel, config: EngineConfig) -> None:
    """Compile the model's oneDNN kernels for every step this config can run
    (`LlamaModel.compile_matmuls`): on every rank, at warm-up, before traffic."""
    sched = config.scheduler
    t0 = time.perf_counter()
    runs = model.compile_matmuls(sched.max_step_rows, sched.max_num_seqs)
    if runs:
        log.info(
            "compiled oneDNN matmul kernels for %d row counts (%d products) in %.1fs",
            len(model.onednn_row_counts), runs, time.perf_counter() - t0,
        )  # fmt: skip


def load_model_and_cache(
    config: EngineConfig,
    tp: TPGroup | None = None,
    progress: ProgressFn | None = None,
    kv_share: str = "",
) -> LoadedModel:
    """Load the model (this rank's shard with `tp`), then size and allocate its KV cache.
    With `tp` every rank holds the same number of blocks: the fewest any rank can afford
    (each sizes against its own device). With `kv_share` (a path prefix, the same on every
    rank) and `tp` on a CPU, each rank's cache lives in a shared file that rank 0 maps too
    (`LoadedModel.rank_kv`: its transport hands off every rank's heads), then unlinks.

    Raises:
        ValueError: see `load_model`, `size_kv_cache` and `fit_context`.
    """
    model_dir = Path(config.model_dir)
    sched_cfg = config.scheduler
    mla = ModelConfig.from_dir(model_dir).features.mla
    if mla is not None and config.kv_cache_dtype == "fp8":
        raise ValueError(
            "kv_cache_dtype fp8: multi-head latent attention (DeepSeek-V3) keeps its latent "
            "cache in the model's dtype for now"
        )
    model = load_model(
        model_dir,
        config.resolved_dtype,
        config.device,
        attention=make_attention(config.attention_backend, config.device, mla),
        progress=progress,
        quantization=config.quantization,
        quantization_group_size=config.quantization_group_size,
        tp=tp,
        cpu_matmul=config.cpu_matmul,
    )
    mcfg = model.config
    if model.linear_states is not None:  # before the KV cache is sized around them
        model.linear_states.reserve(sched_cfg.max_num_seqs)
        # as many prefix-cache checkpoints as requests (tandem.engine.state_checkpoints)
        assert model.linear_checkpoints is not None
        if config.cache.enable_prefix_caching:
            model.linear_checkpoints.reserve(sched_cfg.max_num_seqs)
        log.info(
            "linear-attention state: %d slots + %d prefix-cache checkpoints x %.2f MiB",
            model.linear_states.num_slots, model.linear_checkpoints.num_slots,
            model.linear_states.slot_bytes() / 2**20,
        )  # fmt: skip
    max_model_len = min(
        sched_cfg.max_model_len or mcfg.max_position_embeddings, mcfg.max_position_embeddings
    )
    dtype = DTYPES[config.resolved_dtype]
    # FP8 KV (tandem.quant.kv): the backend quantizes on write with these scales.
    kv_scales: KVScales | None = None
    if config.kv_cache_dtype == "fp8":
        kv_scales = load_kv_scales(model_dir, mcfg.kv_layers)
        kv_scales = kv_scales.arranged(mcfg.kv_layers, mcfg.kv_layout.cache_layers())
        model.attention.use_fp8_kv(kv_scales, dtype)
        log.info("FP8 KV cache, scales from the %s", kv_scales.source)
    kv_dtype = FP8_DTYPE if kv_scales is not None else dtype
    fmt = kv_format(str(kv_dtype).removeprefix("torch."), kv_scales)
    block_size = config.cache.block_size
    device = torch.device(config.device)
    sizing = size_kv_cache(model, config.cache, sched_cfg, kv_dtype, max_model_len, device)
    num_blocks = sizing.num_blocks
    if tp is not None and tp.size > 1:
        num_blocks = tp.min_int(num_blocks, "cpu" if device.type == "cpu" else config.device)
    per_block = block_bytes(mcfg, block_size, kv_dtype)
    explicit = sched_cfg.max_model_len is not None
    layout, chunk = mcfg.kv_layout, sched_cfg.max_num_batched_tokens
    context = fit_context(max_model_len, explicit, num_blocks, block_size, per_block, layout, chunk)
    log.info(
        "KV cache (%s): %d blocks x %d tokens = %d tokens, %.1f MiB %s on %s; context %d",
        sizing.source, num_blocks, block_size, num_blocks * block_size,
        num_blocks * per_block / 2**20, fmt, config.device, context,
    )  # fmt: skip
    if context < max_model_len:
        need = blocks_needed(max_model_len, block_size, layout, chunk) * per_block
        log.warning(
            "the model's context of %d tokens does not fit the KV cache: serving at most "
            "%d tokens per request (give the cache %d bytes for the full context)",
            max_model_len, context, need,
        )  # fmt: skip
    # A CUDA graph's padding rows write one scratch block outside the pool's range.
    # linear-attention layers (Qwen3-Next) step their states by host-side slot lists; MLA
    # layers (DeepSeek-V3) are not captured yet (their prefill spans are host-side too)
    linear = model.linear_states is not None or mla is not None
    graphs = wants_decode_graphs(config, model.attention.needs_paged_batch) and not linear
    if kv_share and tp is not None and tp.size > 1 and device.type == "cpu":
        full = ModelConfig.from_dir(model_dir)
        blocks = num_blocks + int(graphs)  # the graphs' scratch block too, as below
        rank_kv = _share_kv_caches(full, tp, kv_share, blocks, block_size, kv_dtype)
        kv_cache = rank_kv[0][0]
        rank_kv = rank_kv if tp.rank == 0 else ()
    else:
        rank_kv = ()
        kv_cache = allocate_kv_cache(mcfg, num_blocks + int(graphs), block_size, kv_dtype, device)
    return LoadedModel(model, kv_cache, kv_scales, fmt, num_blocks, context, graphs, rank_kv)


def _share_kv_caches(
    full: ModelConfig,
    tp: TPGroup,
    prefix: str,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
) -> tuple[tuple[torch.Tensor, int], ...]:
    """Each rank makes its cache in its own shared file; after every rank has (a barrier),
    rank 0 maps them all and unlinks the files (the mappings keep the memory). Returns
    (cache, first KV head) per rank on rank 0; on another rank only its own."""

    def shape(rank: int) -> tuple[int, ...]:
        heads = len(kv_heads(full, dataclasses.replace(tp.shard, rank=rank)))
        return (num_blocks, full.kv_layout.slots, 2, block_size, heads, full.head_dim)

    def first_head(rank: int) -> int:
        return kv_heads(full, dataclasses.replace(tp.shard, rank=rank)).start

    own = map_kv_file(shared_kv_path(prefix, tp.rank), shape(tp.rank), dtype, create=True)
    tp.min_int(0, "cpu")  # every rank's file exists
    if tp.rank != 0:
        return ((own, first_head(tp.rank)),)
    caches = [(own, 0)]
    try:
        for rank in range(1, tp.size):
            path = shared_kv_path(prefix, rank)
            caches.append((map_kv_file(path, shape(rank), dtype, create=False), first_head(rank)))
    finally:
        for rank in range(tp.size):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(shared_kv_path(prefix, rank))
    return tuple(caches)
