"""`tandem sim`: replay a synthetic trace on a simulated cluster and print the summary.

tandem sim --trace shifting --cost h200 --duration 1800 --autoscale --plot sim.png
tandem sim --trace stationary --cost h100 --prefill 6 --decode 2
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from tandem.control import SLA
from tandem.sim.cluster import simulate
from tandem.sim.cost import COST_MODELS, cost_model
from tandem.sim.scenario import SLAS, scale_of, sim_config
from tandem.sim.trace import TRACES, generate, preset


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register `sim` on a `tandem` subparsers object."""
    p = subparsers.add_parser(
        "sim",
        help="simulate a cluster on a synthetic trace (real routing and ratio policies)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--trace", choices=TRACES, default="stationary")
    p.add_argument("--cost", choices=COST_MODELS, default="h200", help="cost model")
    p.add_argument("--duration", type=float, default=1800.0, help="trace length, seconds")
    p.add_argument(
        "--warmup", type=float, default=0.0, help="seconds at the start left out of the figures"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rate-scale", type=float, default=1.0, help="multiply the trace's rates")
    p.add_argument(
        "--prefill", type=int, default=None,
        help="prefill workers: static count (default 6 on GPUs, 4 on cpu) or the start (1)",
    )  # fmt: skip
    p.add_argument(
        "--decode", type=int, default=None,
        help="decode workers: static count (default 2) or the controller's start (1)",
    )  # fmt: skip
    p.add_argument("--autoscale", action="store_true", help="run the ratio controller")
    p.add_argument("--startup-s", type=float, default=None, help="seconds to start a worker")
    p.add_argument("--ttft-ms", type=float, default=None, help="TTFT target (p90 for control)")
    p.add_argument("--itl-ms", type=float, default=None, help="ITL target (p90 for control)")
    p.add_argument("--plot", type=Path, default=None, help="write a PNG of the run here")
    p.add_argument("--json", type=Path, default=None, help="write the summary as JSON here")
    p.set_defaults(func=main)
    return p


def main(args: argparse.Namespace) -> int:
    scale = scale_of(args.cost)
    # Static defaults: the best static ratios for the stationary preset (BENCHMARKS.md).
    default_p, default_d = (1, 1) if args.autoscale else (6, 2) if scale == "gpu" else (4, 2)
    num_prefill = default_p if args.prefill is None else args.prefill
    num_decode = default_d if args.decode is None else args.decode
    sla = SLAS[scale]
    sla = SLA(
        ttft_p90_ms=args.ttft_ms if args.ttft_ms is not None else sla.ttft_p90_ms,
        itl_p90_ms=args.itl_ms if args.itl_ms is not None else sla.itl_p90_ms,
    )
    try:
        config = sim_config(
            args.cost, args.duration, num_prefill, num_decode, args.autoscale, args.warmup,
            sla=sla,
        )  # fmt: skip
        if args.startup_s is not None:
            config = replace(config, startup_s=args.startup_s)
        spec = preset(args.trace, scale, args.rate_scale)
    except ValueError as e:
        print(f"tandem sim: {e}", file=sys.stderr)
        return 2
    cost = cost_model(args.cost)
    trace = generate(spec, args.duration, args.seed)
    print(
        f"{args.trace} trace, {len(trace)} requests over {args.duration:.0f} s; {cost.name}; "
        f"{config.label}; SLA TTFT <= {sla.ttft_p90_ms:.0f} ms, ITL <= {sla.itl_p90_ms:.0f} ms",
        file=sys.stderr,
    )
    result = simulate(trace, cost, config)
    summary = result.summary()
    print(summary.line())
    changes = sum(1 for d in result.decisions if d.changed)
    print(
        f"simulated in {result.wall_s:.1f} s ({result.events} events); "
        f"{changes} scaling decisions of {len(result.decisions)}"
    )
    if args.plot is not None:
        from tandem.sim.plot import plot_runs

        out = plot_runs([result], args.plot, f"{args.trace} on {cost.name}: {config.label}")
        print(f"wrote {out}")
    if args.json is not None:
        args.json.write_text(json.dumps(asdict(summary), indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="tandem")
    add_parser(parser.add_subparsers(dest="command", required=True))
    ns = parser.parse_args()
    sys.exit(int(ns.func(ns)))
