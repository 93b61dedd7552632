"""CPU decode time per token of the hybrid families (issue 42) at 1k and 8k tokens of context,
each against the same checkpoint with every layer full attention (its `layer_types` all
"full_attention"), in the same run, alternating:

    .venv/bin/python benchmarks/bench_hybrid_decode.py [--reps 3] [--threads 2]

Small random configs of each family's shape (transformers' classes, float32): gpt-oss-shaped
(6 layers alternating sliding / full, window 128, sinks, 8 experts top 2) and Gemma-3-shaped
(6 layers, five local ones of window 512 per global one). Batch 1: one prompt of 1k or 8k
tokens is prefilled, then NEW_TOKENS tokens are decoded; the median step is the ITL. A
sliding layer's decode reads only its window's blocks, the full-attention twin every block.
Writes benchmarks/results/hybrid_decode.json and prints a markdown table.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # siblings import by name
from report import RESULTS_DIR, machine_info, machine_summary, result_path, write_json

from tandem.config import CacheConfig, EngineConfig
from tandem.engine.engine import LLMEngine
from tandem.engine.sampling import SamplingParams

SHAPE = dict(
    vocab_size=4096, hidden_size=256, intermediate_size=512, num_hidden_layers=6,
    num_attention_heads=8, num_key_value_heads=2, head_dim=64, max_position_embeddings=16384,
    initializer_range=0.05, eos_token_id=None, bos_token_id=None, pad_token_id=0,
)  # fmt: skip
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "gpt-oss-shaped": ("GptOssConfig", dict(
        num_local_experts=8, num_experts_per_tok=2, sliding_window=128,
        rope_parameters={"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "truncate": False, "rope_theta": 150000.0,
                         "original_max_position_embeddings": 4096},
    )),
    "Gemma-3-shaped": ("Gemma3TextConfig", dict(sliding_window=512, query_pre_attn_scalar=64)),
}  # fmt: skip
CONTEXTS = (1024, 8192)
NEW_TOKENS = 16


def build(cls: str, extra: dict[str, Any], out: Path, all_full: bool) -> Path:
    import transformers

    config = getattr(transformers, cls)(**SHAPE, **extra)
    if all_full:
        config.layer_types = ["full_attention"] * config.num_hidden_layers
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(out)
    return out


def itl_ms(model_dir: Path, context: int) -> float:
    """Median decode step (ms) of one request after a `context`-token prompt."""
    engine = LLMEngine(
        EngineConfig(
            str(model_dir),
            dtype="float32",
            cache=CacheConfig(kv_cache_bytes=512 << 20, enable_prefix_caching=False),
        )
    )
    try:
        g = torch.Generator().manual_seed(context)
        prompt = torch.randint(5, SHAPE["vocab_size"], (context,), generator=g).tolist()
        params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
        engine.add_request(engine.spec(f"r{context}", prompt, params))
        steps: list[float] = []
        decoding = False  # after the step that finished the prompt (its first token)
        while engine.has_unfinished():
            t0 = time.perf_counter()
            outputs = engine.step()
            if decoding:
                steps.append((time.perf_counter() - t0) * 1e3)
            decoding = decoding or any(o.new_token_ids for o in outputs)
        return statistics.median(steps)
    finally:
        engine.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for label, (cls, extra) in FAMILIES.items():
            hybrid = build(cls, extra, Path(tmp) / f"{cls}-hybrid", all_full=False)
            full = build(cls, extra, Path(tmp) / f"{cls}-full", all_full=True)
            for context in CONTEXTS:
                times: dict[str, list[float]] = {"hybrid": [], "full": []}
                for rep in range(args.reps):  # alternating, the order flipped each rep
                    pair = [("hybrid", hybrid), ("full", full)]
                    for name, path in pair if rep % 2 == 0 else pair[::-1]:
                        times[name].append(itl_ms(path, context))
                h, f = statistics.median(times["hybrid"]), statistics.median(times["full"])
                rows.append({"config": label, "context": context, "hybrid_itl_ms": round(h, 2),
                             "all_full_itl_ms": round(f, 2), "ratio": round(h / f, 3)})  # fmt: skip
                print(f"{label} ctx {context}: {h:.2f} ms vs {f:.2f} ms all-full "
                      f"({h / f:.2f}x)", flush=True)  # fmt: skip
    machine = machine_info(threads=args.threads, reps=args.reps, new_tokens=NEW_TOKENS)
    print(f"\n{machine_summary(machine)}\n")
    print("| config | context | ITL ms | all-full ITL ms | ratio |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['config']} | {r['context']} | {r['hybrid_itl_ms']} | "
              f"{r['all_full_itl_ms']} | {r['ratio']} |")  # fmt: skip
    write_json(result_path(RESULTS_DIR, "hybrid_decode"), {"machine": machine, "rows": rows},
               indent=2)  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
