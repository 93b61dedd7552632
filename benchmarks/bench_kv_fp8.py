"""What the FP8 KV cache costs in accuracy (issue 28): SmolLM2-135M with its KV cache in the
model's dtype vs in fp8 (e4m3, per-layer scales 1.0: the model ships none), same weights,
same run, and what it saves in memory.

    .venv/bin/python benchmarks/bench_kv_fp8.py [--model-dir DIR] [--tokens 51200]

- Perplexity over the first `--tokens` tokens of Python's own `pydoc_data/topics.py` (the
  English help texts of the standard library, ~200k tokens), in windows of `--window`
  tokens, each prefilled in chunks of `--chunk`: every chunk after the first attends to the
  earlier chunks through the cache, as serving does, so an fp8 cache is read for most of
  each window's tokens.
- Greedy agreement: `--prompts` prompts of 128 tokens from the same text, 64-token greedy
  continuations with each cache: the fraction identical and the first divergence.
- The largest |K| and |V| the text produces per layer (in the model-dtype cache): how much of
  e4m3's range (448) a scale of 1 uses.
- KV tokens per GiB for SmolLM2 and the Llama-3-8B shape.

Writes benchmarks/results/kv_fp8.json; prints markdown tables.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # siblings import by name
from report import RESULTS_DIR, machine_info, result_path, write_json

from tandem.config import CacheConfig, EngineConfig, SchedulerConfig
from tandem.engine.engine import LLMEngine
from tandem.engine.kv_cache import block_bytes
from tandem.engine.sampling import SamplingParams
from tandem.model.attention import AttentionMetadata, PrefillSpan
from tandem.model.config import ModelConfig
from tandem.quant.kv import FP8_DTYPE, KVScales

RESULT_JSON = result_path(RESULTS_DIR, "kv_fp8")
DEFAULT_MODEL = Path.home() / ".cache" / "tandem" / "models" / "SmolLM2-135M-Instruct"
BLOCK_SIZE = 16
CONTINUATION = 64
LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"], "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
    "vocab_size": 128256,
}  # fmt: skip


def text_tokens(engine: LLMEngine, num_tokens: int) -> list[int]:
    """At least `num_tokens` tokens of pydoc_data/topics.py's help texts, in the module's
    order (tokenized a topic at a time, until there are enough)."""
    from pydoc_data.topics import topics

    assert engine.tokenizer is not None
    out: list[int] = []
    for body in topics.values():
        out += engine.tokenizer.encode(body + "\n\n", add_special_tokens=False)
        if len(out) > num_tokens + 128:
            break
    return out


def make_engine(model_dir: Path, dtype: str, kv_cache_dtype: str, window: int) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            str(model_dir),
            dtype=dtype,
            kv_cache_dtype=kv_cache_dtype,
            attention_backend="torch",
            cache=CacheConfig(block_size=BLOCK_SIZE, num_blocks=max(256, window // BLOCK_SIZE)),
            scheduler=SchedulerConfig(max_num_seqs=32, max_num_batched_tokens=4096),
        )
    )


@torch.inference_mode()
def window_nll(engine: LLMEngine, ids: list[int], chunk: int) -> list[float]:
    """-log p(ids[i] | ids[:i]) for i >= 1 of one window, prefilled chunk by chunk through
    blocks 0, 1, ... of the engine's cache (the engine is otherwise idle)."""
    model, out = engine.model, []
    tokens = torch.tensor(ids)
    for start in range(0, len(ids), chunk):
        end = min(start + chunk, len(ids))
        positions = torch.arange(start, end)
        meta = AttentionMetadata(positions // BLOCK_SIZE, positions % BLOCK_SIZE)
        blocks = torch.arange(-(-end // BLOCK_SIZE))
        meta.prefills.append(PrefillSpan(0, end - start, end, blocks))
        hidden = model.forward(tokens[start:end], positions, meta, engine.kv_cache)
        logp = torch.log_softmax(model.compute_logits(hidden).float(), dim=-1)
        targets = tokens[start + 1 : end + 1]
        out += (-logp[: len(targets)].gather(1, targets[:, None]).squeeze(1)).tolist()
    return out


def kv_amax(engine: LLMEngine, num_tokens: int) -> tuple[list[float], list[float]]:
    """Per layer, the largest |K| and |V| in the cache's first `num_tokens` slots."""
    blocks = engine.kv_cache[: -(-num_tokens // BLOCK_SIZE)].float()  # [n, layers, 2, ...]
    amax = blocks.abs().amax(dim=(0, 3, 4, 5))  # [layers, 2]
    return amax[:, 0].tolist(), amax[:, 1].tolist()


def pow2_scale(amax: float) -> float:
    """The least power of two s with amax / s <= 448 (e4m3's largest finite value)."""
    return 2.0 ** math.ceil(math.log2(max(amax, 1e-6) / 448.0))


def tokens_per_gib(model: ModelConfig, dtype: torch.dtype) -> int:
    return (1 << 30) // block_bytes(model, BLOCK_SIZE, dtype) * BLOCK_SIZE


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL)
    ap.add_argument("--dtype", default="auto", help="model dtype (auto: bfloat16 if native)")
    ap.add_argument("--tokens", type=int, default=51200, help="perplexity text, >= 50k")
    ap.add_argument("--window", type=int, default=1024)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--threads", type=int, default=0, help="torch threads; 0: torch's default")
    ap.add_argument(
        "--pow2-scales",
        action="store_true",
        help="also an fp8 cache with per-layer power-of-two scales >= amax / 448 from the "
        "bfloat16 pass (what a calibrated checkpoint's k_scale/v_scale would give)",
    )
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    engines = {
        kv: make_engine(args.model_dir, args.dtype, kv, args.window) for kv in ("auto", "fp8")
    }
    model_dtype = engines["auto"].config.resolved_dtype
    text = text_tokens(engines["auto"], args.tokens)
    assert len(text) > args.tokens, (len(text), args.tokens)
    n = args.tokens - args.tokens % args.window
    ppl: dict[str, float] = {}
    nll: dict[str, list[float]] = {}
    seconds: dict[str, float] = {}
    amax: tuple[list[float], list[float]] = ([], [])
    kinds = ["auto", "fp8"] + (["fp8-pow2"] if args.pow2_scales else [])
    for kv in kinds:
        if kv == "fp8-pow2":
            engines[kv] = make_engine(args.model_dir, args.dtype, "fp8", args.window)
            scales = KVScales(*(tuple(pow2_scale(a) for a in m) for m in amax), "calibrated")
            engines[kv].kv_scales = scales
            engines[kv].model.attention.use_fp8_kv(scales, getattr(torch, model_dtype))
        engine = engines[kv]
        t0 = time.perf_counter()
        nll[kv] = []
        for start in range(0, n, args.window):
            nll[kv] += window_nll(engine, text[start : start + args.window], args.chunk)
            if kv == "auto":
                k, v = kv_amax(engine, args.window)
                amax = (
                    [max(a, b) for a, b in zip(amax[0], k, strict=False)] or k,
                    [max(a, b) for a, b in zip(amax[1], v, strict=False)] or v,
                )
        seconds[kv] = time.perf_counter() - t0
        ppl[kv] = math.exp(statistics.fmean(nll[kv]))
        print(f"{kv}: ppl {ppl[kv]:.4f} over {len(nll[kv])} tokens ({seconds[kv]:.0f} s)")
    # Greedy continuations of prompts drawn from the text.
    rng = random.Random(28)
    prompts = [text[s : s + 128] for s in (rng.randrange(0, len(text) - 128) for _ in range(64))]
    prompts = prompts[: args.prompts]
    greedy = SamplingParams(max_tokens=CONTINUATION, temperature=0.0, ignore_eos=True)
    outs = {kv: [c.token_ids for c in e.generate(prompts, greedy)] for kv, e in engines.items()}
    divergence: dict[str, list[int]] = {}
    for kv in kinds[1:]:
        divergence[kv] = []
        for a, b in zip(outs["auto"], outs[kv], strict=True):
            first = next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)
            if first is not None:
                divergence[kv].append(first)
    diverged = divergence["fp8"]
    identical = 1 - len(diverged) / len(prompts)
    smol = engines["auto"].model.config
    llama = ModelConfig.from_hf(LLAMA3_8B)
    model_torch = getattr(torch, model_dtype)
    memory = {
        name: {
            "model_dtype": tokens_per_gib(cfg, model_torch),
            "bfloat16": tokens_per_gib(cfg, torch.bfloat16),
            "fp8": tokens_per_gib(cfg, FP8_DTYPE),
        }
        for name, cfg in (("SmolLM2-135M", smol), ("Llama-3-8B shape", llama))
    }
    delta = 100 * (ppl["fp8"] / ppl["auto"] - 1)
    result = {
        "machine": machine_info(),
        "model_dir": str(args.model_dir),
        "model_dtype": model_dtype,
        "text": "pydoc_data/topics.py (CPython standard library)",
        "ppl_tokens": len(nll["auto"]),
        "window": args.window,
        "chunk": args.chunk,
        "ppl": ppl,
        "ppl_delta_pct": delta,
        "seconds": seconds,
        "greedy": {
            "prompts": len(prompts),
            "identical_fraction": identical,
            "first_divergence": sorted(diverged),
        },
        "kv_amax": {"k": amax[0], "v": amax[1]},
        "kv_tokens_per_gib": memory,
        "kv_scales": engines["fp8"].kv_scales.source if engines["fp8"].kv_scales else None,
    }
    if args.pow2_scales:
        pow2 = engines["fp8-pow2"].kv_scales
        assert pow2 is not None
        result["pow2"] = {
            "ppl": ppl["fp8-pow2"],
            "ppl_delta_pct": 100 * (ppl["fp8-pow2"] / ppl["auto"] - 1),
            "identical_fraction": 1 - len(divergence["fp8-pow2"]) / len(prompts),
            "first_divergence": sorted(divergence["fp8-pow2"]),
            "k_scales": pow2.k,
            "v_scales": pow2.v,
        }
        print(json.dumps(result["pow2"]))
    write_json(RESULT_JSON, result, indent=1)
    print()
    print(f"| KV cache | perplexity ({len(nll['auto'])} tokens) | vs {model_dtype} cache |")
    print("|---|---|---|")
    print(f"| {model_dtype} (auto) | {ppl['auto']:.4f} | - |")
    print(f"| fp8 e4m3, scales 1.0 | {ppl['fp8']:.4f} | {delta:+.3f}% |")
    print()
    mean_div = statistics.fmean(diverged) if diverged else float("nan")
    print(
        f"greedy 64-token continuations identical: {identical:.0%} of {len(prompts)} "
        f"(first divergence: mean {mean_div:.1f}, min {min(diverged, default=0)})"
    )
    print(f"largest |K| per layer: {max(amax[0]):.1f}, |V|: {max(amax[1]):.1f} (e4m3 max 448)")
    print()
    print("| model | KV tokens/GiB bf16 | fp8 | ratio |")
    print("|---|---|---|---|")
    for name, m in memory.items():
        print(f"| {name} | {m['bfloat16']} | {m['fp8']} | {m['fp8'] / m['bfloat16']:.1f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
