"""Mixture of experts on the CPU (issue 30), same run, alternating:

    .venv/bin/python benchmarks/bench_moe.py [--reps 3] [--threads 2]

1. engine: a small random Qwen3-MoE (8 layers, hidden 512, 16 experts, top 2, expert width
   512) vs a dense Qwen3 of the same shape whose MLP is top_k experts wide (1024): the same
   active parameters per token (the router's 8K aside), 8x fewer in total. Batch-1 decode
   (ms per step, median), batch-8 decode (generated tokens/s of wall time) and a 512-token
   prefill (prompt tokens/s), float32;
2. the MoE engine again with its experts computed one expert at a time (transformers' way,
   `tandem.model.moe.looped_experts`) instead of the grouped GEMMs;
3. one layer's experts alone, grouped vs looped, at 1 to 512 tokens (top 2 of 16);
4. the MoE engine at 2 ranks (gloo, one thread each): experts split by columns (TP=2) vs
   whole (EP=2, --expert-parallel), attention TP=2 in both.

Writes benchmarks/results/moe.json and prints markdown tables.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # siblings import by name
from report import RESULTS_DIR, machine_info, machine_summary, result_path, write_json

from tandem.config import CacheConfig, EngineConfig
from tandem.engine.engine import LLMEngine
from tandem.engine.sampling import SamplingParams
from tandem.model import moe

SHAPE = dict(
    vocab_size=8192, hidden_size=512, num_hidden_layers=8, num_attention_heads=8,
    num_key_value_heads=4, head_dim=64, max_position_embeddings=2048, initializer_range=0.05,
    eos_token_id=None, bos_token_id=None, pad_token_id=0,
)  # fmt: skip
NUM_EXPERTS, TOP_K, EXPERT_WIDTH = 16, 2, 512
NEW_TOKENS, BATCH, PREFILL_TOKENS = 32, 8, 512


def build(kind: str, out: Path) -> tuple[Path, int]:
    """A random checkpoint: "moe" (Qwen3-MoE) or "dense" (Qwen3, MLP top_k experts wide)."""
    import transformers

    if kind == "moe":
        config: Any = transformers.Qwen3MoeConfig(
            **SHAPE, intermediate_size=TOP_K * EXPERT_WIDTH, num_experts=NUM_EXPERTS,
            num_experts_per_tok=TOP_K, moe_intermediate_size=EXPERT_WIDTH, norm_topk_prob=True,
        )  # fmt: skip
    else:
        config = transformers.Qwen3Config(**SHAPE, intermediate_size=TOP_K * EXPERT_WIDTH)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    if kind == "moe":
        with torch.no_grad():
            for layer in model.model.layers:
                layer.mlp.gate.weight.normal_(0.0, 0.5)  # spread tokens over the experts
    model.save_pretrained(out)
    return out, sum(p.numel() for p in model.parameters())


def engine_run(model_dir: Path, **overrides: Any) -> dict[str, float]:
    engine = LLMEngine(
        EngineConfig(
            str(model_dir),
            dtype="float32",
            cache=CacheConfig(kv_cache_bytes=256 << 20, enable_prefix_caching=False),
            **overrides,
        )
    )
    try:
        return _timed(engine)
    finally:
        engine.close()


def _timed(engine: LLMEngine) -> dict[str, float]:
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(5, 8192, (32,), generator=g).tolist() for _ in range(BATCH)]

    def decode(batch: list[list[int]]) -> tuple[list[float], float]:
        for i, p in enumerate(batch):
            engine.add_request(engine.spec(f"r{i}-{time.monotonic_ns()}", p, params))
        steps, first, t0 = [], True, time.perf_counter()
        while engine.has_unfinished():
            s0 = time.perf_counter()
            engine.step()
            if not first:
                steps.append((time.perf_counter() - s0) * 1e3)
            first = False
        return steps, len(batch) * NEW_TOKENS / (time.perf_counter() - t0)

    steps, _ = decode(prompts[:1])
    _, batch_tps = decode(prompts)
    long = torch.randint(5, 8192, (PREFILL_TOKENS,), generator=g).tolist()
    t0 = time.perf_counter()
    engine.generate([long], SamplingParams(max_tokens=1, temperature=0.0))
    return {
        "decode_b1_ms_per_step": statistics.median(steps),
        "decode_b8_tokens_per_s": batch_tps,
        "prefill_tokens_per_s": PREFILL_TOKENS / (time.perf_counter() - t0),
    }


def layer_ms(fn: Callable[..., torch.Tensor], num_tokens: int, reps: int) -> float:
    g = torch.Generator().manual_seed(num_tokens)
    h = SHAPE["hidden_size"]
    w = moe.MoeWeights(
        router=torch.randn(h, NUM_EXPERTS, generator=g),
        gate_up=torch.randn(NUM_EXPERTS, h, 2 * EXPERT_WIDTH, generator=g) * 0.05,
        down=torch.randn(NUM_EXPERTS, EXPERT_WIDTH, h, generator=g) * 0.05,
    )
    cfg = moe.MoeConfig(NUM_EXPERTS, TOP_K, EXPERT_WIDTH, moe.Routing.SOFTMAX_TOPK, True, (0,))
    x = torch.randn(num_tokens, h, generator=g)
    routed = moe.route(x, w.router, cfg)
    fn(x, routed, w)
    times = []
    for _ in range(max(reps, 5)):
        t0 = time.perf_counter()
        fn(x, routed, w)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    grouped = moe.grouped_experts
    runs: dict[str, list[dict[str, float]]] = {
        "moe": [], "moe-looped": [], "dense": [], "moe TP=2": [], "moe EP=2": [],
    }  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        moe_dir, moe_params = build("moe", Path(tmp) / "moe")
        dense_dir, dense_params = build("dense", Path(tmp) / "dense")
        for _ in range(args.reps):  # alternating, so drift on a shared box hits all three
            runs["dense"].append(engine_run(dense_dir))
            runs["moe"].append(engine_run(moe_dir))
            moe.grouped_experts = moe.looped_experts  # type: ignore[assignment]
            try:
                runs["moe-looped"].append(engine_run(moe_dir))
            finally:
                moe.grouped_experts = grouped  # type: ignore[assignment]
            for ep in (False, True):
                runs[f"moe {'EP' if ep else 'TP'}=2"].append(
                    engine_run(moe_dir, tensor_parallel_size=2, expert_parallel=ep)
                )
    engine = {k: {m: statistics.median(r[m] for r in v) for m in v[0]} for k, v in runs.items()}
    layer = {
        n: {"grouped_ms": layer_ms(grouped, n, args.reps),
            "looped_ms": layer_ms(moe.looped_experts, n, args.reps)}
        for n in (1, 8, 64, 512)
    }  # fmt: skip
    info = machine_info(reps=args.reps)
    params = {"moe_total": moe_params, "dense_total": dense_params}
    write_json(
        result_path(RESULTS_DIR, "moe"),
        {"machine": info, "params": params, "engine": engine, "layer": layer},
        indent=2,
    )
    print(f"({machine_summary(info)}, {args.threads} threads)\n")
    print(f"parameters: MoE {moe_params / 1e6:.1f}M total, dense {dense_params / 1e6:.1f}M\n")
    print("| model | decode b=1 ms/step | decode b=8 tokens/s | prefill 512 tokens/s |")
    print("|---|---|---|---|")
    for k, v in engine.items():
        print(f"| {k} | {v['decode_b1_ms_per_step']:.2f} | {v['decode_b8_tokens_per_s']:.1f} | "
              f"{v['prefill_tokens_per_s']:.0f} |")  # fmt: skip
    print("\n| tokens | grouped ms | looped ms |\n|---|---|---|")
    for n, v in layer.items():
        print(f"| {n} | {v['grouped_ms']:.3f} | {v['looped_ms']:.3f} |")


if __name__ == "__main__":
    main()
