"""What made the prefill worker's memory grow (issue 38), measured apart from serving.

    python benchmarks/bench_memory.py [--products N] [--max-rows R] [--dtype auto|float32|bfloat16]

A prefill worker multiplies its weight matrices by activations of as many rows as its step
has tokens, and under mixed traffic that count is different almost every step. With oneDNN's
prepacked matmuls (the CPU bfloat16 default where AVX512-BF16 or AMX runs it, and
`--cpu-matmul onednn`) each distinct row count is a new primitive: a kernel compiled and kept
in oneDNN's primitive cache (1,024 entries by default). This runs SmolLM2-135M's four layer
matrix shapes over N products of random row counts in 1..R, each variant in a fresh process,
and reads the process's RSS and glibc's heap (in use, free) as it goes:

  exact              today's rule before issue 38: every row count as it comes
  exact, cache 0     the same with ONEDNN_PRIMITIVE_CACHE_CAPACITY=0 (the issue's ruled-out lead)
  exact, trim        the same with malloc_trim(0) every 20 products
  rounded            `tandem.model.linear.onednn_rows` (what `matmul` does now)

Results: benchmarks/results/memory[-<dtype>].json and .png (RSS and free heap against the
products run); a markdown summary on stdout. Seconds are reported for the exact and rounded
variants side by side as a ratio (the same machine in the same run).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # siblings import by name
from report import RESULTS_DIR, machine_info, machine_summary, pyplot, result_path, write_json

SHAPES = [(576, 576 * 3), (576, 576), (576, 3072), (1536, 576)]  # SmolLM2: qkv, o, gate_up, down
VARIANTS = {
    "exact": ({}, False, False),
    "exact, cache 0": ({"ONEDNN_PRIMITIVE_CACHE_CAPACITY": "0"}, False, False),
    "exact, trim": ({}, False, True),
    "rounded": ({}, True, False),
}


def child(dtype: str, products: int, max_rows: int, rounded: bool, trim: bool) -> None:
    """One variant in this (fresh) process: JSON lines of (products, rss, in use, free)."""
    import random

    import torch

    from tandem.model.linear import MatmulKind, matmul, onednn_rows, pack
    from tandem.services.common.observe.memory import heap_stats, resident_bytes

    torch.set_num_threads(1)
    dt = getattr(torch, dtype)
    g = torch.Generator().manual_seed(0)
    weights = [pack(torch.randn(k, n, generator=g).to(dt), MatmulKind.ONEDNN) for k, n in SHAPES]
    libc = None
    if trim:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
    rng = random.Random(0)
    t0 = time.perf_counter()
    for i in range(1, products + 1):
        n = rng.randint(1, max_rows)
        for (k, _), w in zip(SHAPES, weights, strict=True):
            x = torch.randn(n, k, dtype=dt)
            if rounded:
                matmul(x, w, MatmulKind.ONEDNN)
            else:  # the call before issue 38: the row count as it comes
                torch.ops.mkldnn._linear_pointwise(x, w, None, "none", [], "")
        if libc is not None and i % 20 == 0:
            libc.malloc_trim(0)
        if i % 50 == 0 or i == products:
            heap = heap_stats()
            print(json.dumps({
                "products": i, "rss": resident_bytes(), "seconds": time.perf_counter() - t0,
                "in_use": heap.in_use_bytes if heap else None,
                "free": heap.free_bytes if heap else None,
                "row_counts": len({onednn_rows(m) for m in range(1, max_rows + 1)})
                if rounded else max_rows,
            }), flush=True)  # fmt: skip


def run_variant(name: str, args: argparse.Namespace, dtype: str) -> list[dict[str, Any]]:
    env_extra, rounded, trim = VARIANTS[name]
    cmd = [
        sys.executable, __file__, "--child", dtype, str(args.products), str(args.max_rows),
        str(int(rounded)), str(int(trim)),
    ]  # fmt: skip
    print(f"{name}: {args.products} products ...", file=sys.stderr, flush=True)
    proc = subprocess.run(
        cmd, env={**os.environ, **env_extra}, capture_output=True, text=True, check=True
    )
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        _, _, dtype, products, max_rows, rounded, trim = sys.argv
        child(dtype, int(products), int(max_rows), rounded == "1", trim == "1")
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--products", type=int, default=1400)
    p.add_argument("--max-rows", type=int, default=1200)
    p.add_argument("--dtype", default="auto", help="auto: bfloat16 where oneDNN runs it")
    p.add_argument("--results-dir", default=str(RESULTS_DIR))
    args = p.parse_args()
    from tandem.model.linear import onednn_bf16_available

    dtype = args.dtype
    if dtype == "auto":
        dtype = "bfloat16" if onednn_bf16_available() else "float32"
    series = {name: run_variant(name, args, dtype) for name in VARIANTS}
    result = {
        "command": "python " + " ".join(["benchmarks/bench_memory.py", *sys.argv[1:]]),
        "machine": machine_info(),
        "dtype": dtype,
        "products": args.products,
        "max_rows": args.max_rows,
        "series": series,
    }
    out = Path(args.results_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = "memory" if args.dtype == "auto" else f"memory-{dtype}"
    write_json(result_path(out, stem), result, indent=1)
    plot(result, result_path(out, stem, ext="png"))
    print(markdown(result, stem))
    return 0


def markdown(r: dict[str, Any], stem: str) -> str:
    mib = 2**20
    lines = [
        f"`{r['command']}` ({machine_summary(r['machine'], shared=True)}); oneDNN {r['dtype']}, "
        f"SmolLM2-135M's 4 matrix shapes, {r['products']} products of 1-{r['max_rows']} rows "
        f"each; results `benchmarks/results/{stem}.json`.",
        "",
        "| variant | RSS after 200 products (MiB) | RSS at the end (MiB) | heap in use / free at "
        "the end (MiB) | seconds |",
        "|---|---|---|---|---|",
    ]
    for name, pts in r["series"].items():
        early = next((x for x in pts if x["products"] >= 200), pts[0])
        last = pts[-1]
        in_use = "-" if last["in_use"] is None else f"{last['in_use'] / mib:.0f}"
        free = "-" if last["free"] is None else f"{last['free'] / mib:.0f}"
        lines.append(
            f"| {name} | {early['rss'] / mib:.0f} | {last['rss'] / mib:.0f} | {in_use} / {free} "
            f"| {last['seconds']:.1f} |"
        )
    exact, rounded = r["series"]["exact"][-1], r["series"]["rounded"][-1]
    lines += ["", f"rounded / exact time: {rounded['seconds'] / exact['seconds']:.2f}"]
    return "\n".join(lines)


def plot(r: dict[str, Any], path: Path) -> bool:
    plt = pyplot()
    if plt is None:
        return False

    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, pts in r["series"].items():
        xs = [x["products"] for x in pts]
        a.plot(xs, [x["rss"] / 2**20 for x in pts], ".-", label=name)
        if pts[0]["free"] is not None:
            b.plot(xs, [x["free"] / 2**20 for x in pts], ".-", label=name)
    a.set_title("RSS (MiB)")
    b.set_title("glibc heap: free but held (MiB)")
    for ax in (a, b):
        ax.set_xlabel(f"products of random row counts (1-{r['max_rows']}), 4 matrix shapes")
        ax.legend(fontsize=8)
    fig.suptitle(f"oneDNN {r['dtype']} products: row counts as they come vs rounded")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return True


if __name__ == "__main__":
    sys.exit(main())
