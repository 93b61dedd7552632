"""The engine's host time per decode step (issue 41): wall time of `engine.step()` minus the
model's forward and logits, split into the sampler and everything else (scheduling, step
inputs, output processing), at batch 1 / 16 / 64, on the CPU.

    .venv/bin/python benchmarks/bench_host_time.py [--model-dir DIR] [--dtype float32]
        [--threads 1] [--steps 30]

Each batch: that many greedy requests of 32-token prompts, prefilled, then `--steps` decode
steps timed one by one (medians). The forward is timed by wrapping `model.forward` and
`model.compute_logits`, the sampler by wrapping the runner's sampler, in the same steps, so
the shares are of the same calls. Writes benchmarks/results/host_time.json.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

RESULTS = Path(__file__).resolve().parent / "results" / "host_time.json"
DEFAULT_MODEL = Path.home() / ".cache" / "tandem" / "models" / "SmolLM2-135M-Instruct"


def timed(fn: Callable[..., Any], total: list[float]) -> Callable[..., Any]:
    """fn, adding each call's seconds to total[0]."""

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            total[0] += time.perf_counter() - t0

    return wrapper


def measure(engine: Any, batch: int, steps: int) -> dict[str, Any]:
    from tandem.engine.sampling import SamplingParams

    model, runner = engine.model, engine.runner
    forward, sampler = [0.0], [0.0]
    originals = (model.forward, model.compute_logits, runner.sampler)
    model.forward = timed(model.forward, forward)
    model.compute_logits = timed(model.compute_logits, forward)
    runner.sampler = timed(runner.sampler, sampler)
    params = SamplingParams(max_tokens=steps + 8, temperature=0.0, ignore_eos=True)
    ids = [f"b{batch}-{i}" for i in range(batch)]
    for i, rid in enumerate(ids):
        engine.add_request(engine.spec(rid, list(range(100 + i, 132 + i)), params))
    while any((r := engine.get_request(x)) is not None and not r.output_token_ids for x in ids):
        engine.step()
    walls, forwards, samplers = [], [], []
    for _ in range(steps):
        forward[0] = sampler[0] = 0.0
        t0 = time.perf_counter()
        engine.step()
        walls.append(time.perf_counter() - t0)
        forwards.append(forward[0])
        samplers.append(sampler[0])
    for rid in ids:
        engine.abort(rid)
    while engine.has_unfinished():
        engine.step()
    model.forward, model.compute_logits, runner.sampler = originals
    others = [w - f - s for w, f, s in zip(walls, forwards, samplers, strict=True)]
    step = statistics.median(walls)
    host = statistics.median([w - f for w, f in zip(walls, forwards, strict=True)])
    return {
        "batch": batch,
        "step_ms": round(step * 1e3, 3),
        "forward_ms": round(statistics.median(forwards) * 1e3, 3),
        "sampler_ms": round(statistics.median(samplers) * 1e3, 3),
        "other_host_ms": round(statistics.median(others) * 1e3, 3),
        "host_ms": round(host * 1e3, 3),
        "host_share": round(host / step, 4),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    from tandem.config import EngineConfig
    from tandem.engine.engine import LLMEngine

    torch.set_num_threads(args.threads)
    engine = LLMEngine(
        EngineConfig(model_dir=str(args.model_dir), dtype=args.dtype, num_threads=args.threads)
    )
    engine.warm_up()
    rows = []
    for batch in (int(b) for b in args.batches.split(",")):
        row = measure(engine, batch, args.steps)
        rows.append(row)
        print(
            f"batch {batch:3d}: step {row['step_ms']:8.2f} ms, forward {row['forward_ms']:8.2f}, "
            f"sampler {row['sampler_ms']:6.2f}, other host {row['other_host_ms']:6.2f} "
            f"(host {row['host_share']:.1%})",
            flush=True,
        )
    result = {
        "model": args.model_dir.name,
        "dtype": args.dtype,
        "threads": args.threads,
        "steps": args.steps,
        "cpu": torch.backends.cpu.get_cpu_capability(),
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
