"""Tensor parallelism in bfloat16 on the CPU (issue 29): how close TP=2 comes to one rank.

    python benchmarks/check_tp_bf16.py [--model-dir DIR] [--max-tokens 48] [--results-dir DIR]

Two parts:
- sums: a row-parallel layer's output (SmolLM2-135M's o and down shapes, rank 1 of 2's input
  rows, 64 random rows, seeded) three ways: one oneDNN bfloat16 GEMM over all rows (what one
  rank computes), each rank's part rounded to bfloat16 and then summed in bfloat16 (the
  double rounding), and each rank's part in float32, summed, rounded once (what
  `tandem.model.llama.LlamaModel` does with TP in bfloat16); the share of outputs equal to
  the one GEMM's. Needs oneDNN with bfloat16 (skipped without).
- engine: 32 chat prompts (16 topics, 2 questions each) at temperature 0 through one engine
  of 1 rank and one of 2 (gloo), bfloat16: how many generations are identical, the mean
  length of their common prefix, and the share of the prefill's logits that are equal.

Writes <results-dir>/tp_bf16.json. Run it in a `git archive` of an older commit to compare.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # siblings import by name
from report import RESULTS_DIR, machine_info, write_json

TOPICS = [
    "the sea", "a paperclip", "photosynthesis", "the moon", "Paris", "prime numbers",
    "a bicycle", "tea", "volcanoes", "the internet", "bees", "chess", "rain", "a library",
    "gravity", "bread",
]  # fmt: skip
QUESTIONS = ["Tell me about {}.", "Write a short poem about {}."]
# SmolLM2-135M at 2 ranks: o's input rows 192 | 384 (1 and 2 KV heads), down's 768 | 768.
SHAPES = {"o": (576, 192), "down": (1536, 768)}


def sums() -> dict[str, Any]:
    from tandem.model.linear import onednn_bf16_available

    if not onednn_bf16_available():
        return {"skipped": "no oneDNN bfloat16 on this CPU"}
    linear = torch.ops.mkldnn._linear_pointwise

    def gemm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        packed = torch.ops.mkldnn._reorder_linear_weight(w.t().contiguous(), 1)
        return linear(x.contiguous(), packed, None, "none", [], "")

    gen = torch.Generator().manual_seed(29)
    out: dict[str, Any] = {}
    for name, (k, split) in SHAPES.items():
        w = (torch.randn(k, 576, generator=gen) * 0.05).bfloat16()
        x = torch.randn(64, k, generator=gen).bfloat16()
        one = gemm(x, w)
        parts = [(x[:, :split], w[:split]), (x[:, split:], w[split:])]
        twice = gemm(*parts[0]) + gemm(*parts[1])
        once = (
            (parts[0][0].float() @ parts[0][1].float())
            + (parts[1][0].float() @ parts[1][1].float())
        ).bfloat16()
        out[name] = {
            "double_rounded_equal": (twice == one).float().mean().item(),
            "float32_sum_equal": (once == one).float().mean().item(),
        }
    return out


def engine(model_dir: Path, max_tokens: int) -> dict[str, Any]:
    from transformers import AutoTokenizer

    from tandem.config import CacheConfig, EngineConfig, SchedulerConfig
    from tandem.engine.engine import LLMEngine
    from tandem.engine.sampling import SamplingParams

    tok = AutoTokenizer.from_pretrained(model_dir)
    prompts: list[list[int]] = [
        tok.apply_chat_template(  # type: ignore[misc]
            [{"role": "user", "content": q.format(t)}],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )  # fmt: skip
        for t in TOPICS
        for q in QUESTIONS
    ]
    outputs, first_rows = [], []
    for tp in (1, 2):
        eng = LLMEngine(
            EngineConfig(
                str(model_dir), dtype="bfloat16", tensor_parallel_size=tp,
                cache=CacheConfig(kv_cache_bytes=256 << 20),
                scheduler=SchedulerConfig(max_num_batched_tokens=512),
            )
        )  # fmt: skip
        rows: dict[tuple[int, ...], torch.Tensor] = {}
        inner = eng.runner.sampler

        def record(
            logits: torch.Tensor, batch: list[Any], rows: dict = rows, inner: Any = inner
        ) -> Any:
            for i, row in enumerate(batch):
                if not row.output_token_ids:
                    rows[tuple(row.prompt_token_ids)] = logits[i].clone()
            return inner(logits, batch)

        eng.runner.sampler = record  # type: ignore[assignment]
        done = eng.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0))
        eng.close()
        outputs.append([d.token_ids for d in done])
        first_rows.append(rows)

    def common(a: list[int], b: list[int]) -> int:
        return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), len(a))

    prefixes = [common(a, b) for a, b in zip(*outputs, strict=True)]
    equal = [(first_rows[0][k] == first_rows[1][k]).float().mean() for k in first_rows[0]]
    return {
        "prompts": len(prompts),
        "max_tokens": max_tokens,
        "identical": sum(a == b for a, b in zip(*outputs, strict=True)),
        "mean_common_prefix_tokens": sum(prefixes) / len(prefixes),
        "prefill_logits_equal": torch.stack(equal).mean().item(),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model-dir", type=Path, default=None)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    args = ap.parse_args()
    from bench_vllm_cpu import default_model_dir

    model_dir = args.model_dir or default_model_dir()
    result = {"sums": sums(), "engine": engine(model_dir, args.max_tokens)}
    print(result)
    write_json(
        args.results_dir / "tp_bf16.json",
        {
            "command": "python benchmarks/check_tp_bf16.py " + " ".join(sys.argv[1:]),
            "machine": machine_info(model_dir=str(model_dir)),
            **result,
        },
        indent=1,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
