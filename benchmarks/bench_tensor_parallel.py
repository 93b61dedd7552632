"""Tensor parallelism on the CPU (issue 29): one engine of 1 rank vs engines of 2 (exact sums
and Megatron's split; the collectives through shared memory, and exact sums once more over
gloo alone, `tp_shared_memory=False`), same weights, same run, alternating, on the `small` tiny
model and the default model (SmolLM2-135M-Instruct, when converted under
~/.cache/tandem/models).

    .venv/bin/python benchmarks/bench_tensor_parallel.py [--dtype auto] [--reps 3]

- batch-1 decode: a 32-token prompt, 64 greedy tokens; ms per decode step (median of every
  decode step of every rep);
- batch 8: 8 such requests at once, generated tokens per second of wall time;
- whether the greedy tokens agree with one rank's: two ranks run twice, with exact sums
  (o and down split by their outputs, the CPU's default: one rank's logits bit for bit in
  any dtype) and with Megatron's all-reduced partial sums (CUDA's split: float32 agrees to
  1e-5, bfloat16 rounds the sums differently from one full matmul).

Each engine gets the host's threads shared out (tandem.engine.ranks.threads_per_rank: on 2
cores, 2 threads at 1 rank and 1 per rank at 2). Writes
benchmarks/results/tensor_parallel-<dtype>.json and prints a markdown table.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # siblings import by name
from report import RESULTS_DIR, machine_info, machine_summary, result_path, write_json

from tandem.config import CacheConfig, EngineConfig
from tandem.engine.engine import LLMEngine
from tandem.engine.sampling import SamplingParams
from tandem.weights.tiny import make_tiny_model

DEFAULT_MODEL = Path.home() / ".cache" / "tandem" / "models" / "SmolLM2-135M-Instruct"
PROMPT_TOKENS = 32
NEW_TOKENS = 64
BATCH = 8


def decode_step_ms(engine: LLMEngine, prompts: list[list[int]]) -> tuple[list[float], float, list]:
    """Run `prompts` to NEW_TOKENS greedy tokens each. Returns (each decode-only step's ms,
    generated tokens per second over the whole run, each prompt's tokens)."""
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    requests = [
        engine.add_request(engine.spec(f"b{i}-{time.monotonic_ns()}", p, params))
        for i, p in enumerate(prompts)
    ]
    steps: list[float] = []
    t0 = time.perf_counter()
    first = True
    while engine.has_unfinished():
        s0 = time.perf_counter()
        engine.step()
        if not first:  # the first step prefills every prompt
            steps.append((time.perf_counter() - s0) * 1e3)
        first = False
    elapsed = time.perf_counter() - t0
    return steps, len(prompts) * NEW_TOKENS / elapsed, [list(r.output_token_ids) for r in requests]


# (label, ranks, EngineConfig.tp_exact_sums, collectives through shared memory): one rank;
# two with o and down split by their outputs (the CPU's default: exact), the same over gloo
# alone, and two with Megatron's all-reduced partial sums.
VARIANTS = (
    ("tp1", 1, None, True),
    ("tp2", 2, True, True),
    ("tp2_gloo", 2, True, False),
    ("tp2_megatron", 2, False, True),
)


def bench_model(name: str, model_dir: Path, dtype: str, reps: int) -> dict[str, Any]:
    def engine(tp: int, exact: bool | None, shm: bool = True) -> LLMEngine:
        config = EngineConfig(
            str(model_dir),
            dtype=dtype,
            tensor_parallel_size=tp,
            tp_exact_sums=exact,
            tp_shared_memory=shm,
            cache=CacheConfig(kv_cache_bytes=64 << 20),
        )
        built = LLMEngine(config)
        built.warm_up()
        return built

    one = engine(1, None)
    vocab = one.model.config.vocab_size
    prompts = [[(17 * i + 31 * j) % vocab for j in range(PROMPT_TOKENS)] for i in range(BATCH)]
    labels = [label for label, *_ in VARIANTS]
    steps: dict[str, list[float]] = {label: [] for label in labels}
    rates: dict[str, list[float]] = {label: [] for label in labels}
    tokens: dict[str, list] = {}
    # One process holds one tensor-parallel group at a time (torch.distributed's default
    # group): each two-rank variant in turn, alternating with the one rank throughout.
    for label, tp, exact, shm in VARIANTS[1:]:
        two = engine(tp, exact, shm)
        for _ in range(reps):
            for key, e in (("tp1", one), (label, two)):  # alternating: the same load
                s, _, out = decode_step_ms(e, prompts[:1])
                steps[key] += s
                _, rate, batch_out = decode_step_ms(e, prompts)
                rates[key].append(rate)
                tokens[key] = out + batch_out
        two.close()
    one.close()
    agree = {
        label: f"{sum(a == b for a, b in zip(tokens['tp1'], tokens[label], strict=True))} of "
        f"{len(tokens['tp1'])}"
        for label in labels[1:]
    }
    return {
        "model": name,
        "dtype": one.config.resolved_dtype,
        "decode_ms_per_token_b1": {label: statistics.median(s) for label, s in steps.items()},
        "tokens_per_s_b8": {label: statistics.median(r) for label, r in rates.items()},
        "greedy_identical_to_tp1": agree,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL)
    args = ap.parse_args()
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        small = make_tiny_model(Path(tmp) / "small", preset="small")
        results.append(bench_model("tiny preset small (46M)", small, args.dtype, args.reps))
    if (args.model_dir / "config.json").is_file():
        results.append(bench_model(args.model_dir.name, args.model_dir, args.dtype, args.reps))
    info = machine_info(reps=args.reps)
    out = result_path(RESULTS_DIR, "tensor_parallel", f"-{args.dtype}")
    write_json(out, {"machine": info, "results": results}, indent=2)
    print(f"({machine_summary(info)})\n")
    four = "TP=1 / TP=2 / TP=2 gloo only / TP=2 Megatron"
    print(
        f"| model | dtype | batch-1 decode ms/token, {four} | batch-8 tokens/s, {four} | "
        "greedy outputs as TP=1's, TP=2 / gloo only / Megatron |"
    )
    print("|---|---|---|---|---|")
    for r in results:
        ms, tps, same = (
            r["decode_ms_per_token_b1"],
            r["tokens_per_s_b8"],
            r["greedy_identical_to_tp1"],
        )
        labels = [label for label, *_ in VARIANTS]
        print(
            f"| {r['model']} | {r['dtype']} | {' / '.join(f'{ms[k]:.1f}' for k in labels)} | "
            f"{' / '.join(f'{tps[k]:.1f}' for k in labels)} | "
            f"{' / '.join(same[k] for k in labels[1:])} |"
        )


if __name__ == "__main__":
    main()
