"""Prefix-aware routing (issue 4): kv vs round_robin vs load placement.

    .venv/bin/python benchmarks/bench_routing.py [--quick]

Each policy gets a fresh `tandem up` cluster with its defaults (Redis, 2 prefill workers,
1 decode worker, 256 MiB of KV cache each; 1 torch thread per worker on this 2-core machine)
and a router started with `--policy P` and otherwise default flags, so every policy sees the
same cold caches and the same requests, one after the other.

(1) Shared prefixes, like a fleet of assistants: N system prompts of L tokens, each request
    one of them (uniformly) plus a short unique question, short greedy outputs, Poisson
    arrivals; `rounds` rounds of the same prompts. The router's defaults include conditional
    disaggregation (`--disagg-min-uncached-tokens 64`): the kv policy knows what the decode
    worker has cached and lets it prefill a short uncached tail itself; round_robin and load
    know no caches and disaggregate every long prompt. Reports TTFT, prefix hit rate (prompt
    tokens found cached by whichever worker prefilled / prompt tokens, and the fraction of
    requests with a hit), throughput, and where requests were prefilled.
(2) Skewed: one prefix takes `hot_share` of the traffic, on 3 prefill workers (a third joins
    the cluster; with two, the larger queue can never exceed twice the mean) through a second
    router with `--disagg-min-uncached-tokens 0`, so every request goes to a prefill worker
    and their queues are what is measured. GetStats (queued_prefill_tokens) is sampled every
    50 ms; reports per-worker mean and peak queue depth and the max/mean ratio.

Writes benchmarks/results/routing[-quick].{json,png}; the full run also rewrites the
"## Prefix-aware routing (issue 4)" section of BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import json
import os
import platform
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import IO, Any

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parent))

from loadgen import (  # noqa: E402
    FIRST_ORDINARY_ID,
    RequestSpec,
    RouterTarget,
    RunResult,
    Sla,
    _run,
    percentile,
    write_markdown_section,
)

from services.common.registry import Registry  # noqa: E402
from tandem.up import Cluster, UpConfig, wait_for_router  # noqa: E402
from tandem.v1 import worker_pb2 as wpb  # noqa: E402
from tandem.v1 import worker_pb2_grpc as wgrpc  # noqa: E402

REPO_ROOT = Path(__file__).resolve().parent.parent
RESULTS = REPO_ROOT / "benchmarks" / "results"
BENCHMARKS_MD = REPO_ROOT / "BENCHMARKS.md"
SECTION = "## Prefix-aware routing (issue 4)"
MODEL_DIR = REPO_ROOT / ".cache" / "models" / "small"
POLICIES = ("kv", "round_robin", "load")
VOCAB = 8192
DEFAULT_KV_CACHE_MB = 256  # tandem up's default
KV_BYTES_PER_TOKEN = 12 * 2 * 4 * 64 * 4  # small: layers x (K, V) x kv heads x head dim x fp32
SLA = Sla(ttft_ms=2000.0, itl_p90_ms=100.0)  # loadgen's summary wants one; not a target here


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


@dataclass(frozen=True, slots=True)
class Sizes:
    num_prefixes: int = 8
    prefix_len: int = 1024
    question_len: tuple[int, int] = (16, 32)
    output_len: tuple[int, int] = (8, 16)
    rounds: int = 2
    per_round: int = 32
    rate: float = 0.4
    concurrency: int = 16
    skew_requests: int = 40
    skew_rate: float = 2.0  # high enough that prefill queues form
    hot_share: float = 0.8
    warmup: int = 4


QUICK = Sizes(prefix_len=256, per_round=8, rate=1.5, skew_requests=16, skew_rate=3.0, warmup=2)


# -- workload ------------------------------------------------------------------------------


def make_specs(
    sizes: Sizes, n: int, rate: float, seed: int, salt: int, hot_share: float | None = None
) -> list[RequestSpec]:
    """`n` requests: arrivals and prefix choices depend on `seed` only (the same for every
    policy), token contents on `salt` (system prompts) and (`salt`, `seed`) (questions)."""
    shape = random.Random(f"shape/{seed}")
    prefix_rng = random.Random(f"prefix/{salt}")
    suffix_rng = random.Random(f"suffix/{salt}/{seed}")

    def ids(rng: random.Random, k: int) -> list[int]:
        return [rng.randrange(FIRST_ORDINARY_ID, VOCAB) for _ in range(k)]

    prefixes = [ids(prefix_rng, sizes.prefix_len) for _ in range(sizes.num_prefixes)]
    if hot_share is None:
        weights = [1.0] * sizes.num_prefixes
    else:
        cold = (1.0 - hot_share) / (sizes.num_prefixes - 1)
        weights = [hot_share] + [cold] * (sizes.num_prefixes - 1)
    specs = []
    t = 0.0
    for i in range(n):
        if i:
            t += shape.expovariate(rate)
        p = shape.choices(range(sizes.num_prefixes), weights)[0]
        q = shape.randint(*sizes.question_len)
        out = shape.randint(*sizes.output_len)
        specs.append(RequestSpec(i, t, prefixes[p] + ids(suffix_rng, q), out, f"prefix{p}"))
    return specs


# -- processes -----------------------------------------------------------------------------


def _die_with_parent() -> None:
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


class RouterProc:
    """`python -m services.router --policy P [flags]` against a cluster's Redis."""

    def __init__(self, policy: str, redis_url: str, log_dir: Path, *flags: str) -> None:
        self.policy = policy
        self.log_path = log_dir / f"router-{policy}{'-'.join(('', *flags))}.log"
        self._log = open(self.log_path, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "services.router",
                "--model-dir",
                str(MODEL_DIR),
                "--redis-url",
                redis_url,
                "--port",
                "0",
                "--policy",
                policy,
                *flags,
            ],  # fmt: skip
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            preexec_fn=_die_with_parent,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        self.address = ""

    def wait_ready(self, timeout_s: float = 300.0) -> None:
        assert self.proc.stdout is not None
        self.address = _wait_line(self.proc.stdout, "READY", timeout_s).split()[-1]

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


def _wait_line(stream: IO[str], marker: str, timeout_s: float) -> str:
    found: list[str] = []

    def read() -> None:
        for line in stream:
            if marker in line:
                found.append(line.strip())
                return

    t = threading.Thread(target=read, daemon=True)
    t.start()
    t.join(timeout_s)
    if not found:
        raise RuntimeError(f"no {marker!r} line within {timeout_s} s")
    return found[0]


# -- queue sampling ------------------------------------------------------------------------


class QueueSampler:
    """Polls GetStats on every prefill worker every `period_s` until stopped."""

    def __init__(self, workers: dict[str, str], period_s: float = 0.05) -> None:
        self.period_s = period_s
        self.channels = {w: grpc.aio.insecure_channel(a) for w, a in workers.items()}
        self.samples: dict[str, list[tuple[float, int]]] = {w: [] for w in workers}
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def _poll(self) -> None:
        stubs = {w: wgrpc.PrefillWorkerStub(ch) for w, ch in self.channels.items()}
        t0 = time.perf_counter()
        while not self._stop.is_set():
            t = time.perf_counter() - t0
            replies = await asyncio.gather(
                *(s.GetStats(wpb.GetStatsRequest(), timeout=1.0) for s in stubs.values()),
                return_exceptions=True,
            )
            for w, r in zip(stubs, replies, strict=True):
                if isinstance(r, wpb.WorkerStats):
                    self.samples[w].append((t, int(r.queued_prefill_tokens)))
            try:
                await asyncio.wait_for(self._stop.wait(), self.period_s)
            except TimeoutError:
                pass

    def start(self) -> None:
        self._task = asyncio.create_task(self._poll())

    async def stop(self) -> None:
        self._stop.set()
        if self._task is not None:
            await self._task
        for ch in self.channels.values():
            await ch.close()


# -- statistics ----------------------------------------------------------------------------


def routing_stats(res: RunResult, prefill_ids: Sequence[str]) -> dict[str, Any]:
    done = [r for r in res.records if r.ok]
    prompt = sum(r.prompt_tokens for r in done)
    cached = sum(r.info.get("cached_prompt_tokens", 0) for r in done)
    s = res.summary(SLA)
    per_worker = {
        w: {
            "requests": sum(1 for r in done if r.info.get("prefill_worker") == w),
            "computed_prompt_tokens": sum(
                r.prompt_tokens - r.info.get("cached_prompt_tokens", 0)
                for r in done
                if r.info.get("prefill_worker") == w
            ),
        }
        for w in prefill_ids
    }
    return {
        "num_requests": s["num_requests"],
        "num_ok": s["num_ok"],
        "errors": s["errors"],
        "ttft_ms": s["ttft_ms"],
        "itl_ms": s["itl_ms"],
        "e2e_ms": s["e2e_ms"],
        "window_s": s["window_s"],
        "throughput_tok_s": s["throughput_tok_s"],
        "request_rate": s["request_rate"],
        "disaggregated_fraction": s["disaggregated_fraction"],
        "prompt_tokens": prompt,
        "cached_prompt_tokens": cached,
        "token_hit_rate": cached / prompt if prompt else 0.0,
        "request_hit_fraction": (
            sum(1 for r in done if r.info.get("cached_prompt_tokens", 0) > 0) / len(done)
            if done
            else 0.0
        ),
        "route_cached_tokens": sum(r.info.get("route_cached_tokens", 0) for r in done),
        "per_prefill_worker": per_worker,
        "requests": [
            {
                "index": r.index,
                "prefix": r.kind,
                "arrival_s": round(r.arrival_s, 3),
                "prompt_tokens": r.prompt_tokens,
                "ttft_ms": round(r.ttft_s * 1e3, 1),
                "error": r.error,
                **r.info,
            }
            for r in res.records
        ],
    }


def queue_stats(samples: dict[str, list[tuple[float, int]]]) -> dict[str, Any]:
    per = {
        w: {
            "samples": len(xs),
            "mean": sum(q for _, q in xs) / len(xs) if xs else 0.0,
            "p90": percentile([float(q) for _, q in xs], 90) if xs else 0.0,
            "peak": max((q for _, q in xs), default=0),
            "nonzero_fraction": sum(1 for _, q in xs if q) / len(xs) if xs else 0.0,
        }
        for w, xs in samples.items()
    }
    means = [p["mean"] for p in per.values()]
    peaks = [p["peak"] for p in per.values()]
    mean_of_means = sum(means) / len(means) if means else 0.0
    mean_of_peaks = sum(peaks) / len(peaks) if peaks else 0.0
    return {
        "per_worker": per,
        # None: no worker ever had a queue (0 / 0)
        "max_over_mean": max(means) / mean_of_means if mean_of_means else None,
        "peak_max_over_mean": max(peaks) / mean_of_peaks if mean_of_peaks else None,
    }


# -- the runs ------------------------------------------------------------------------------


async def _send(target: RouterTarget, specs: list[RequestSpec], concurrency: int) -> RunResult:
    return await _run(target, specs, concurrency, closed_loop=False)


async def warm_up(target: RouterTarget, sizes: Sizes) -> None:
    """Short unique prompts: channels, torch's first calls. They share no prefix with anything
    measured."""
    specs = make_specs(replace(sizes, prefix_len=16), sizes.warmup, 100.0, 900, 900)
    await _run(target, specs, 2, closed_loop=True)


async def bench_shared(
    address: str, policy: str, sizes: Sizes, prefill_ids: list[str]
) -> tuple[RunResult, list[dict[str, Any]]]:
    target = RouterTarget(address, name=policy)
    rounds, results = [], []
    try:
        await warm_up(target, sizes)
        for rnd in range(sizes.rounds):
            specs = make_specs(sizes, sizes.per_round, sizes.rate, seed=rnd, salt=1)
            log(f"(1) {policy}: round {rnd + 1}/{sizes.rounds}, {len(specs)} requests")
            res = await _send(target, specs, sizes.concurrency)
            results.append(res)
            st = routing_stats(res, prefill_ids)
            rounds.append({"round": rnd + 1, "policy": policy, **st})
            log(
                f"    TTFT p50 {st['ttft_ms']['p50']:.0f} ms, p90 {st['ttft_ms']['p90']:.0f} ms, "
                f"hit {st['token_hit_rate']:.0%} ({st['request_hit_fraction']:.0%} of reqs), "
                f"disaggregated {st['disaggregated_fraction']:.0%}, "
                f"ok {st['num_ok']}/{st['num_requests']}"
            )
    finally:
        await target.close()
    return RunResult.concat(results), rounds


async def bench_skew(
    address: str, policy: str, sizes: Sizes, prefill: dict[str, str]
) -> dict[str, Any]:
    target = RouterTarget(address, name=policy)
    specs = make_specs(
        sizes, sizes.skew_requests, sizes.skew_rate, seed=100, salt=10, hot_share=sizes.hot_share
    )
    log(f"(2) skewed: {policy}, {len(specs)} requests on {len(prefill)} prefill workers")
    sampler = QueueSampler(prefill)
    sampler.start()
    try:
        res = await _send(target, specs, sizes.concurrency)
    finally:
        await sampler.stop()
        await target.close()
    st = routing_stats(res, list(prefill))
    q = queue_stats(sampler.samples)
    log(
        f"    TTFT p50 {st['ttft_ms']['p50']:.0f} ms, queue mean max/mean "
        f"{_ratio(q['max_over_mean'])}, peak max/mean {_ratio(q['peak_max_over_mean'])}, "
        f"per worker {st['per_prefill_worker']}"
    )
    return {**st, "queue": q, "queue_series": sampler.samples}


async def _prefill_workers(redis_url: str) -> dict[str, str]:
    reg = Registry(redis_url)
    try:
        return {w.worker_id: w.address for w in await reg.list_workers(role="prefill")}
    finally:
        await reg.close()


def run_policy(
    policy: str, sizes: Sizes, log_dir: Path, kv_cache_mb: int, skew: bool
) -> dict[str, Any]:
    """(1) and, if `skew`, (2) for one policy on a fresh cluster."""
    cluster = Cluster(
        UpConfig(
            model_dir=str(MODEL_DIR),
            port=0,
            num_prefill=2,
            num_decode=1,
            run_dir=str(log_dir),
            kv_cache_bytes=kv_cache_mb << 20,
        )  # fmt: skip
    )
    routers: list[RouterProc] = []
    try:
        log(f"{policy}: starting a cluster (2 prefill + 1 decode, tandem up defaults)")
        cluster.start()
        wait_for_router(cluster.router_address)
        routers.append(RouterProc(policy, cluster.redis_url, log_dir))
        routers[-1].wait_ready()
        wait_for_router(routers[-1].address)
        prefill = asyncio.run(_prefill_workers(cluster.redis_url))
        time.sleep(1.0)  # the router's watcher sees every worker
        merged, rounds = asyncio.run(bench_shared(routers[0].address, policy, sizes, list(prefill)))
        if not skew:
            return {"merged": merged, "rounds": rounds, "prefill_ids": list(prefill)}

        log(f"{policy}: adding a third prefill worker and a router that always disaggregates")
        cluster.add_worker("prefill")
        routers.append(
            RouterProc(policy, cluster.redis_url, log_dir, "--disagg-min-uncached-tokens", "0")
        )
        routers[-1].wait_ready()
        wait_for_router(routers[-1].address)
        while len(prefill := asyncio.run(_prefill_workers(cluster.redis_url))) < 3:
            time.sleep(0.5)
        time.sleep(1.5)  # every router's watcher sees it
        skewed = asyncio.run(bench_skew(routers[1].address, policy, sizes, prefill))
        # A worker that misses heartbeats (a starved CPU) "leaves": routers drop its index
        # entries, which costs the kv policy its affinity for a while. Count those events.
        left = sum(r.log_path.read_text().count("worker left") for r in routers)
        return {"merged": merged, "rounds": rounds, "skew": skewed, "worker_left_events": left,
                "prefill_ids": list(prefill)[:2]}  # fmt: skip
    finally:
        for r in routers:
            r.stop()
        cluster.stop()


def run(sizes: Sizes, log_dir: Path, kv_cache_mb: int, skew: bool) -> dict[str, Any]:
    os.environ["TANDEM_NUM_THREADS"] = "1"  # one torch thread per worker on 2 cores
    per = {p: run_policy(p, sizes, log_dir / p, kv_cache_mb, skew) for p in POLICIES}
    out: dict[str, Any] = {
        "kv_cache_mb": kv_cache_mb,
        "shared": {
            "policies": {p: routing_stats(d["merged"], d["prefill_ids"]) for p, d in per.items()},
            "rounds": [r for d in per.values() for r in d["rounds"]],
            "ttfts_ms": {
                p: sorted(x.ttft_s * 1e3 for x in d["merged"].records if x.ok)
                for p, d in per.items()
            },
        },
    }
    if skew:
        out["skew"] = {p: d["skew"] for p, d in per.items()}
        out["worker_left_events"] = {p: d["worker_left_events"] for p, d in per.items()}
    return out


# -- output --------------------------------------------------------------------------------


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    ax = axes[0]
    for p, xs in report["shared"]["ttfts_ms"].items():
        ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=p, drawstyle="steps-post")
    ax.set_xscale("log")
    ax.set_xlabel("TTFT (ms)")
    ax.set_ylabel("fraction of requests")
    ax.set_title("(1) shared prefixes: TTFT CDF")
    ax.legend()
    ax.grid(alpha=0.3)

    ax = axes[1]
    pol = report["shared"]["policies"]
    names = list(pol)
    xs = range(len(names))
    ax.bar(
        [x - 0.2 for x in xs],
        [pol[p]["token_hit_rate"] for p in names],
        0.4,
        label="prompt tokens cached",
    )
    ax.bar(
        [x + 0.2 for x in xs],
        [pol[p]["request_hit_fraction"] for p in names],
        0.4,
        label="requests with a hit",
    )
    ax.set_xticks(list(xs), names)
    ax.set_ylim(0, 1)
    ax.axhline(0.8, color="grey", ls="--", lw=1)
    ax.set_title("(1) prefix hit rate")
    ax.legend(loc="lower right")

    ax = axes[2]
    for policy, style in (("kv", "-"), ("round_robin", ":")):
        series = report["skew"].get(policy, {}).get("queue_series", {})
        for w, pts in series.items():
            ax.plot([t for t, _ in pts], [q for _, q in pts], style, label=f"{policy} {w}", lw=1)
    ax.set_xlabel("time (s)")
    ax.set_ylabel("queued prefill tokens")
    ax.set_title(f"(2) skewed ({report['sizes']['hot_share']:.0%} one prefix): queue depth")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _f(x: float, digits: int = 0) -> str:
    return f"{x:.{digits}f}"


def _ratio(x: float | None) -> str:
    return "n/a (no queue)" if x is None else f"{x:.2f}"


def shared_tables(report: dict[str, Any]) -> list[str]:
    """The shared-prefix tables of one run, and how it fares against the targets."""
    pol = report["shared"]["policies"]
    kv, rr = pol["kv"], pol["round_robin"]
    ratio = kv["ttft_ms"]["p50"] / rr["ttft_ms"]["p50"]
    lines = [
        "| policy | ok | TTFT p50 / p90 (ms) | prompt tokens cached | requests with a hit "
        "| out tok/s | req/s | requests prefilled on prefill-0 / prefill-1 / decode |",
        "|" + "---|" * 8,
    ]
    for p, s in pol.items():
        w = s["per_prefill_worker"]
        lines.append(
            f"| {p} | {s['num_ok']}/{s['num_requests']} "
            f"| {_f(s['ttft_ms']['p50'])} / {_f(s['ttft_ms']['p90'])} "
            f"| {s['token_hit_rate']:.1%} | {s['request_hit_fraction']:.1%} "
            f"| {_f(s['throughput_tok_s'], 1)} | {_f(s['request_rate'], 2)} "
            f"| {' / '.join(str(v['requests']) for v in w.values())} / "
            f"{s['num_ok'] - sum(v['requests'] for v in w.values())} |"
        )
    lines += [
        "",
        "Per round (round 1 includes each system prompt's first, cold, request):",
        "",
        "| round | policy | TTFT p50 / p90 (ms) | prompt tokens cached | requests with a hit |",
        "|" + "---|" * 5,
    ]
    by_round: dict[int, dict[str, float]] = {}
    for r in report["shared"]["rounds"]:
        by_round.setdefault(r["round"], {})[r["policy"]] = r["ttft_ms"]["p50"]
        lines.append(
            f"| {r['round']} | {r['policy']} | {_f(r['ttft_ms']['p50'])} / "
            f"{_f(r['ttft_ms']['p90'])} | {r['token_hit_rate']:.1%} "
            f"| {r['request_hit_fraction']:.1%} |"
        )
    per_round = ", ".join(
        f"round {n}: {v['kv'] / v['round_robin']:.2f}" for n, v in sorted(by_round.items())
    )
    lines += [
        "",
        f"Targets: kv TTFT p50 / round_robin TTFT p50 = **{ratio:.2f}** over both rounds "
        f"({per_round}; target <= 0.5: {'met' if ratio <= 0.5 else 'NOT met'}); kv prefix "
        f"hit rate **{kv['token_hit_rate']:.1%}** of prompt tokens, "
        f"{kv['request_hit_fraction']:.1%} of requests (target >= 80%: "
        f"{'met' if kv['token_hit_rate'] >= 0.8 else 'NOT met'}).",
        "",
    ]
    return lines


def section_markdown(report: dict[str, Any], smaller: dict[str, Any] | None = None) -> str:
    """The BENCHMARKS.md section; `smaller`: a shared-prefix-only run with smaller caches."""
    sz = report["sizes"]
    lines = [
        SECTION,
        "",
        "```",
        report["command"],
        "```",
        "",
        f"Machine: {report['machine']}. Model `small` (12 layers, fp32). Each policy runs on "
        "a fresh `tandem up` cluster with its defaults (Redis, 2 prefill + 1 decode workers, "
        "256 MiB of KV cache each, 1 torch thread each) behind a router started with "
        "`--policy P` and default flags, so all three see the same cold caches and the same "
        "requests. The defaults include conditional disaggregation (prompts with fewer than "
        "64 *uncached* tokens are prefilled by the decode worker): the kv policy knows what "
        "the decode worker holds, so once it has pulled a system prompt's KV it prefills later "
        "questions on that prompt itself; round_robin and load know no caches and send every "
        "long prompt to a prefill worker.",
        "",
        f"### (1) Shared prefixes: {sz['num_prefixes']} system prompts x {sz['prefix_len']} "
        f"tokens, questions {sz['question_len'][0]}-{sz['question_len'][1]} tokens, outputs "
        f"{sz['output_len'][0]}-{sz['output_len'][1]} tokens, "
        f"{sz['rounds']} x {sz['per_round']} requests per policy at {sz['rate']} req/s",
        "",
    ]
    lines += shared_tables(report)
    if smaller is not None:
        mb = smaller["kv_cache_mb"]
        prompt_bytes = sz["prefix_len"] * KV_BYTES_PER_TOKEN
        lines += [
            f"#### (1b) The same with {mb} MiB of KV cache per worker",
            "",
            "```",
            smaller["command"],
            "```",
            "",
            f"Each worker's cache now holds about {mb * 2**20 // prompt_bytes} of the "
            f"{sz['num_prefixes']} system prompts: placement that splits the prompts "
            "between the prefill workers keeps all of them cached; spreading every prompt "
            "over both workers cannot.",
            "",
            *shared_tables(smaller),
        ]
    lines += [
        "Reading: kv computes fewer prompt tokens in every run (the hit rates above), but "
        "TTFT p50 moves only when round_robin's median request is a miss. With the default "
        "caches every worker ends up holding all 8 prompts, so round_robin's median request "
        "hits too, even in round 1 unless its cold misses queue up behind one another (how "
        "much they do depends on how busy this shared machine is: round 1 ratios of 0.31 and "
        "0.88 were measured in two full runs the same day). A hit's TTFT is the same for every "
        "policy: the ~24-token question prefilled over the cached prompt, on the decode worker "
        "(kv) or on a prefill worker (the others). With smaller caches (1b) round_robin keeps "
        "missing (compare the round 2 hit rates) and the kv / round_robin TTFT p50 ratio falls, "
        "to 0.51 and 0.70 in two runs. The 0.5 target is not met in the issue's setting, "
        "where caches hold every prompt.",
        "",
    ]
    lines += [
        f"### (2) Skewed: {sz['hot_share']:.0%} of requests on one system prompt, "
        f"{sz['skew_requests']} requests per policy at {sz['skew_rate']} req/s",
        "",
        "A third prefill worker joins the cluster for this part (with two, the larger queue "
        "cannot exceed twice the mean). Queue depth = the prefill workers' "
        "`queued_prefill_tokens` (GetStats, every 50 ms). max/mean (mean) = the largest "
        "worker's time-averaged queue over the mean across workers; max/mean (peak) the same "
        "for peak queues. Target: no worker's queue above 2x the mean.",
        "",
        "| policy | TTFT p50 / p90 (ms) | requests per worker | prompt tokens computed per "
        "worker | mean queue per worker | peak queue per worker | max/mean (mean) "
        "| max/mean (peak) |",
        "|" + "---|" * 8,
    ]
    for p, s in report["skew"].items():
        w = s["per_prefill_worker"]
        q = s["queue"]["per_worker"]
        lines.append(
            f"| {p} | {_f(s['ttft_ms']['p50'])} / {_f(s['ttft_ms']['p90'])} "
            f"| {' / '.join(str(v['requests']) for v in w.values())} "
            f"| {' / '.join(str(v['computed_prompt_tokens']) for v in w.values())} "
            f"| {' / '.join(_f(v['mean']) for v in q.values())} "
            f"| {' / '.join(str(v['peak']) for v in q.values())} "
            f"| {_ratio(s['queue']['max_over_mean'])} "
            f"| {_ratio(s['queue']['peak_max_over_mean'])} |"
        )
    lines += ["", f"![routing]({report['plot']})", ""]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--quick", action="store_true", help="small sizes; BENCHMARKS.md untouched")
    p.add_argument(
        "--kv-cache-mb",
        type=int,
        default=DEFAULT_KV_CACHE_MB,
        help="KV cache per worker; other than the default: part (1) only, saved as (1b)",
    )
    p.add_argument(
        "--markdown-only", action="store_true", help="rewrite BENCHMARKS.md from saved results"
    )
    p.add_argument("--log-dir", type=Path, default=Path("/tmp/tandem-bench-routing"))
    args = p.parse_args(argv)
    sizes = QUICK if args.quick else Sizes()
    full = args.kv_cache_mb == DEFAULT_KV_CACHE_MB
    name = "routing-quick" if args.quick else "routing" if full else f"routing-kv{args.kv_cache_mb}"
    RESULTS.mkdir(parents=True, exist_ok=True)
    if not args.markdown_only:
        t0 = time.perf_counter()
        data = run(sizes, args.log_dir, args.kv_cache_mb, skew=full)
        flags = (" --quick" if args.quick else "") + (
            "" if full else f" --kv-cache-mb {args.kv_cache_mb}"
        )
        report = {
            "command": ".venv/bin/python benchmarks/bench_routing.py" + flags,
            "machine": f"{platform.machine()}, {os.cpu_count()} cores, {platform.python_version()}",
            "sizes": asdict(sizes),
            "wall_s": time.perf_counter() - t0,
            "plot": f"benchmarks/results/{name}.png",
            **data,
        }
        if full:
            plot(report, RESULTS / f"{name}.png")
        (RESULTS / f"{name}.json").write_text(json.dumps(report, indent=1) + "\n")
        log(f"done in {report['wall_s']:.0f} s")
    if args.quick:
        return 0
    # The section: the default run, plus the smaller-cache run when one was saved.
    main_report = json.loads((RESULTS / "routing.json").read_text())
    smaller = sorted(RESULTS.glob("routing-kv*.json"))
    md = section_markdown(main_report, json.loads(smaller[0].read_text()) if smaller else None)
    print(md)
    write_markdown_section(BENCHMARKS_MD, SECTION, md)
    log(f"updated '{SECTION}' in {BENCHMARKS_MD}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
