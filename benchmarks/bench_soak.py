"""Everyday load: the soak of issue 26, as one command.

    python benchmarks/bench_soak.py [--quick] [--autoscale] [--overload] [--clients N]
        [--duration-s S] [--warmup-s S] [--model ''|random|DIR|FILE.gguf] [--seed N]
        [--max-queue-delay-s S] [--num-prefill N] [--num-decode N] [--results-dir DIR]
        [--early-disconnect-fraction F] [--kv-cache-mb MB] [--controller-args ARGS]

A cluster as a new user starts one (`tandem up`: services.up.Cluster with tandem up's model
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
import os
import re
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import machine
import soak_report
from soak_load import OK_OUTCOMES, Mix, Record, SoakTraffic, outcome_counts
from soak_metrics import (
    RSS_SOURCE,
    Sample,
    Scrape,
    bucket_quantile,
    diff_buckets,
    is_worker,
    sample_cluster,
    scrape_all,
    wait_kv_free,
    worker_lease_ttl_s,
)

from services.up import Cluster, UpConfig, wait_for_router
from services.up_processes import free_port
from tandem.cli_model import DEFAULT_MODEL_DIR, ensure_default_model, resolve_model, up_kv_cache

REPO_ROOT = Path(__file__).resolve().parent.parent
RESULTS = REPO_ROOT / "benchmarks" / "results"
DRAIN_MARGIN_S = 2.0  # on top of lease_ttl_s: a poll interval and a scrape
ABORT_P99_MAX_S = 0.1
RSS_GROWTH_MAX = 0.05
REFUSAL_P99_MAX_S = 1.0  # this benchmark's reading of "refused at once"
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


@dataclass(frozen=True, slots=True)
class Check:
    """One pass/fail line. passed None: not available (a metric this build does not export)."""

    name: str
    passed: bool | None
    measured: str
    target: str


def log(t0: float, msg: str) -> None:
    print(f"[{time.monotonic() - t0:7.1f}s] {msg}", file=sys.stderr, flush=True)


def _mib(n: float) -> str:
    return f"{n / 2**20:.0f}"


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


def up_config(args: argparse.Namespace, model_dir: Path) -> tuple[UpConfig, list[str]]:
    """tandem up's config for this run, and notes on what this build's UpConfig lacks."""
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
        "admin_port": free_port("127.0.0.1") if args.autoscale else 50061,
        "controller_args": tuple(shlex.split(args.controller_args)),
    }
    notes = []
    known = {f.name for f in dataclasses.fields(UpConfig)}
    if args.max_queue_delay_s is not None:
        if "max_queue_delay_s" in known:
            fields["max_queue_delay_s"] = args.max_queue_delay_s
        else:
            notes.append("--max-queue-delay-s: not available (UpConfig has no max_queue_delay_s)")
    return UpConfig(**fields), notes


# -- the run ----------------------------------------------------------------------------------


@dataclass(slots=True)
class Run:
    """What one soak measured."""

    records: list[Record]
    samples: list[Sample]
    traffic_end_s: float
    drain_s: float | None  # traffic end -> every worker at 0 KV blocks; None: not within
    drain_timeout_s: float
    start: dict[str, Scrape]  # /metrics per child, just before the traffic
    end: dict[str, Scrape]  # ... after the drain and the README question
    readme: Record
    router_log: dict[str, int]


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
    return Run(
        records, samples, traffic_end_s, drain_s, drain_timeout_s, start, end, readme, router_log
    )


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
        rss = ", ".join(f"{k} {_mib(v)}" for k, v in sorted(s.rss_bytes.items()))
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


# -- what the metrics say -------------------------------------------------------------------


def _counter_diff(run: Run, child: str, name: str, label: str) -> dict[str, float] | None:
    """Per value of `label`, how much counter `name` of `child` rose during the run; None when
    the child does not export it."""
    end = run.end.get(child)
    if end is None or not end.has(name):
        return None
    before = run.start.get(child, Scrape()).by_label(name, label)
    return {k: v - before.get(k, 0.0) for k, v in end.by_label(name, label).items()}


def _histogram(run: Run, child: str, name: str, **labels: str) -> dict[str, Any] | None:
    end = run.end.get(child)
    if end is None or not end.has(name):
        return None
    start = run.start.get(child, Scrape())
    buckets = diff_buckets(end.buckets(name, **labels), start.buckets(name, **labels))
    count = buckets[-1][1] if buckets else 0.0
    return {
        "count": count,
        "p50_bound_s": bucket_quantile(buckets, 0.5),
        "p99_bound_s": bucket_quantile(buckets, 0.99),
    }


def _workers_total(run: Run, name: str) -> dict[str, float] | None:
    """Per worker, how much counter `name` rose (None: no worker exports it)."""
    out = {}
    for child, page in run.end.items():
        if is_worker(child) and page.has(name):
            out[child] = page.total(name) - run.start.get(child, Scrape()).total(name)
    return out or None


def metrics_summary(run: Run) -> dict[str, Any]:
    """The router's and workers' issue-26 metrics over the run (None: not available)."""
    roles = {"prefill": {"role": "prefill"}, "decode": {"role": "decode"}, "all": {}}
    abort_hist = "tandem_router_worker_abort_seconds"
    return {
        "ejections_by_reason": _counter_diff(
            run, "router", "tandem_router_ejections_total", "reason"
        ),
        "worker_aborts_by_outcome": _counter_diff(
            run, "router", "tandem_router_worker_aborts_total", "outcome"
        ),
        "abort_round_trip": {
            k: _histogram(run, "router", abort_hist, **v) for k, v in roles.items()
        },
        "admission_refusals_by_reason": _counter_diff(
            run, "router", "tandem_router_admission_refusals_total", "reason"
        ),
        "queue_delay_estimate": _histogram(
            run, "router", "tandem_router_queue_delay_estimate_seconds"
        ),
        "queue_delay_actual": _histogram(run, "router", "tandem_router_queue_delay_seconds"),
        "router_requests_by_outcome": _counter_diff(
            run, "router", "tandem_router_requests_total", "outcome"
        ),
        "worker_aborts": _workers_total(run, "tandem_worker_aborts_total"),
        "worker_kv_blocks_reaped": _workers_total(run, "tandem_worker_kv_blocks_reaped_total"),
        "worker_kv_audit_violations": _workers_total(
            run, "tandem_worker_kv_audit_violations_total"
        ),
        "controller_decisions": _counter_diff(
            run, "controller", "tandem_controller_decisions_total", "role"
        ),
    }


# -- the checks -------------------------------------------------------------------------------


def _failures(records: list[Record]) -> str:
    counts: dict[str, int] = {}
    for r in records:
        counts[f"{r.kind} {r.outcome}"] = counts.get(f"{r.kind} {r.outcome}", 0) + 1
    return ", ".join(f"{k} x{v}" for k, v in sorted(counts.items()))


def _quantile(values: list[float], q: float) -> float:
    if not values:
        return math.nan
    xs = sorted(values)
    return xs[min(len(xs) - 1, max(0, math.ceil(q * len(xs)) - 1))]


def checks(
    run: Run, m: dict[str, Any], args: argparse.Namespace, setup: dict[str, Any]
) -> list[Check]:
    out = []
    valid = [r for r in run.records if r.valid]
    invalid = [r for r in run.records if not r.valid]
    refused = [r for r in valid if r.status == 429]
    if args.overload:  # refusals are the point; what was admitted must complete
        admitted = [r for r in valid if r.status != 429]
        bad = [r for r in admitted if r.outcome not in OK_OUTCOMES]
        out.append(
            Check(
                "admitted requests completed",
                not bad and bool(admitted),
                f"{len(admitted) - len(bad)} of {len(admitted)}"
                + (f"; {_failures(bad)}" if bad else ""),
                "all",
            )
        )
    else:
        bad = [r for r in valid if r.outcome not in OK_OUTCOMES]
        out.append(
            Check(
                "valid requests completed or ended by own disconnect",
                not bad,
                f"{len(valid) - len(bad)} of {len(valid)}" + (f"; {_failures(bad)}" if bad else ""),
                "all (no 5xx, no 429)",
            )
        )
    bad = [r for r in invalid if not r.ok]
    out.append(
        Check(
            "invalid requests refused with 4xx",
            not bad and bool(invalid),
            f"{len(invalid) - len(bad)} of {len(invalid)}" + (f"; {_failures(bad)}" if bad else ""),
            "all",
        )
    )
    ejections = m["ejections_by_reason"]
    out.append(
        Check(
            "no worker left rotation (router metric)",
            None if ejections is None else not any(ejections.values()),
            "not available"
            if ejections is None
            else (", ".join(f"{k} {v:.0f}" for k, v in ejections.items() if v) or "0"),
            "0 ejections",
        )
    )
    lg = run.router_log
    out.append(
        Check(
            "router log: no worker out of rotation, no failed hop",
            lg["out_of_rotation"] == 0 and lg["hop_failed"] == 0,
            f"out of rotation {lg['out_of_rotation']}, failed hops {lg['hop_failed']} (abort "
            f"failures {lg['abort_failed']}, other 'failed' warnings "
            f"{lg['other_failed_warnings']})",
            "0 and 0",
        )
    )
    p99 = (m["abort_round_trip"]["all"] or {}).get("p99_bound_s")
    hist = m["abort_round_trip"]["all"]
    out.append(
        Check(
            "abort round trip p99 < 100 ms",
            None if hist is None or p99 is None else p99 <= ABORT_P99_MAX_S,
            "not available"
            if hist is None
            else (
                "no aborts"
                if p99 is None
                else f"<= {p99 * 1e3:g} ms ({hist['count']:.0f} aborts; aborts by outcome "
                f"{m['worker_aborts_by_outcome']})"
            ),
            "p99 bucket bound <= 100 ms",
        )
    )
    last = run.samples[-1] if run.samples else None
    left = {k: v for k, v in (last.kv_blocks_used if last else {}).items() if v}
    out.append(
        Check(
            "every worker at 0 KV blocks within lease_ttl_s",
            run.drain_s is not None,
            f"after {run.drain_s:.1f} s"
            if run.drain_s is not None
            else f"not within {run.drain_timeout_s:g} s: still used {left}"
            + (f", unreadable {last.unreadable}" if last and last.unreadable else ""),
            f"<= lease_ttl_s + {DRAIN_MARGIN_S:g} s = {run.drain_timeout_s:g} s",
        )
    )
    out.append(_rss_check(run, args.warmup_s))
    audits = m["worker_kv_audit_violations"]
    out.append(
        Check(
            "KV audit violations",
            None if audits is None else not any(audits.values()),
            "not available" if audits is None else str({k: int(v) for k, v in audits.items()}),
            "0 on every worker",
        )
    )
    readme = run.readme
    text = readme.text.strip().replace("\n", " ")[:80]
    if readme.outcome != "completed":
        out.append(
            Check(
                "README question answered",
                False,
                f"{readme.outcome} {readme.detail}",
                "completed, 'Paris'",
            )
        )
    elif setup["real_model"]:
        out.append(
            Check(
                "README question answered",
                "Paris" in readme.text,
                repr(text),
                "text contains 'Paris'",
            )
        )
    else:
        out.append(
            Check(
                "README question answered",
                None,
                "random model: text not checked (the request completed)",
                "text contains 'Paris'",
            )
        )
    if args.overload:
        out += _overload_checks(refused, valid, setup)
    if args.autoscale:
        out.append(_capacity_check(run, setup))
    return out


def _rss_check(run: Run, warmup_s: float) -> Check:
    during = [s for s in run.samples if s.t_s <= run.traffic_end_s]
    base = next((s for s in during if s.t_s >= warmup_s), None)
    if base is None or base is during[-1]:
        return Check(
            "RSS flat after warm-up",
            None,
            f"run too short for a warm-up of {warmup_s:g} s",
            "< 5% growth",
        )
    last = during[-1]
    growth = {
        name: (last.rss_bytes[name] - rss) / rss
        for name, rss in base.rss_bytes.items()
        if name in last.rss_bytes and last.pids.get(name) == base.pids.get(name) and rss
    }
    if not growth:
        return Check(
            "RSS flat after warm-up", None, "no process alive at both samples", "< 5% growth"
        )
    worst = max(growth, key=lambda k: growth[k])
    return Check(
        "RSS flat after warm-up",
        all(g < RSS_GROWTH_MAX for g in growth.values()),
        f"worst {worst} {100 * growth[worst]:+.1f}% ({_mib(base.rss_bytes[worst])} -> "
        f"{_mib(last.rss_bytes[worst])} MiB, t {base.t_s:.0f} -> {last.t_s:.0f} s)",
        "< 5% growth per process",
    )


def _overload_checks(
    refused: list[Record], valid: list[Record], setup: dict[str, Any]
) -> list[Check]:
    latencies = [r.total_s for r in refused if r.total_s is not None]
    without = sum(r.retry_after is None for r in refused)
    admitted = [r.ttft_s for r in valid if r.outcome == "completed" and r.ttft_s is not None]
    limit = setup["max_queue_delay_s"]
    p99 = _quantile(admitted, 0.99)
    return [
        Check("excess refused with 429", bool(refused), f"{len(refused)} of {len(valid)}", "> 0"),
        Check(
            "every 429 carried Retry-After",
            bool(refused) and not without,
            f"{len(refused) - without} of {len(refused)}",
            "all",
        ),
        Check(
            "refused at once (send -> 429 p99)",
            None if not latencies else _quantile(latencies, 0.99) < REFUSAL_P99_MAX_S,
            "no refusals"
            if not latencies
            else f"p50 {_quantile(latencies, 0.5) * 1e3:.0f} ms, p99 "
            f"{_quantile(latencies, 0.99) * 1e3:.0f} ms",
            f"p99 < {REFUSAL_P99_MAX_S * 1e3:.0f} ms",
        ),
        Check(
            "admitted TTFT within max_queue_delay_s",
            None if limit is None or not admitted else p99 <= limit,
            f"p50 {_quantile(admitted, 0.5):.2f} s, p99 {p99:.2f} s"
            + ("" if limit is not None else " (limit not available)"),
            f"p99 <= {limit:g} s" if limit is not None else "p99 <= the limit",
        ),
    ]


def _capacity_check(run: Run, setup: dict[str, Any]) -> Check:
    """The benchmark's reading of "within the host's capacity": never more workers than
    cores (or than it started with), and all processes' RSS under 90% of the host's memory."""
    peak_workers = max((sum(s.workers.values()) for s in run.samples), default=0)
    peak_rss = max((sum(s.rss_bytes.values()) for s in run.samples), default=0)
    cap_workers = max(os.cpu_count() or 1, setup["num_prefill"] + setup["num_decode"])
    mem = _mem_total_bytes()
    ok = peak_workers <= cap_workers and (mem is None or peak_rss <= 0.9 * mem)
    return Check(
        "worker count within the host's capacity",
        ok,
        f"peak {peak_workers} workers, peak RSS {_mib(peak_rss)} MiB"
        + (f" of {_mib(mem)} MiB" if mem else ""),
        f"<= {cap_workers} workers, RSS <= 90% of memory",
    )


def _mem_total_bytes() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


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
    p.add_argument("--max-queue-delay-s", type=float, help="default: tandem up's")
    p.add_argument("--controller-args", default="", help="as tandem up --controller-args")
    p.add_argument(
        "--early-disconnect-fraction",
        type=float,
        default=0.0,
        help="also give up this fraction of requests before their first chunk (default 0)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--sample-interval-s", type=float, default=5.0)
    p.add_argument("--results-dir", default=str(RESULTS))
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
    config, notes = up_config(args, model_dir)
    for note in notes:
        log(t0, note)
    mix = OVERLOAD_MIX if args.overload else Mix()
    if args.early_disconnect_fraction:
        mix = dataclasses.replace(mix, early_disconnect_fraction=args.early_disconnect_fraction)
    setup = {
        "model_dir": str(model_dir),
        "model": model_dir.name,
        "real_model": real,
        "num_prefill": config.num_prefill,
        "num_decode": config.num_decode,
        "autoscale": config.autoscale,
        "controller_args": list(config.controller_args),
        "transport": config.transport,
        "kv_cache_bytes": config.kv_cache_bytes,
        "clients": args.clients,
        "duration_s": args.duration_s,
        "warmup_s": args.warmup_s,
        "seed": args.seed,
        "mix": dataclasses.asdict(mix),
        "lease_ttl_s": worker_lease_ttl_s(),
        "max_queue_delay_s": getattr(config, "max_queue_delay_s", None),
        "rss_source": RSS_SOURCE,
        "notes": notes,
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
    result = _finite(_result(run, m, checks(run, m, args, setup), args, setup))
    out = Path(args.results_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = _stem(args)
    (out / f"{stem}.json").write_text(json.dumps(result, indent=1) + "\n")
    plotted = soak_report.plot(result, out / f"{stem}.png")
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
            "ttft_s": {"p50": _quantile(ttft, 0.5), "p99": _quantile(ttft, 0.99)},
            "total_s": {"p50": _quantile(total, 0.5), "p99": _quantile(total, 0.99)},
        }
    return {
        "benchmark": "soak (issue 26)",
        "command": cmd,
        "mode": _stem(args),
        "machine": machine.machine_info(),
        "setup": setup,
        "checks": [dataclasses.asdict(c) for c in cs],
        "outcomes": outcome_counts(run.records),
        "latency": latency,
        "traffic_end_s": run.traffic_end_s,
        "drain_s": run.drain_s,
        "drain_timeout_s": run.drain_timeout_s,
        "readme": run.readme.to_json() | {"text": run.readme.text},
        "router_log": run.router_log,
        "metrics": m,
        "samples": [s.to_json() for s in run.samples],
        "records": [r.to_json() for r in run.records],
    }


if __name__ == "__main__":
    sys.exit(main())
