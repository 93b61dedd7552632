"""Everyday load: the soak of issue 26, as one command.

    python benchmarks/bench_soak.py [--quick] [--autoscale] [--overload] [--clients N]
        [--duration-s S] [--warmup-s S] [--model ''|random|DIR|FILE.gguf] [--seed N]
        [--max-queue-delay-s S] [--num-prefill N] [--num-decode N] [--results-dir DIR]
        [--early-disconnect-fraction F] [--kv-cache-mb MB] [--controller-args ARGS]
        [--cpu-matmul auto|plain|onednn] [--quantization Q] [--tp N] [--structured-fraction F]

A cluster as a new user starts one (`tandem up`: tandem.services.up.Cluster with tandem up's model
and KV cache choices; by default the real default model, SmolLM2-135M-Instruct, and 1 prefill
+ 1 decode worker; `--autoscale` adds the ratio controller with the local actuator), then N
closed-loop clients (default 8) of the OpenAI HTTP API for a duration (default 300 s), each
drawing from a seeded mix (benchmarks/soak_load.py): short chats, streamed and not; 300-1500
word documents to summarize, streamed; 20% of streams closed by the client after 1-5 chunks;
a few invalid requests (raw httpx). Every ~5 s it samples each worker's KV blocks in use, the
worker count and every child's resident memory (benchmarks/soak_metrics.py). After the
traffic it polls until every worker is back to 0 KV blocks (at most the workers' lease_ttl_s
plus a margin), asks the README question, and reads the router's and workers' /metrics
(ejections, aborts and their round trip, admission refusals, queue delay estimated vs
actual, reaped blocks, KV audit violations) and the router's log.

`--overload`: 64 clients (default) of long documents for 120 s (default), no disconnects; the
excess must be refused at once with 429 and Retry-After (the clients wait the Retry-After, at
most 5 s, then send again), admitted requests complete with TTFT within the router's
`max_queue_delay_s` (the value this run's UpConfig carried).

`--quick`: 4 clients for 60 s (warm-up 20 s); with `--model random` the generated random model
(TANDEM_DEFAULT_MODEL=random's), whose text is gibberish (the README check is then skipped).

Progress on stderr every ~10 s; results in <results-dir>/soak[-autoscale][-overload][-quick]
.json and .png, a markdown summary on stdout. Exit status 1 when a check failed.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import re
import shlex
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # siblings import by name
import soak_report
from report import REPO_ROOT, RESULTS_DIR, machine_info, result_path, write_json
from soak_checks import DRAIN_MARGIN_S, Check, Run, checks, metrics_summary, mib, quantile
from soak_load import Mix, SoakTraffic, outcome_counts
from soak_metrics import (
    RSS_SOURCE,
    Sample,
    sample_cluster,
    scrape_all,
    wait_kv_free,
    worker_lease_ttl_s,
)

from tandem.services.cli.model import (
    DEFAULT_MODEL_DIR,
    ensure_default_model,
    resolve_model,
    up_kv_cache,
)
from tandem.services.up import Cluster, UpConfig, wait_for_router
from tandem.services.up.processes import free_port

RETRY_AFTER_CAP_S = 5.0
PROGRESS_S = 10.0
# Router log lines that say a worker left rotation, or that a hop failed and was recovered.
LOG_PATTERNS = {
    "out_of_rotation": re.compile(r"out of rotation|left rotation|eject", re.I),
    "hop_failed": re.compile(r"WARNING.*_failed on "),
    "abort_failed": re.compile(r"abort of \S+ on \S+ (failed|skipped)"),
    "other_failed_warnings": re.compile(r"WARNING.*failed"),
}
OVERLOAD_MIX = Mix(
    chat_weight=0.0,
    document_weight=1.0,
    invalid_weight=0.0,
    disconnect_fraction=0.0,
    document_words=(1000, 1500),
    document_max_tokens=32,
)


def log(t0: float, msg: str) -> None:
    print(f"[{time.monotonic() - t0:7.1f}s] {msg}", file=sys.stderr, flush=True)


# -- the cluster ------------------------------------------------------------------------------


def _model(choice: str) -> tuple[Path, bool]:
    """The model directory `tandem up --model choice` serves (""/default: the real default
    model; "random": the generated one), and whether it is a real model (answers in words)."""
    if choice in ("", "default"):
        model_dir = resolve_model(None)  # falls back to the random model when the fetch fails
        return model_dir, model_dir != DEFAULT_MODEL_DIR
    if choice == "random":
        return ensure_default_model(choice="random"), False
    return resolve_model(choice), True


def up_config(args: argparse.Namespace, model_dir: Path) -> UpConfig:
    """tandem up's config for this run."""
    requested = None if args.kv_cache_mb is None else args.kv_cache_mb << 20
    kv_bytes, _ = up_kv_cache(model_dir, requested, args.device, "auto")
    fields: dict[str, Any] = {
        "model_dir": str(model_dir),
        "port": 0,
        "http_port": 0,
        "num_prefill": args.num_prefill,
        "num_decode": args.num_decode,
        "kv_cache_bytes": kv_bytes,
        "device": args.device,
        "autoscale": args.autoscale,
        "cpu_matmul": args.cpu_matmul,
        "quantization": args.quantization,
        "tensor_parallel_size": args.tp,
        "admin_port": free_port("127.0.0.1") if args.autoscale else 50061,
        "controller_args": tuple(shlex.split(args.controller_args)),
    }
    if args.max_queue_delay_s is not None:
        fields["max_queue_delay_s"] = args.max_queue_delay_s
    return UpConfig(**fields)


# -- the run ----------------------------------------------------------------------------------


async def soak(cluster: Cluster, args: argparse.Namespace, mix: Mix, t0: float) -> Run:
    max_model_len = _max_model_len(Path(cluster.config.model_dir))
    traffic = SoakTraffic(
        f"http://{cluster.http_address}/v1",
        max_model_len,
        mix,
        seed=args.seed,
        api_key=cluster.api_key or "none",
        honor_retry_after_s=RETRY_AFTER_CAP_S if args.overload else 0.0,
        clock=time.monotonic,
    )
    samples: list[Sample] = []
    async with traffic:
        start = await asyncio.to_thread(scrape_all, cluster)
        t_run = traffic.started

        async def sampler() -> None:
            while True:
                samples.append(await asyncio.to_thread(sample_cluster, cluster, _since(t_run)))
                await asyncio.sleep(args.sample_interval_s)

        async def progress() -> None:
            while True:
                await asyncio.sleep(PROGRESS_S)
                log(t0, _progress_line(traffic, samples))

        tasks = [asyncio.create_task(sampler()), asyncio.create_task(progress())]
        try:
            await traffic.run(args.clients, duration_s=args.duration_s)
        finally:
            for task in tasks:
                task.cancel()
        traffic_end_s = _since(t_run)
        unfinished = sum(r.outcome == "unfinished" for r in traffic.records)
        log(
            t0,
            f"traffic over after {traffic_end_s:.0f} s ({unfinished} unfinished); "
            "waiting for every worker to hold 0 KV blocks",
        )
        drain_timeout_s = worker_lease_ttl_s() + DRAIN_MARGIN_S
        drain_s, drained = await asyncio.to_thread(wait_kv_free, cluster, drain_timeout_s, t_run)
        samples.extend(drained)
        log(t0, _progress_line(traffic, samples))
        readme = await traffic.ask()
        end = await asyncio.to_thread(scrape_all, cluster)
    router_log = _count_log(cluster.run_dir / "router.log")
    records = [r for r in traffic.records if r is not readme]
    decisions = controller_decisions(cluster.controller_address) if args.autoscale else None
    return Run(
        records, samples, traffic_end_s, drain_s, drain_timeout_s, start, end, readme,
        router_log, decisions,
    )  # fmt: skip


def controller_decisions(address: str) -> list[dict[str, Any]]:
    """Every decision the controller kept (`tandem ctl explain`), oldest first."""
    import grpc

    from tandem.v1 import admin_pb2, admin_pb2_grpc

    with grpc.insecure_channel(address) as channel:
        reply = admin_pb2_grpc.AdminStub(channel).Explain(
            admin_pb2.ExplainRequest(limit=100_000), timeout=30
        )
    return [
        {
            "unix_time": d.unix_time,
            "current": dict(d.current),
            "target": dict(d.target),
            "reasons": dict(d.reasons),
            "applied": d.applied,
            "error": d.error,
        }
        for d in sorted(reply.decisions, key=lambda d: d.unix_time)
    ]


def _since(t: float) -> float:
    return time.monotonic() - t


def _max_model_len(model_dir: Path) -> int:
    return int(json.loads((model_dir / "config.json").read_text())["max_position_embeddings"])


def _progress_line(traffic: SoakTraffic, samples: list[Sample]) -> str:
    counts: dict[str, int] = {}
    for r in traffic.records:
        name = "in flight" if r.outcome == "unfinished" else r.outcome
        counts[name] = counts.get(name, 0) + 1
    outcomes = ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))
    line = f"{traffic.elapsed_s():.0f} s: {len(traffic.records)} requests ({outcomes})"
    if samples:
        s = samples[-1]
        blocks = ", ".join(f"{k} {v:.0f}" for k, v in sorted(s.kv_blocks_used.items()))
        rss = ", ".join(f"{k} {mib(v)}" for k, v in sorted(s.rss_bytes.items()))
        line += f" | KV blocks used: {blocks or 'n/a'} | RSS MiB: {rss}"
    return line


def _count_log(path: Path) -> dict[str, int]:
    counts = dict.fromkeys(LOG_PATTERNS, 0)
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return counts
    for line in lines:
        if LOG_PATTERNS["abort_failed"].search(line):
            counts["abort_failed"] += 1
            continue
        for name in ("out_of_rotation", "hop_failed"):
            if LOG_PATTERNS[name].search(line):
                counts[name] += 1
                break
        else:
            if LOG_PATTERNS["other_failed_warnings"].search(line):
                counts["other_failed_warnings"] += 1
    return counts


# -- main -------------------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="4 clients, 60 s (development)")
    p.add_argument("--autoscale", action="store_true", help="tandem up --autoscale")
    p.add_argument("--overload", action="store_true", help="64 clients of long documents")
    p.add_argument("--clients", type=int, help="default 8; --quick 4; --overload 64")
    p.add_argument("--duration-s", type=float, help="default 300; --quick 60; --overload 120")
    p.add_argument("--warmup-s", type=float, help="RSS baseline; default 60; --quick 20")
    p.add_argument("--model", default="", help="'' (tandem up's default), random, DIR or .gguf")
    p.add_argument("--num-prefill", type=int, default=1)
    p.add_argument("--num-decode", type=int, default=1)
    p.add_argument("--kv-cache-mb", type=int, help="default: tandem up's choice")
    p.add_argument("--device", default="cpu")
    p.add_argument(
        "--cpu-matmul", default="auto", help="tandem up --cpu-matmul: auto, plain or onednn"
    )
    p.add_argument("--quantization", default="none", help="tandem up --quantization")
    p.add_argument("--tp", type=int, default=1, help="tandem up --tp: ranks per worker")
    p.add_argument("--max-queue-delay-s", type=float, help="default: tandem up's")
    p.add_argument("--controller-args", default="", help="as tandem up --controller-args")
    p.add_argument(
        "--early-disconnect-fraction",
        type=float,
        default=0.0,
        help="also give up this fraction of requests before their first chunk (default 0)",
    )
    p.add_argument(
        "--structured-fraction",
        type=float,
        default=0.0,
        help="this fraction of valid requests answer in JSON to one of many schemas",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sample-interval-s", type=float, default=5.0)
    p.add_argument("--results-dir", default=str(RESULTS_DIR))
    args = p.parse_args(argv)
    quick, overload = args.quick, args.overload
    args.clients = args.clients or (64 if overload else 4 if quick else 8)
    args.duration_s = args.duration_s or (60.0 if quick else 120.0 if overload else 300.0)
    args.warmup_s = args.warmup_s if args.warmup_s is not None else (20.0 if quick else 60.0)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t0 = time.monotonic()
    model_dir, real = _model(args.model)
    config = up_config(args, model_dir)
    mix = OVERLOAD_MIX if args.overload else Mix()
    if args.early_disconnect_fraction:
        mix = dataclasses.replace(mix, early_disconnect_fraction=args.early_disconnect_fraction)
    if args.structured_fraction:
        mix = dataclasses.replace(mix, structured_fraction=args.structured_fraction)
    setup = {
        "model_dir": str(model_dir),
        "model": model_dir.name,
        "real_model": real,
        "num_prefill": config.num_prefill,
        "num_decode": config.num_decode,
        "autoscale": config.autoscale,
        "cpu_matmul": config.cpu_matmul,
        "quantization": config.quantization,
        "tensor_parallel_size": config.tensor_parallel_size,
        "overload": args.overload,
        "controller_args": list(config.controller_args),
        "transport": config.transport,
        "kv_cache_bytes": config.kv_cache_bytes,
        "clients": args.clients,
        "duration_s": args.duration_s,
        "warmup_s": args.warmup_s,
        "seed": args.seed,
        "mix": dataclasses.asdict(mix),
        "lease_ttl_s": worker_lease_ttl_s(),
        "max_queue_delay_s": config.max_queue_delay_s,
        "rss_source": RSS_SOURCE,
    }
    cluster = Cluster(config)
    log(
        t0,
        f"starting tandem up: {config.num_prefill} prefill + {config.num_decode} decode "
        f"worker(s), {model_dir.name}{', autoscale' if config.autoscale else ''}",
    )
    cluster.start()
    try:
        wait_for_router(cluster.router_address, api_key=cluster.api_key or None)
        log(
            t0,
            f"ready; logs in {cluster.run_dir}; {args.clients} clients for {args.duration_s:g} s",
        )
        run = asyncio.run(soak(cluster, args, mix, t0))
        setup["run_dir"] = str(cluster.run_dir)
        setup["supervisor_failure"] = cluster.failure
    finally:
        cluster.stop()
    m = metrics_summary(run)
    result = _finite(_result(run, m, checks(run, m, setup), args, setup))
    out = Path(args.results_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = _stem(args)
    write_json(result_path(out, stem), result, indent=1)
    plotted = soak_report.plot(result, result_path(out, stem, ext="png"))
    shown = out.resolve()
    if shown.is_relative_to(REPO_ROOT):
        shown = shown.relative_to(REPO_ROOT)
    print(soak_report.markdown(result, stem, plotted, str(shown)))
    return 0 if all(c["passed"] is not False for c in result["checks"]) else 1


def _stem(args: argparse.Namespace) -> str:
    parts = [
        "soak",
        "autoscale" if args.autoscale else "",
        "overload" if args.overload else "",
        "quick" if args.quick else "",
        "" if args.cpu_matmul == "auto" else args.cpu_matmul,
        "" if args.quantization == "none" else args.quantization,
        "" if args.tp == 1 else f"tp{args.tp}",
        "structured" if args.structured_fraction else "",
        "" if args.duration_s in (None, 60, 120, 300) else f"{args.duration_s / 60:g}min",
    ]
    return "-".join(p for p in parts if p)


def _finite(x: Any) -> Any:
    """`x` with inf as "inf" and nan as None (strict JSON has neither)."""
    if isinstance(x, float) and not math.isfinite(x):
        return "inf" if x > 0 else None
    if isinstance(x, dict):
        return {k: _finite(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_finite(v) for v in x]
    return x


def _result(
    run: Run, m: dict[str, Any], cs: list[Check], args: argparse.Namespace, setup: dict[str, Any]
) -> dict[str, Any]:
    cmd = "python benchmarks/bench_soak.py" + "".join(f" {a}" for a in sys.argv[1:])
    latency = {}
    for kind in sorted({r.kind for r in run.records}):
        rs = [r for r in run.records if r.kind == kind and r.outcome == "completed"]
        ttft = [r.ttft_s for r in rs if r.ttft_s is not None]
        total = [r.total_s for r in rs if r.total_s is not None]
        latency[kind] = {
            "completed": len(rs),
            "ttft_s": {"p50": quantile(ttft, 0.5), "p99": quantile(ttft, 0.99)},
            "total_s": {"p50": quantile(total, 0.5), "p99": quantile(total, 0.99)},
        }
    return {
        "benchmark": "soak (issue 26)",
        "command": cmd,
        "mode": _stem(args),
        "machine": machine_info(),
        "setup": setup,
        "checks": [dataclasses.asdict(c) for c in cs],
        "outcomes": outcome_counts(run.records),
        "latency": latency,
        "traffic_end_s": run.traffic_end_s,
        "drain_s": run.drain_s,
        "drain_timeout_s": run.drain_timeout_s,
        "readme": run.readme.to_json() | {"text": run.readme.text},
        "router_log": run.router_log,
        "controller_decisions": run.decisions,
        "metrics": m,
        "samples": [s.to_json() for s in run.samples],
        "records": [r.to_json() for r in run.records],
    }


if __name__ == "__main__":
    sys.exit(main())
