"""`scripts/gpu-check`: its arguments, each selected part run under its time budget (guarded:
a failing part is recorded and the others still run), and the report.

Output: timestamped progress on stdout, `<out>/gpu-check.log` (the same, plus tracebacks and
worker log tails), `<out>/gpu-check.json` (environment, and per part: status ok / failed /
skipped, reason, duration, figures), rewritten after every part. Exit status 1 if a part
failed.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path

import torch

from .common import (
    STAMP,
    Context,
    Figures,
    Log,
    LogHandler,
    PartFailed,
    PartSkipped,
    environment,
    free_memory,
    make_tmp_dir,
    tree_stamp,
)
from .e2e_bench import check_e2e
from .hybrid_bench import check_hybrid
from .kernels_bench import check_kernels, use_interpreter
from .mla_bench import check_mla
from .moe_bench import check_moe
from .nixl_pull import check_nixl
from .parity import check_parity
from .preflight import check_preflight
from .quant_bench import check_quant
from .serve import check_serve
from .sizes import CPU_SIZES, CUDA_SIZES
from .startup import check_startup
from .throughput import check_throughput
from .tiers_bench import check_tiers
from .tiles_sweep import check_tiles

DESCRIPTION = "The GPU check: what only a GPU can tell about the engine, as one prepared script."
PARTS = (
    "preflight",
    "startup",
    "parity",
    "throughput",
    "kernels",
    "e2e",
    "quant",
    "moe",
    "nixl",
    "serve",
    "tiles",
    "hybrid",
    "mla",
    "tiers",
)
# One command of <= 8 minutes on an H200 (`timeout 470`; budgets in sizes.CUDA_SIZES): what
# issue 40 measures. parity and tiles (done: the engine matches transformers, the tiles are
# chosen), nixl and serve (they need the site archive carried), hybrid (issue 42's kernels),
# mla (issue 43's kernel) and tiers (issue 44's copies and onload rate) run when named.
DEFAULT_PARTS = ("preflight", "startup", "throughput", "kernels", "e2e", "quant", "moe")
JSON_NAME, LOG_NAME = "gpu-check.json", "gpu-check.log"
PART_FNS: dict[str, Callable[[Context], Figures]] = {
    "preflight": check_preflight,
    "startup": check_startup,
    "parity": check_parity,
    "throughput": check_throughput,
    "kernels": check_kernels,
    "e2e": check_e2e,
    "quant": check_quant,
    "moe": check_moe,
    "nixl": check_nixl,
    "serve": check_serve,
    "tiles": check_tiles,
    "hybrid": check_hybrid,
    "mla": check_mla,
    "tiers": check_tiers,
}


def run_part(name: str, ctx: Context) -> Figures:
    """Run one part under its budget; never raises."""
    budget = ctx.sizes.budget_s.get(name, 300.0)
    ctx.deadline = time.monotonic() + budget
    ctx.log(f"== {name} (budget {budget:.0f} s)")
    t0 = time.perf_counter()
    record: Figures = {"status": "ok", "reason": None, "budget_s": budget, "figures": {}}
    try:
        record["figures"] = PART_FNS[name](ctx)
    except PartSkipped as exc:
        record.update(status="skipped", reason=str(exc))
    except PartFailed as exc:
        record.update(status="failed", reason=str(exc), figures=exc.figures)
    except Exception as exc:
        ctx.log(traceback.format_exc().rstrip())
        record.update(status="failed", reason=f"{type(exc).__name__}: {exc}")
    finally:
        free_memory(ctx.device)
    record["duration_s"] = round(time.perf_counter() - t0, 2)
    if record["duration_s"] > budget:
        ctx.log(f"{name}: over its budget ({record['duration_s']:.0f} s > {budget:.0f} s)")
    reason = f": {record['reason']}" if record["reason"] else ""
    ctx.log(f"== {name}: {record['status']} in {record['duration_s']:.1f} s{reason}")
    return record


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="scripts/gpu-check", description=DESCRIPTION)
    parser.add_argument("--cpu", action="store_true", help="device cpu, tiny sizes (CI)")
    parser.add_argument(
        "--parts",
        default=",".join(DEFAULT_PARTS),
        help=f"comma-separated subset of {','.join(PARTS)}, or all (default: "
        f"{','.join(DEFAULT_PARTS)})",
    )
    parser.add_argument(
        "--stamp",
        action="store_true",
        help=f"write the tree's commit and digest to {STAMP.name} (before copying the tree "
        "to a machine without its .git) and exit",
    )
    parser.add_argument(
        "--out", type=Path, default=None, help="output dir (default: $OUT, else ./gpu-check-out)"
    )
    args = parser.parse_args(argv)
    args.parts = list(PARTS) if args.parts == "all" else [p for p in args.parts.split(",") if p]
    unknown = [p for p in args.parts if p not in PARTS]
    if unknown or not args.parts:
        parser.error(f"--parts must name some of {', '.join(PARTS)}; got {args.parts}")
    if args.out is None:
        args.out = Path(os.environ.get("OUT") or "gpu-check-out")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.stamp:
        stamp = tree_stamp()
        STAMP.write_text(json.dumps(stamp, indent=1) + "\n")
        print(f"{STAMP}: {stamp['git_commit']}, dirty {stamp['git_dirty']}, tree "
              f"{stamp['tree_sha256'][:16]} ({len(stamp['files'])} files)")  # fmt: skip
        return 0
    if args.cpu:
        # Before anything imports Triton (environment() does, for its version): the kernels
        # part runs them on CPU tensors through the interpreter.
        use_interpreter()
    sizes = CPU_SIZES if args.cpu else CUDA_SIZES
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / LOG_NAME).unlink(missing_ok=True)
    log = Log(args.out / LOG_NAME)
    # The library's warnings always; its INFO lines (weight loading, KV cache size) only
    # where they are figures (throughput), not for every tiny parity engine.
    library_log = logging.getLogger("tandem")
    library_log.setLevel(logging.WARNING)
    library_log.addHandler(LogHandler(log))
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if args.cpu:
        # One intra-op thread: a 2-thread OpenMP pool on a loaded 2-core CI machine was seen
        # to hang in a tiny matmul (tests/conftest.py), and tiny sizes gain nothing from more.
        torch.set_num_threads(1)
    started = time.perf_counter()
    report: Figures = {
        "mode": sizes.device,
        "command": " ".join(["scripts/gpu-check", *(sys.argv[1:] if argv is None else argv)]),
        "started_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "environment": environment(sizes.device),
        "sizes": dataclasses.asdict(sizes),
        "parts": {},
    }
    log(f"gpu-check: mode {sizes.device}, parts {','.join(args.parts)}, out {args.out}")
    env = report["environment"]
    log(
        f"torch {env['torch']} (cuda {env['torch_cuda']}), transformers {env['transformers']}, "
        f"triton {env['triton']}, nixl {env['nixl']}, device {env['device_name']}"
    )

    def write() -> None:
        report["duration_s"] = round(time.perf_counter() - started, 2)
        statuses = [p["status"] for p in report["parts"].values()]
        report["ok"] = "failed" not in statuses
        (args.out / JSON_NAME).write_text(json.dumps(report, indent=2, default=str) + "\n")

    with make_tmp_dir() as tmp:
        ctx = Context(sizes=sizes, log=log, tmp_dir=tmp, parts=tuple(args.parts))
        for name in PARTS:
            if name not in args.parts:
                report["parts"][name] = {"status": "skipped", "reason": "not selected (--parts)"}
            elif not args.cpu and not torch.cuda.is_available():
                reason = "CUDA is not available (use --cpu for the CPU smoke run)"
                report["parts"][name] = {"status": "failed", "reason": reason}
                log(f"== {name}: failed: {reason}")
            else:
                report["parts"][name] = run_part(name, ctx)
            ctx.results[name] = report["parts"][name]
            write()
    summary = ", ".join(f"{n} {p['status']}" for n, p in report["parts"].items())
    log(f"gpu-check: {summary}; {report['duration_s']:.1f} s; wrote {args.out / JSON_NAME}")
    log.close()
    return 0 if report["ok"] else 1
