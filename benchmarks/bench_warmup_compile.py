"""What compiling every oneDNN kernel at warm-up costs (issue 38), measured apart from serving.

    python benchmarks/bench_warmup_compile.py [--model DIR]

A oneDNN worker computes a product of n rows at `onednn_rows(n)` rows: a bounded set of row
counts, one kernel per count and packed matrix shape in oneDNN's cache. Before, a worker
compiled each kernel when a step first needed it, so its memory crept towards the bound for
as long as new batch sizes and prompt lengths kept arriving (the decode worker's 60-minute
soak: 23 -> 39 row counts, +2.0%). `LLMEngine.warm_up` now compiles the whole set
(`LlamaModel.compile_matmuls`). This loads the default model with oneDNN matmuls (float32:
any oneDNN CPU runs it) and the `tandem up` KV cache in a fresh process per variant, and
reads RSS and glibc's heap before and after the compile:

  none           load only (the memory a worker starts from, before any kernel)
  decode rows    compile_matmuls(64, 64): the 64 decode-batch counts of every shape
  all, ascending every count up to the 2048-token budget, smallest first
  all            the same largest first (what warm-up does: each output reuses freed memory)

Results: benchmarks/results/warmup-compile.json; a markdown table on stdout.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # siblings import by name
from report import RESULTS_DIR, machine_info, machine_summary, result_path, write_json

VARIANTS = {
    "none": None,
    "decode rows": (64, 64, False),
    "all, ascending": (2048, 64, True),
    "all": (2048, 64, False),
}
KV_CACHE_BYTES = 360 << 20  # tandem up's choice for this model on this box


def child(model_dir: str, variant: str) -> None:
    """One variant in this (fresh) process: a JSON line of its figures."""
    import torch

    from tandem.config import CacheConfig, EngineConfig
    from tandem.engine.engine import LLMEngine
    from tandem.services.common.observe.memory import heap_stats, resident_bytes

    torch.set_num_threads(1)
    config = EngineConfig(
        model_dir=model_dir,
        dtype="float32",
        cpu_matmul="onednn",
        cache=CacheConfig(kv_cache_bytes=KV_CACHE_BYTES, block_size=16),
    )
    engine = LLMEngine(config)
    model = engine.model

    def memory() -> dict[str, float]:
        heap = heap_stats()
        mib = 1 << 20
        return {
            "rss_mib": resident_bytes() / mib,
            "heap_in_use_mib": heap.in_use_bytes / mib if heap else 0.0,
            "heap_free_mib": heap.free_bytes / mib if heap else 0.0,
        }

    before = memory()
    spec = VARIANTS[variant]
    runs, seconds = 0, 0.0
    if spec is not None:
        max_rows, max_logit_rows, ascending = spec
        t0 = time.perf_counter()
        if ascending:  # the same products, smallest first (the order warm-up does not take)
            from tandem.model.linear import matmul

            for m, bias, counts in model.onednn_products(max_rows, max_logit_rows):
                zeros = torch.zeros(counts[-1], m.shape[1], dtype=m.dtype)
                for rows in counts:
                    matmul(zeros[:rows], m, model.matmul, bias)
                    runs += 1
        else:
            runs = model.compile_matmuls(max_rows, max_logit_rows)
        seconds = time.perf_counter() - t0
    print(json.dumps({"variant": variant, "products": runs, "seconds": seconds,
                      "before": before, "after": memory()}))  # fmt: skip


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2], sys.argv[3])
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="", help="a model directory; default: tandem up's")
    p.add_argument("--results-dir", default=str(RESULTS_DIR))
    args = p.parse_args()
    model_dir = args.model
    if not model_dir:
        from tandem.services.cli.model import ensure_default_model

        model_dir = str(ensure_default_model())
    rows = []
    for variant in VARIANTS:
        out = subprocess.run(
            [sys.executable, __file__, "--child", model_dir, variant],
            check=True, capture_output=True, text=True,
        )  # fmt: skip
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
        print(f"{variant}: {rows[-1]}", file=sys.stderr)
    result = {
        "benchmark": "warm-up oneDNN compile (issue 38)",
        "command": "python benchmarks/bench_warmup_compile.py",
        "machine": machine_info(),
        "model_dir": model_dir,
        "rows": rows,
    }
    write_json(result_path(Path(args.results_dir), "warmup-compile"), result, indent=1)
    print(markdown(result))
    return 0


def markdown(r: dict[str, Any]) -> str:
    lines = [
        f"`{r['command']}` ({machine_summary(r['machine'])}); oneDNN float32, 1 thread, "
        f"KV cache {KV_CACHE_BYTES >> 20} MiB.",
        "",
        "| variant | products | seconds | RSS before -> after (MiB) | heap in use (MiB) | "
        "heap free after (MiB) |",
        "|---|---|---|---|---|---|",
    ]
    for row in r["rows"]:
        b, a = row["before"], row["after"]
        lines.append(
            f"| {row['variant']} | {row['products']} | {row['seconds']:.1f} | "
            f"{b['rss_mib']:,.0f} -> {a['rss_mib']:,.0f} | "
            f"{b['heap_in_use_mib']:,.0f} -> {a['heap_in_use_mib']:,.0f} | "
            f"{a['heap_free_mib']:,.0f} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
