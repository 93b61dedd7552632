"""Part `tiers`: the KV tiers (issue 44, tandem.tiers) on the device.

1. Block copies at the Llama-3-8B shape (a block of 16 tokens x 32 layers x K, V x 8 heads x
   128 x bf16 = 2 MiB): `BlockIO.read` (a pinned D2H copy and its event, what every freed
   block costs the engine thread) and `BlockIO.write` (the H2D copy of an onload), 64
   distinct blocks each, in GB/s, against the device's own copy bandwidth; and the XXH3-128
   verification of a block on the host, in GB/s.
2. An engine with a host tier behind a small device cache: four prompts that evict each
   other, served twice; the repeats must be token-identical to the first round and be served
   from the tier where it pays; figures: the tier's measured onload rate in prompt tokens/s
   against the engine's warm-up prefill rate (whether a host-tier hit beats recomputing on
   this device: where it does not, the engine recomputes, and `tier_pays` says so).

A wrong output fails the part; speeds are figures. With --cpu: tiny shapes (a smoke run).
Not in the default parts: `--parts tiers`.
"""

from __future__ import annotations

import random
import time
from pathlib import Path

import torch

from .common import Context, Figures, PartFailed, copy_bandwidth, free_memory, sync

SMOKE = "smoke: CPU tensors, tiny shapes; times are not speeds"


def _block_copies(ctx: Context) -> Figures:
    from tandem.engine.tiering import BlockIO
    from tandem.tiers import record

    dev, cuda = ctx.device, ctx.cuda
    # [blocks, layers, K/V, tokens, heads, dim]
    shape = (64, 32, 2, 16, 8, 128) if cuda else (64, 2, 2, 4, 2, 16)
    cache = torch.randn(shape, device=dev).to(torch.bfloat16)
    io = BlockIO([(cache, 0)])
    t0 = time.perf_counter()
    copies = [io.read(b) for b in range(shape[0])]
    for _, ready in copies:
        if ready is not None:
            ready()
    read_s = time.perf_counter() - t0
    if not all(torch.equal(p.view(torch.bfloat16).view(shape[1:]).to(dev), cache[b])
               for b, (p, _) in enumerate(copies)):  # fmt: skip
        raise PartFailed("BlockIO.read's copies differ from the cache's blocks")
    target = torch.zeros_like(cache)
    out = BlockIO([(target, 0)])
    sync(dev)
    t0 = time.perf_counter()
    for b, (payload, _) in enumerate(copies):
        out.write(b, payload)
    sync(dev)
    write_s = time.perf_counter() - t0
    if not torch.equal(target, cache):
        raise PartFailed("BlockIO.write did not put the blocks back")
    total = io.nbytes * shape[0]
    view = memoryview(copies[0][0].numpy())  # type: ignore[arg-type]
    ident = record.identity({"gpu-check": 1})
    t0 = time.perf_counter()
    for _ in range(16):
        record.digest(ident, 1, 0, view)
    verify_s = (time.perf_counter() - t0) / 16
    figures: Figures = {
        "block_bytes": io.nbytes,
        "offload_copy_gb_s": round(total / read_s / 1e9, 2),
        "onload_copy_gb_s": round(total / write_s / 1e9, 2),
        "verify_gb_s": round(io.nbytes / verify_s / 1e9, 2),
    }
    if cuda:
        figures["device_copy"] = copy_bandwidth(dev, 1 << 28, ctx.sizes.kn_reps)
    del cache, target, copies
    free_memory(dev)
    return figures


def _engine(ctx: Context, root: Path) -> Figures:
    from tandem.config import CacheConfig, EngineConfig, SchedulerConfig
    from tandem.engine.engine import LLMEngine
    from tandem.engine.prefix_hash import HOST_TIER
    from tandem.engine.sampling import SamplingParams
    from tandem.weights.tiny import make_tiny_model

    cuda = ctx.cuda
    model_dir = make_tiny_model(root / "tiers-model", preset="small" if cuda else "tiny", seed=0)
    length, block = (512, 16) if cuda else (40, 4)
    blocks = 2 * (length // block) + 4  # holds about two of the four prompts
    engine = LLMEngine(
        EngineConfig(
            model_dir=str(model_dir),
            dtype="bfloat16" if cuda else "float32",
            device=ctx.device,
            attention_backend=ctx.attention_backend,
            cache=CacheConfig(
                block_size=block, num_blocks=blocks, kv_host_bytes=1 << 30
            ),  # fmt: skip
            scheduler=SchedulerConfig(max_num_batched_tokens=2048),
        )
    )
    try:
        engine.warm_up()
        rng = random.Random(5)
        prompts = [rng.choices(range(3, 500), k=length) for _ in range(4)]
        params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        first = [engine.generate([p], params)[0] for p in prompts]
        assert engine.tiers is not None
        engine.tiers.tiers.drain()
        t0 = time.perf_counter()
        again = [engine.generate([p], params)[0] for p in prompts]
        repeat_s = time.perf_counter() - t0
        identical = [a.token_ids for a in again] == [f.token_ids for f in first]
        [host] = engine.tier_stats()
        figures: Figures = {
            "identical": identical,
            "hit_tokens": host.hit_tokens,
            "cached_tokens": [a.num_cached_tokens for a in again],
            "host_onload_tokens_per_s": round(engine.tiers.onload_tokens_per_s(HOST_TIER)),
            "prefill_tokens_per_s": round(engine.warmup_prefill_tokens_per_s),
            "repeat_round_s": round(repeat_s, 3),
            "digest_mismatches": host.digest_mismatches,
        }
        figures["tier_pays"] = engine.tiers.pays(HOST_TIER)
        if not identical:
            raise PartFailed(f"outputs after a tier onload differ: {figures}")
        if figures["tier_pays"] and host.hit_tokens == 0:
            raise PartFailed(f"the host tier pays but served nothing: {figures}")
        return figures
    finally:
        engine.close()


def check_tiers(ctx: Context) -> Figures:
    figures: Figures = {"mode": "benchmark" if ctx.cuda else SMOKE}
    figures["block_copies"] = _block_copies(ctx)
    figures["engine"] = _engine(ctx, ctx.tmp_dir)
    return figures
