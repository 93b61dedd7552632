"""Should dtype "auto" pick bfloat16 on a CPU? Engine throughput in float32 vs bfloat16 on
the same model, workload and thread count, alternating rounds (this machine is shared and
its speed drifts), and how far bf16's greedy tokens stray from fp32's.

    .venv/bin/python benchmarks/bench_dtype.py [--rounds 3] [--threads 2]

Writes benchmarks/results/dtype.json; prints a markdown table.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # siblings import by name
from report import RESULTS_DIR, machine_info, result_path, write_json

from tandem.config import CacheConfig, EngineConfig, SchedulerConfig
from tandem.engine.engine import LLMEngine
from tandem.engine.sampling import SamplingParams
from tandem.weights.tiny import make_tiny_model

RESULT_JSON = result_path(RESULTS_DIR, "dtype")


def workload(seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, 2000) for _ in range(rng.randrange(32, 256))] for _ in range(16)]


def run(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> tuple[float, list]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    out = engine.generate(prompts, params)
    return sum(len(c.token_ids) for c in out) / (time.perf_counter() - t0), out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=32)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    model_dir = make_tiny_model(Path(tempfile.mkdtemp()) / "small", "small")
    engines = {
        dtype: LLMEngine(
            EngineConfig(
                str(model_dir),
                dtype=dtype,
                cache=CacheConfig(kv_cache_bytes=512 << 20),
                scheduler=SchedulerConfig(max_num_seqs=16),
            )
        )
        for dtype in ("float32", "bfloat16")
    }
    prompts = workload()
    run(engines["float32"], prompts[:2], 2)  # first-call set-up out of the timings
    run(engines["bfloat16"], prompts[:2], 2)
    tps: dict[str, list[float]] = {"float32": [], "bfloat16": []}
    outputs = {}
    for r in range(args.rounds):
        order = ("float32", "bfloat16") if r % 2 == 0 else ("bfloat16", "float32")
        for dtype in order:
            rate, outputs[dtype] = run(engines[dtype], prompts, args.max_tokens)
            tps[dtype].append(rate)
            print(f"round {r} {dtype}: {rate:.1f} output tokens/s", file=sys.stderr, flush=True)
    same = sum(
        a.token_ids == b.token_ids
        for a, b in zip(outputs["float32"], outputs["bfloat16"], strict=True)
    )
    ratios = [b / f for f, b in zip(tps["float32"], tps["bfloat16"], strict=True)]
    report = {
        "machine": machine_info(threads=args.threads),
        "tokens_per_s": tps,
        "bf16_over_fp32": ratios,
        "bf16_over_fp32_median": statistics.median(ratios),
        "identical_greedy_outputs": f"{same}/{len(prompts)}",
    }
    write_json(RESULT_JSON, report, indent=1)
    print("| dtype | output tokens/s per round | bf16 / fp32 (median) | identical greedy |")
    print("|---|---|---|---|")
    for dtype in ("float32", "bfloat16"):
        rates = ", ".join(f"{x:.1f}" for x in tps[dtype])
        ratio = f"{statistics.median(ratios):.2f}" if dtype == "bfloat16" else ""
        print(f"| {dtype} | {rates} | {ratio} | {same}/{len(prompts)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
