"""Multi-head latent attention's two forms on the CPU (issue 43): a decode row's attention over
a paged latent cache in the absorbed form (what decode rows run: W_UK folded into the query,
W_UV after the weighted latents, tandem.model.mla.absorbed_decode) against the expanded form
(what prefill chunks run: the context's latents through kv_b_proj to per-head keys and values,
tandem.model.mla.expanded_prefill, here as one-token chunks), per layer, for DeepSeek-V3's
attention shape (128 heads, kv_lora_rank 512, qk_rope_head_dim 64, qk_nope_head_dim 128,
v_head_dim 128), float32, blocks of 16 tokens. Projections and o_proj are the same in both
forms and left out. Also the cache's bytes per token against expanded per-head K and V.

    .venv/bin/python benchmarks/bench_mla.py [--threads N]

Writes benchmarks/results/mla.json and prints a markdown table (median of 3 runs after one
warm-up).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from tandem.model.attention import DecodeGroup, PrefillSpan
from tandem.model.layer_groups import Mla
from tandem.model.mla import MlaWeights, absorbed_decode, expanded_prefill

RESULTS = Path(__file__).resolve().parent / "results" / "mla.json"
HEADS = 128
CFG = Mla(q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
          v_head_dim=128)  # fmt: skip
BLOCK = 16
CONTEXTS = (512, 2048, 4096)
BATCHES = (1, 4)
SCALE = CFG.qk_head_dim**-0.5


def _median_ms(fn: Callable[[], torch.Tensor], runs: int = 3) -> float:
    fn()
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def measure(w: MlaWeights, ctx: int, batch: int, gen: torch.Generator) -> dict[str, float]:
    """`batch` decode rows of `ctx` tokens each, their blocks scattered over the cache."""
    num_blocks = batch * -(-ctx // BLOCK)
    kv = torch.randn(num_blocks, 2, BLOCK, 1, CFG.cache_head_dim, generator=gen)
    tables = torch.randperm(num_blocks, generator=gen).view(batch, -1)
    q_nope = torch.randn(batch, HEADS, CFG.qk_nope_head_dim, generator=gen)
    q_rot = torch.randn(batch, HEADS, CFG.qk_rope_head_dim, generator=gen)
    group = DecodeGroup.build(0, tables, torch.full((batch,), ctx), BLOCK)
    empty = torch.empty(0)

    def absorbed() -> torch.Tensor:
        return absorbed_decode(q_nope, q_rot, kv, group, w, CFG.kv_lora_rank, SCALE)

    def expanded() -> torch.Tensor:  # each row a one-token chunk over its context
        return torch.cat([
            expanded_prefill(q_nope[r : r + 1], q_rot[r : r + 1], empty, kv,
                             PrefillSpan(r, 1, ctx, tables[r]), w, CFG, SCALE)
            for r in range(batch)
        ])  # fmt: skip

    diff = (absorbed() - expanded()).abs().max().item()
    a_ms, e_ms = _median_ms(absorbed), _median_ms(expanded)
    return dict(context=ctx, batch=batch, absorbed_ms=round(a_ms, 2), expanded_ms=round(e_ms, 2),
                speedup=round(e_ms / a_ms, 1), max_abs_diff=diff)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    lat, nope, v = CFG.kv_lora_rank, CFG.qk_nope_head_dim, CFG.v_head_dim
    kv_b = torch.randn(lat, HEADS * (nope + v), generator=gen) * lat**-0.5
    empty = torch.empty(0)  # the projections are the same in both forms: not measured
    w = MlaWeights.build(CFG, empty, None, None, empty, kv_b, empty)
    rows = [measure(w, ctx, batch, gen) for ctx in CONTEXTS for batch in BATCHES]
    per_token = {
        "latent_bytes_bf16": 61 * CFG.entry_dim * 2,
        "expanded_kv_bytes_bf16": 61 * HEADS * (CFG.qk_head_dim + v) * 2,
    }
    RESULTS.parent.mkdir(exist_ok=True)
    out = dict(threads=args.threads, heads=HEADS, block_size=BLOCK, rows=rows, **per_token)
    RESULTS.write_text(json.dumps(out, indent=2) + "\n")
    print(f"DeepSeek-V3 attention shape, float32, {args.threads} thread(s), one layer")
    print("| context | batch | absorbed ms | expanded ms | expanded / absorbed | max diff |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['context']} | {r['batch']} | {r['absorbed_ms']} | {r['expanded_ms']} | "
              f"{r['speedup']}x | {r['max_abs_diff']:.1e} |")  # fmt: skip
    print(f"cache per token (61 layers, bf16): {per_token['latent_bytes_bf16']:,} B latent vs "
          f"{per_token['expanded_kv_bytes_bf16']:,} B expanded K/V")  # fmt: skip


if __name__ == "__main__":
    main()
