"""Serving benchmarks over gRPC, with real processes: the router's cost on inter-token
latency, and disaggregated vs colocated serving with the same number of workers.

    python benchmarks/bench_serving.py [--quick] [--only overhead|disagg] [--profile-router]
        [--decode-threads 1,2] [--model-dir DIR] [--results-dir DIR] [--no-markdown-file]
        [--replot JSON]

(a) Router overhead. One decode worker, one router with a static `--decode-addresses`
    list (no Redis: nothing else polls in the background). The same closed-loop workload
    (fixed concurrency) goes straight to DecodeWorker.Decode or through the router, in
    rounds whose order flips every round (AB BA AB BA), so a drift of the shared machine's
    speed lands on both modes alike. Every run has its own prompts, so no run hits prefix
    blocks cached by an earlier one. CPU seconds of the router, the worker and this client
    are read from /proc per run. The decode worker runs 1 torch thread, leaving a core to
    the router and the client (as their own host would); `--decode-threads 1,2` adds a
    series where the router's CPU competes with a worker that wants both cores. A series
    ends with one more router run under cProfile when the router misses the target, with
    --profile-router, or as the sizes say (the full run profiles the 1-thread series).
(b) Disaggregated vs colocated, 2 workers each: `tandem up` clusters with 1 prefill + 1
    decode worker and with 2 decode workers, 1 torch thread per worker (2 workers = the
    machine's 2 cores), both started before the first round and alternated the same way,
    on a Poisson mix of long prompts with short outputs and short prompts with long
    outputs. Same seed per round, so both modes get identical arrivals and lengths.

Progress goes to stderr and markdown to stdout; results to <results-dir>/serving.json and
serving.png (`--quick`: serving-quick.*). A complete, non-quick run into the default
results folder rewrites the "## Serving (issue 3)" section of BENCHMARKS.md (and only
that section); `--replot` redraws plot and section from a saved JSON without measuring.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import json
import os
import pstats
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, replace
from functools import partial
from pathlib import Path
from typing import IO, Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # siblings import by name
from loadgen import (
    DecodeTarget,
    RequestClass,
    RequestRecord,
    RouterTarget,
    RunResult,
    Sla,
    Target,
    Workload,
    markdown_table,
    run_workload,
)
from report import (
    BENCHMARKS_MD,
    REPO_ROOT,
    RESULTS_DIR,
    is_default_results_dir,
    machine_info,
    percentile,
    result_path,
    verdict,
    write_json,
    write_markdown_section,
)

from tandem.services.up import Cluster, UpConfig, wait_for_router
from tandem.weights.tiny import make_tiny_model

DEFAULT_MODEL_DIR = REPO_ROOT / ".cache" / "models" / "small"
SECTION = "## Serving (issue 3)"
COMMAND = ".venv/bin/python benchmarks/bench_serving.py"
TARGET_ROUTER_ITL_OVERHEAD = 0.10  # router ITL p50 / direct ITL p50 - 1, at most
KV_CACHE_BYTES = 512 << 20
STALL_MS = 500.0  # an inter-token gap this long is a stall (a prefill or a hand-off in the way)
CLK_TCK = os.sysconf("SC_CLK_TCK")
_START = time.perf_counter()


def log(msg: str) -> None:
    """Progress line on stderr (stdout carries only the markdown report)."""
    print(f"[{time.perf_counter() - _START:7.1f}s] {msg}", file=sys.stderr, flush=True)


@dataclass(frozen=True, slots=True)
class Sizes:
    """Workload sizes of one mode (full or --quick)."""

    # (a) router overhead
    overhead_rounds: int
    overhead_requests: int  # per run
    overhead_concurrency: int
    overhead_prompt_len: tuple[int, int]
    overhead_output_len: tuple[int, int]
    overhead_warmup: int
    overhead_threads: tuple[int, ...]  # torch threads of the decode worker, one series each
    overhead_profile_threads: tuple[int, ...]  # series that end with a profiled router run
    # (b) disaggregated vs colocated
    disagg_rounds: int
    disagg_requests: int  # per run
    disagg_rate: float  # Poisson arrivals, requests/s
    disagg_concurrency: int  # client cap, high enough to stay out of the way
    disagg_classes: tuple[RequestClass, ...]
    disagg_threads: int  # torch threads per worker: 2 workers x this = the machine's cores
    disagg_warmup: int
    sla: Sla


LONG = RequestClass(0.3, (512, 1024), (8, 32), "long prompt, short output")
SHORT = RequestClass(0.7, (16, 48), (128, 256), "short prompt, long output")

FULL = Sizes(
    overhead_rounds=4,
    overhead_requests=12,
    overhead_concurrency=6,
    overhead_prompt_len=(64, 256),
    overhead_output_len=(64, 128),
    overhead_warmup=3,
    overhead_threads=(1,),
    overhead_profile_threads=(1,),
    disagg_rounds=4,
    disagg_requests=12,
    disagg_rate=0.4,
    disagg_concurrency=32,
    disagg_classes=(LONG, SHORT),
    disagg_threads=1,
    disagg_warmup=2,
    sla=Sla(ttft_ms=2500.0, itl_p90_ms=100.0),
)
QUICK = Sizes(
    overhead_rounds=2,
    overhead_requests=4,
    overhead_concurrency=4,
    overhead_prompt_len=(32, 64),
    overhead_output_len=(16, 32),
    overhead_warmup=1,
    overhead_threads=(1,),
    overhead_profile_threads=(),
    disagg_rounds=1,
    disagg_requests=6,
    disagg_rate=2.0,
    disagg_concurrency=16,
    disagg_classes=(
        replace(LONG, prompt_len=(256, 384), output_len=(4, 8)),
        replace(SHORT, output_len=(16, 32)),
    ),
    disagg_threads=1,
    disagg_warmup=1,
    sla=FULL.sla,
)


# -- processes -----------------------------------------------------------------------------


def ensure_model(model_dir: Path) -> Path:
    if (model_dir / "config.json").is_file() and (model_dir / "model.safetensors").is_file():
        return model_dir
    log(f"generating the 'small' preset model into {model_dir}")
    return make_tiny_model(model_dir, preset="small", seed=0, progress=log)


def _die_with_parent() -> None:
    # Between fork and exec: if this benchmark is killed, its servers go with it.
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def cpu_seconds(pid: int) -> float:
    """utime + stime of a process (all its threads) from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


class Server:
    """A service process (`python -m tandem.services.X ...`) that prints `READY <role>
    <address>`."""

    def __init__(
        self, name: str, argv: list[str], log_dir: Path, env: dict[str, str] | None = None
    ) -> None:
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        self._log = open(self.log_path, "w")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [sys.executable, *argv],
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
            cwd=REPO_ROOT,
            preexec_fn=_die_with_parent,
            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
        )
        assert self.proc.stdout is not None
        self.address = self._wait_ready(self.proc.stdout)

    def _wait_ready(self, stdout: IO[str], timeout_s: float = 120.0) -> str:
        found: list[str] = []

        def read() -> None:
            for line in stdout:
                if line.startswith("READY"):
                    found.append(line.split()[-1])
                    return

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        reader.join(timeout_s)
        if not found:
            self.stop()
            raise RuntimeError(f"{self.name} did not start:\n{self.log_path.read_text()[-2000:]}")
        return found[0]

    def cpu_s(self) -> float:
        return cpu_seconds(self.proc.pid)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


@contextlib.contextmanager
def num_threads_env(n: int) -> Iterator[None]:
    """TANDEM_NUM_THREADS for the children `tandem up` spawns (it passes os.environ on)."""
    old = os.environ.get("TANDEM_NUM_THREADS")
    os.environ["TANDEM_NUM_THREADS"] = str(n)
    try:
        yield
    finally:
        if old is None:
            del os.environ["TANDEM_NUM_THREADS"]
        else:
            os.environ["TANDEM_NUM_THREADS"] = old


# -- (a) router overhead -------------------------------------------------------------------


DIRECT, ROUTER = "direct", "router"


def _run_with_cpu(
    target_factory: Callable[[], Target], workload: Workload, pids: dict[str, int]
) -> tuple[RunResult, dict[str, float]]:
    """One run in a fresh event loop, with the CPU seconds each process spent during it."""

    async def go() -> RunResult:
        target: Target = target_factory()
        try:
            return await run_workload(target, workload)
        finally:
            await target.close()

    before = {name: cpu_seconds(pid) for name, pid in pids.items()}
    client0 = time.process_time()
    result = asyncio.run(go())
    cpu = {name: cpu_seconds(pid) - before[name] for name, pid in pids.items()}
    cpu["client"] = time.process_time() - client0
    return result, cpu


def bench_overhead(
    model_dir: Path, sizes: Sizes, threads: int, log_dir: Path, profile: bool
) -> dict[str, Any]:
    log(f"(a) router overhead, decode worker with {threads} torch thread(s)")
    decode = Server(
        f"overhead-decode-t{threads}",
        [
            "-m",
            "tandem.services.decode",
            "--model-dir",
            str(model_dir),
            "--port",
            "0",
            "--transport",
            "local",  # no KV ever moves here; skip the NIXL agent
            "--kv-cache-bytes",
            str(KV_CACHE_BYTES),
            "--num-threads",
            str(threads),
        ],
        log_dir,
    )
    router_argv = [
        "-m",
        "tandem.services.router",
        "--model-dir",
        str(model_dir),
        "--port",
        "0",
        "--decode-addresses",
        decode.address,
    ]
    router = Server(f"overhead-router-t{threads}", router_argv, log_dir)
    log(f"decode worker {decode.address}, router {router.address}")
    workload = Workload(
        classes=(RequestClass(1.0, sizes.overhead_prompt_len, sizes.overhead_output_len),),
        num_requests=sizes.overhead_requests,
        rate=0.0,
        concurrency=sizes.overhead_concurrency,
        seed=1,
    )
    factories: dict[str, Callable[[], Target]] = {
        DIRECT: partial(DecodeTarget, decode.address),
        ROUTER: partial(RouterTarget, router.address),
    }
    pids = {"router": router.proc.pid, "decode": decode.proc.pid}
    salt = threads * 1000
    rounds: list[dict[str, Any]] = []
    results: dict[str, list[RunResult]] = {DIRECT: [], ROUTER: []}
    try:
        for mode in (DIRECT, ROUTER):  # warm both paths (channels, allocator, caches)
            salt += 1
            warm = replace(workload, num_requests=sizes.overhead_warmup, prompt_salt=salt)
            _run_with_cpu(factories[mode], warm, pids)
        for rnd in range(sizes.overhead_rounds):
            order = (DIRECT, ROUTER) if rnd % 2 == 0 else (ROUTER, DIRECT)
            row: dict[str, Any] = {"round": rnd, "order": list(order)}
            for mode in order:
                salt += 1
                res, cpu = _run_with_cpu(factories[mode], replace(workload, prompt_salt=salt), pids)
                results[mode].append(res)
                row[mode] = _overhead_run_stats(res, cpu, sizes.sla)
            row["itl_p50_ratio"] = row[ROUTER]["itl_ms"]["p50"] / row[DIRECT]["itl_ms"]["p50"]
            rounds.append(row)
            log(
                f"round {rnd}: ITL p50 direct {row[DIRECT]['itl_ms']['p50']:.2f} ms, "
                f"router {row[ROUTER]['itl_ms']['p50']:.2f} ms, ratio {row['itl_p50_ratio']:.3f}; "
                f"router CPU {row[ROUTER]['router_cpu_us_per_msg']:.0f} us/msg"
            )
        overall = {
            mode: _overhead_run_stats(
                RunResult.concat(results[mode]),
                {k: sum(r[mode]["cpu_s"][k] for r in rounds) for k in rounds[0][mode]["cpu_s"]},
                sizes.sla,
            )
            for mode in (DIRECT, ROUTER)
        }
        ratios = [r["itl_p50_ratio"] for r in rounds]
        pooled = overall[ROUTER]["itl_ms"]["p50"] / overall[DIRECT]["itl_ms"]["p50"]
        out: dict[str, Any] = {
            "decode_threads": threads,
            "workload": asdict(workload),
            "rounds": rounds,
            "overall": overall,
            "itl_p50_ratio_pooled": pooled,
            "itl_p50_ratio_median_of_rounds": statistics.median(ratios),
            "itl_p50_overhead": pooled - 1.0,
            "target_overhead": TARGET_ROUTER_ITL_OVERHEAD,
            "meets_target": pooled - 1.0 <= TARGET_ROUTER_ITL_OVERHEAD,
            "itl_dist": {m: _dist_ms(RunResult.concat(results[m]).itls()) for m in results},
        }
        log(
            f"overall ITL p50 router/direct {pooled:.3f} (median of rounds "
            f"{statistics.median(ratios):.3f}); target <= {1 + TARGET_ROUTER_ITL_OVERHEAD:.2f}"
        )
        if profile or not out["meets_target"] or threads in sizes.overhead_profile_threads:
            router.stop()
            out["router_profile"] = profile_router(
                router_argv, log_dir, threads, replace(workload, prompt_salt=salt + 1), decode
            )
        return out
    finally:
        router.stop()
        decode.stop()


def _overhead_run_stats(res: RunResult, cpu: dict[str, float], sla: Sla) -> dict[str, Any]:
    s = res.summary(sla)
    # The router relays every chunk and one completion per request.
    messages = s["num_chunks"] + s["num_ok"]
    keep = ("ttft_ms", "itl_ms", "e2e_ms", "throughput_tok_s", "num_ok", "num_failed")
    return {
        **{k: s[k] for k in keep},
        "tokens_per_chunk": s["tokens_per_chunk"],
        "messages": messages,
        "cpu_s": cpu,
        "router_cpu_us_per_msg": cpu["router"] / max(1, messages) * 1e6,
        "decode_cpu_s_per_token": cpu["decode"] / max(1, s["output_tokens"]),
    }


# The router as `python -m tandem.services.router` runs it, with cProfile on only while it serves:
# module imports and tokenizer loading would otherwise dominate a short profile.
_PROFILED_ROUTER = """
import asyncio, cProfile, signal, sys, time
from tandem.services.common.runtime.flags import parse_config
from tandem.services.router.server import RouterConfig, RouterServer

async def main(path, config):
    server = RouterServer(config)
    await server.start()
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    print("READY router", server.address, flush=True)
    prof = cProfile.Profile(time.thread_time)  # CPU of the event loop's thread, not waits
    prof.enable()
    await stop.wait()
    prof.disable()
    prof.dump_stats(path)
    await server.stop()

asyncio.run(main(sys.argv[1], parse_config(RouterConfig, sys.argv[2:])))
"""


def profile_router(
    router_argv: list[str], log_dir: Path, threads: int, workload: Workload, decode: Server
) -> dict[str, Any]:
    """One router run with the router under cProfile: where its CPU goes per message."""
    prof_path = log_dir / f"router-t{threads}.prof"
    log(f"profiling the router (cProfile -> {prof_path})")
    flags = router_argv[router_argv.index("tandem.services.router") + 1 :]
    router = Server(
        f"profiled-router-t{threads}",
        ["-c", _PROFILED_ROUTER, str(prof_path), *flags],
        log_dir,
    )
    try:
        res, cpu = _run_with_cpu(
            lambda: RouterTarget(router.address),
            workload,
            {"router": router.proc.pid, "decode": decode.proc.pid},
        )
    finally:
        router.stop()  # SIGTERM: the profile is written, then the router stops
    messages = sum(r.num_chunks for r in res.records) + len(res.records)
    stats = pstats.Stats(str(prof_path))
    total = stats.total_tt  # type: ignore[attr-defined]
    rows = []
    layers: dict[str, float] = {}
    for (file, line, func), (_cc, ncalls, tt, ct, _callers) in stats.stats.items():  # type: ignore[attr-defined]
        layer = _layer(file, func)
        layers[layer] = layers.get(layer, 0.0) + tt
        rows.append(
            {
                "function": f"{Path(file).name}:{line}({func})",
                "layer": layer,
                "calls": ncalls,
                "tottime_s": tt,
                "cumtime_s": ct,
                "tottime_us_per_msg": tt / messages * 1e6,
            }
        )
    rows.sort(key=lambda r: -r["tottime_s"])
    per_msg = {k: v / messages * 1e6 for k, v in sorted(layers.items(), key=lambda kv: -kv[1])}
    log(
        f"profiled run: {messages} messages; router process CPU {cpu['router']:.2f} s "
        f"({cpu['router'] / messages * 1e6:.0f} us/msg, profiler included); event-loop "
        f"thread CPU seen by cProfile {total:.2f} s ({total / messages * 1e6:.0f} us/msg)"
    )
    log("  by layer (us/msg): " + ", ".join(f"{k} {v:.0f}" for k, v in per_msg.items()))
    for r in rows[:10]:
        log(f"  {r['tottime_us_per_msg']:7.1f} us/msg  {r['calls']:>7}  {r['function']}")
    return {
        "messages": messages,
        "router_cpu_s": cpu["router"],
        "router_cpu_us_per_msg": cpu["router"] / messages * 1e6,
        "profiled_thread_cpu_s": total,
        "profiled_us_per_msg": total / messages * 1e6,
        "us_per_msg_by_layer": per_msg,
        "top_by_tottime": rows[:25],
    }


def _layer(file: str, func: str) -> str:
    """Coarse owner of a profiled function, to say where the router's time goes."""
    if file == "~":
        # C functions. Context.run's own time is the Cython gRPC core (cygrpc) that its
        # callbacks execute: no Python frames of their own.
        return "grpc cython (in callbacks)" if "_contextvars.Context" in func else "other C"
    if "/services/router/" in file:
        return "router handler"
    if "/grpc/" in file:
        return "grpc python"
    if "/asyncio/" in file or file.endswith("selectors.py"):
        return "asyncio"
    if "/google/protobuf/" in file:
        return "protobuf"
    return "other python"


# Quantiles kept per distribution: every percent, then finer into the tail, where the
# stalls are (a few tokens in thousands).
_QS = [*range(100), *(99 + i / 10 for i in range(1, 10)), *(99.9 + i / 100 for i in range(1, 11))]


def _dist_ms(values: Sequence[float]) -> dict[str, Any]:
    """A distribution as quantiles (ms), enough to plot its CDF and its tail."""
    return {"n": len(values), "q": _QS, "ms": [percentile(values, q) * 1e3 for q in _QS]}


# -- (b) disaggregated vs colocated ----------------------------------------------------------


DISAGG, COLOC = "disaggregated 1P+1D", "colocated 2D"


def bench_disagg(model_dir: Path, sizes: Sizes, log_dir: Path) -> dict[str, Any]:
    log(
        f"(b) disaggregated vs colocated: starting both clusters "
        f"({sizes.disagg_threads} torch thread(s) per worker)"
    )
    configs = {
        DISAGG: UpConfig(
            model_dir=str(model_dir),
            port=0,
            http_port=0,
            num_prefill=1,
            num_decode=1,
            transport="nixl",
            kv_cache_bytes=KV_CACHE_BYTES,
            run_dir=str(log_dir / "disagg"),
        ),
        COLOC: UpConfig(
            model_dir=str(model_dir),
            port=0,
            http_port=0,
            num_prefill=0,
            num_decode=2,
            transport="nixl",
            kv_cache_bytes=KV_CACHE_BYTES,
            run_dir=str(log_dir / "coloc"),
        ),
    }
    clusters = {mode: Cluster(cfg) for mode, cfg in configs.items()}
    # Each cluster lives on its own thread from start to stop: its children die with the
    # thread that forked them (PR_SET_PDEATHSIG is per thread), and starting both at once
    # halves the wait, which is mostly model loading.
    owners = [_ClusterOwner(c) for c in clusters.values()]
    try:
        with num_threads_env(sizes.disagg_threads):
            for o in owners:
                o.thread.start()
            for o in owners:
                o.ready.wait()
        for o in owners:
            if o.error is not None:
                raise o.error
        for mode, c in clusters.items():
            log(f"{mode}: router {c.router_address}, {[ch.name for ch in c.children]}")
        return _disagg_rounds(clusters, sizes)
    finally:
        for o in owners:
            o.stop.set()
        for o in owners:
            o.thread.join()


class _ClusterOwner:
    """A thread that starts a cluster, holds it until `stop` is set, then stops it."""

    def __init__(self, cluster: Cluster) -> None:
        self.cluster = cluster
        self.ready = threading.Event()
        self.stop = threading.Event()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name="cluster-owner")

    def _run(self) -> None:
        try:
            self.cluster.start()
            wait_for_router(self.cluster.router_address)
        except BaseException as exc:  # re-raised on the main thread
            self.error = exc
        self.ready.set()
        self.stop.wait()
        self.cluster.stop()


def _disagg_rounds(clusters: dict[str, Cluster], sizes: Sizes) -> dict[str, Any]:
    workload = Workload(
        classes=sizes.disagg_classes,
        num_requests=sizes.disagg_requests,
        rate=sizes.disagg_rate,
        concurrency=sizes.disagg_concurrency,
    )
    modes = (COLOC, DISAGG)
    pids = {
        mode: {ch.name: ch.proc.pid for ch in c.children if ch.name != "redis"}
        for mode, c in clusters.items()
    }
    for i, mode in enumerate(modes):
        warm = replace(workload, num_requests=sizes.disagg_warmup, rate=0.0, prompt_salt=-1 - i)
        addr = clusters[mode].router_address
        _run_with_cpu(partial(RouterTarget, addr), warm, pids[mode])
    rounds: list[dict[str, Any]] = []
    results: dict[str, list[RunResult]] = {m: [] for m in modes}
    cpus: dict[str, list[dict[str, float]]] = {m: [] for m in modes}
    requests: dict[str, list[dict[str, Any]]] = {m: [] for m in modes}
    for rnd in range(sizes.disagg_rounds):
        order = modes if rnd % 2 == 0 else modes[::-1]
        row: dict[str, Any] = {"round": rnd, "order": list(order)}
        for mode in order:
            # Same seed: both modes see the same arrivals and lengths in a round; the salt
            # keeps every run's prompts new to the workers' prefix caches.
            wl = replace(workload, seed=100 + rnd, prompt_salt=len(rounds) * 10 + len(row))
            addr = clusters[mode].router_address
            res, cpu = _run_with_cpu(partial(RouterTarget, addr), wl, pids[mode])
            results[mode].append(res)
            cpus[mode].append(cpu)
            requests[mode] += [_request_row(rnd, r, sizes.sla) for r in res.records]
            s = res.summary(sizes.sla)
            row[mode] = _disagg_brief(s, cpu)
            log(
                f"round {rnd} {mode}: ITL p50/p99 {s['itl_ms']['p50']:.1f}/"
                f"{s['itl_ms']['p99']:.1f} ms, TTFT p50 {s['ttft_ms']['p50']:.0f} ms, goodput "
                f"{s['goodput_req_s']:.2f} req/s ({s['sla_met']}/{s['num_requests']}), "
                f"failed {s['num_failed']}"
            )
        rounds.append(row)
    overall = {}
    for mode in modes:
        s = RunResult.concat(results[mode]).summary(sizes.sla)
        cpu = {k: sum(c[k] for c in cpus[mode]) for k in cpus[mode][0]}
        overall[mode] = {
            **s,
            "cpu_s": cpu,
            "cpu_util": {k: v / s["window_s"] for k, v in cpu.items()},
        }
    return {
        "workload": asdict(workload),
        "sla": asdict(sizes.sla),
        "worker_threads": sizes.disagg_threads,
        "rounds": rounds,
        "overall": overall,
        "itl_p99_ratio_disagg_over_coloc": overall[DISAGG]["itl_ms"]["p99"]
        / overall[COLOC]["itl_ms"]["p99"],
        "goodput_ratio_disagg_over_coloc": overall[DISAGG]["goodput_req_s"]
        / max(1e-9, overall[COLOC]["goodput_req_s"]),
        "itl_dist": {m: _dist_ms(RunResult.concat(results[m]).itls()) for m in modes},
        "requests": requests,
        "itl_dist_by_kind": {
            m: {
                k: _dist_ms(RunResult.concat(results[m]).itls(k))
                for k in (c.label for c in sizes.disagg_classes)
            }
            for m in modes
        },
    }


def _request_row(rnd: int, r: RequestRecord, sla: Sla) -> dict[str, Any]:
    """One request of part (b), small enough to keep them all in the JSON."""
    return {
        "round": rnd,
        "kind": r.kind,
        "prompt_tokens": r.prompt_tokens,
        "output_tokens": r.output_tokens,
        "send_s": round(r.send_s, 4),
        "ttft_ms": round(r.ttft_s * 1e3, 2),
        "second_token_gap_ms": round(r.itls_s[0] * 1e3, 2) if r.itls_s else None,
        "itl_p90_ms": round(r.itl_p90() * 1e3, 2),
        "itl_max_ms": round(max(r.itls_s, default=0.0) * 1e3, 2),
        "e2e_ms": round(r.e2e_s * 1e3, 2),
        "met_sla": sla.met(r),
        "error": r.error,
        **r.info,
    }


def _disagg_brief(s: dict[str, Any], cpu: dict[str, float]) -> dict[str, Any]:
    keep = (
        "num_ok",
        "num_failed",
        "window_s",
        "ttft_ms",
        "itl_ms",
        "e2e_ms",
        "throughput_tok_s",
        "goodput_req_s",
        "sla_met",
        "disaggregated_fraction",
    )
    return {**{k: s[k] for k in keep}, "cpu_s": cpu}


# -- report --------------------------------------------------------------------------------


def machine_extra() -> dict[str, Any]:
    """This script's fields of the results' `machine` (report.machine_info)."""
    import torch

    return {"torch_version": torch.__version__}


def overhead_markdown(o: dict[str, Any]) -> str:
    lines = [
        f"Decode worker with {o['decode_threads']} torch thread(s); closed loop, "
        f"{o['workload']['concurrency']} requests in flight, "
        f"{o['workload']['num_requests']} requests per run.",
        "",
        "| round | order | ITL p50 direct (ms) | ITL p50 router (ms) | router / direct "
        "| TTFT p50 direct / router (ms) | router CPU per message (us) |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in o["rounds"]:
        d, rt = r[DIRECT], r[ROUTER]
        lines.append(
            f"| {r['round']} | {' then '.join(r['order'])} | {d['itl_ms']['p50']:.2f} "
            f"| {rt['itl_ms']['p50']:.2f} | {r['itl_p50_ratio']:.3f} "
            f"| {d['ttft_ms']['p50']:.0f} / {rt['ttft_ms']['p50']:.0f} "
            f"| {rt['router_cpu_us_per_msg']:.0f} |"
        )
    d, rt = o["overall"][DIRECT], o["overall"][ROUTER]
    lines += [
        "",
        "| all rounds | ITL p50 / p90 / p99 (ms) | TTFT p50 / p99 (ms) | out tok/s "
        "| CPU s: decode / router / client |",
        "|---|---|---|---|---|",
    ]
    for mode, s in ((DIRECT, d), (ROUTER, rt)):
        i, t, c = s["itl_ms"], s["ttft_ms"], s["cpu_s"]
        lines.append(
            f"| {mode} | {i['p50']:.2f} / {i['p90']:.2f} / {i['p99']:.2f} "
            f"| {t['p50']:.0f} / {t['p99']:.0f} | {s['throughput_tok_s']:.1f} "
            f"| {c['decode']:.1f} / {c['router']:.2f} / {c['client']:.2f} |"
        )
    lines += [
        "",
        f"Router / direct ITL p50: **{o['itl_p50_ratio_pooled']:.3f}** pooled over all rounds "
        f"(median of per-round ratios {o['itl_p50_ratio_median_of_rounds']:.3f}); "
        f"{verdict(o['meets_target'], 'meets', 'misses')} the target of "
        f"<= {1 + o['target_overhead']:.2f}. "
        f"Router CPU: {rt['router_cpu_us_per_msg']:.0f} us per relayed message "
        f"({rt['tokens_per_chunk']:.2f} tokens per message).",
    ]
    prof = o.get("router_profile")
    if prof:
        layers = ", ".join(f"{k} {v:.0f}" for k, v in prof["us_per_msg_by_layer"].items())
        lines += [
            "",
            f"Router under cProfile (CPU time of its event-loop thread, one extra run of "
            f"{prof['messages']} messages; the profiler inflates it to "
            f"{prof['profiled_us_per_msg']:.0f} us/msg): per message, {layers} us.",
        ]
    return "\n".join(lines)


def disagg_markdown(b: dict[str, Any]) -> str:
    sla = b["sla"]
    rows = [(mode, s) for mode, s in b["overall"].items()]
    lines = [
        f"SLA: TTFT <= {sla['ttft_ms']:.0f} ms and the request's own ITL p90 <= "
        f"{sla['itl_p90_ms']:.0f} ms. Poisson arrivals at {b['workload']['rate']} req/s, "
        f"{b['workload']['num_requests']} requests per run, {len(b['rounds'])} run(s) per mode, "
        f"{b['worker_threads']} torch thread(s) per worker.",
        "",
        markdown_table(rows),
        "",
        "| mode | request kind | reqs | met SLA | TTFT p50 / p99 (ms) | ITL p50 / p99 / max (ms) "
        "| token 1 -> 2 gap p50 / p99 (ms) |",
        "|---|---|---|---|---|---|---|",
    ]
    for mode, s in rows:
        for kind, k in s["by_kind"].items():
            lines.append(
                f"| {mode} | {kind} | {k['num_requests']} | {k['sla_met']} "
                f"| {k['ttft_ms']['p50']:.0f} / {k['ttft_ms']['p99']:.0f} "
                f"| {k['itl_ms']['p50']:.1f} / {k['itl_ms']['p99']:.1f} / {k['itl_ms']['max']:.0f} "
                f"| {k['second_token_gap_ms']['p50']:.0f} "
                f"/ {k['second_token_gap_ms']['p99']:.0f} |"
            )
    lines += [
        "",
        "| mode | CPU utilization (cores) per process |",
        "|---|---|",
    ]
    for mode, s in rows:
        util = ", ".join(f"{k} {v:.2f}" for k, v in s["cpu_util"].items())
        lines.append(f"| {mode} | {util} |")
    stalls = []
    for mode, reqs in b.get("requests", {}).items():
        worst = max((r["itl_max_ms"] for r in reqs), default=0.0)
        n = sum(1 for r in reqs if r["itl_max_ms"] > STALL_MS)
        stalls.append(f"{mode} {n}/{len(reqs)} (worst {worst:.0f} ms)")
    if stalls:
        # A single stalled token hides below a request's ITL p90 and the pooled p99, so
        # count the requests that saw one.
        lines += ["", f"Requests with an inter-token gap > {STALL_MS:.0f} ms: " + ", ".join(stalls)]
    lines += [
        "",
        f"Disaggregated / colocated: ITL p99 **{b['itl_p99_ratio_disagg_over_coloc']:.2f}x**, "
        f"goodput **{b['goodput_ratio_disagg_over_coloc']:.2f}x**.",
    ]
    return "\n".join(lines)


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter, ScalarFormatter

    panels: list[tuple[str, dict[str, Any], str]] = []
    for o in report.get("overhead", []):
        title = f"(a) router overhead: decode worker, {o['decode_threads']} thread(s)"
        panels.append((title, o, "cdf"))
    if "disagg" in report:
        panels.append(("(b) ITL tail, 2 workers each", report["disagg"], "tail"))
        panels.append(("(b) throughput and goodput", report["disagg"], "bars"))
    if not panels:
        return
    fig, axes = plt.subplots(1, len(panels), figsize=(5.2 * len(panels), 4.2), squeeze=False)
    for ax, (title, data, kind) in zip(axes[0], panels, strict=True):
        ax.set_title(title, fontsize=10)
        ax.grid(alpha=0.3)
        if kind == "bars":
            _goodput_bars(ax, data)
            continue
        dists = data["itl_dist"]
        if kind == "cdf":
            for mode, d in dists.items():
                ax.plot(d["ms"], [q / 100 for q in d["q"]], label=mode)
            # The router's cost shows in the body of the distribution; cut the far tail.
            ax.set_xlim(0, max(percentile(d["ms"][:100], 97) for d in dists.values()))
            ax.set_xlabel("inter-token latency (ms)")
            ax.set_ylabel("fraction of tokens")
            ax.axhline(0.5, color="grey", lw=0.6, ls=":")
        else:
            # Complementary CDF on log-log axes: the stalls are a fraction of a percent of
            # the tokens and would be invisible on a CDF.
            for mode, d in dists.items():
                # Beyond 1 - 1/n the quantiles only repeat the maximum: the curve ends there.
                keep = [i for i, q in enumerate(d["q"]) if 1 - q / 100 > 1 / d["n"]]
                xs = [d["ms"][i] for i in keep]
                ys = [1 - d["q"][i] / 100 for i in keep]
                ax.plot([*xs, d["ms"][-1]], [*ys, 1 / d["n"]], label=mode)
            ax.set_xscale("log")
            ax.set_yscale("log")
            hi = max(d["ms"][-1] for d in dists.values())
            ax.set_xlim(5, hi * 1.5)
            ticks = [t for t in (5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000) if t <= hi * 1.5]
            ax.set_xticks(ticks)
            ax.xaxis.set_major_formatter(ScalarFormatter())
            ax.xaxis.set_minor_formatter(NullFormatter())
            ax.axvline(STALL_MS, color="grey", lw=0.6, ls=":")
            ax.set_xlabel("inter-token latency x (ms, log scale)")
            ax.set_ylabel("fraction of tokens with ITL > x")
        ax.legend(fontsize=8, loc="lower left" if kind == "tail" else "lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _goodput_bars(ax: Any, data: dict[str, Any]) -> None:
    modes = list(data["overall"])
    xs = list(range(len(modes)))
    rate = [data["overall"][m]["request_rate"] for m in modes]
    goodput = [data["overall"][m]["goodput_req_s"] for m in modes]
    ax.bar([x - 0.2 for x in xs], rate, width=0.4, label="completed req/s", color="lightgray")
    ax.bar([x + 0.2 for x in xs], goodput, width=0.4, label="goodput req/s (met SLA)")
    for x, m in zip(xs, modes, strict=True):
        s = data["overall"][m]
        reqs = data.get("requests", {}).get(m, [])
        stalls = sum(1 for r in reqs if r["itl_max_ms"] > STALL_MS)
        ax.annotate(
            f"met SLA {s['sla_met']}/{s['num_requests']}\nITL p99 {s['itl_ms']['p99']:.0f} ms\n"
            f"stalls > {STALL_MS:.0f} ms: {stalls}",
            (x, max(rate) * 0.05),
            ha="center",
            fontsize=8,
            bbox={"facecolor": "white", "alpha": 0.8, "lw": 0},
        )
    sla = data["sla"]
    ax.set_xticks(xs, modes, fontsize=8)
    ax.set_ylabel("requests/s")
    ax.set_ylim(0, max(rate) * 1.35)
    ax.set_title(
        f"(b) goodput: TTFT <= {sla['ttft_ms']:.0f} ms, ITL p90 <= {sla['itl_p90_ms']:.0f} ms",
        fontsize=10,
    )
    ax.legend(fontsize=8, loc="upper left")


def section_markdown(report: dict[str, Any], notes: str) -> str:
    parts = [
        SECTION,
        "",
        f"`{COMMAND}` ({report['duration_s']:.0f} s on a {report['machine']['cpu_count']}-core "
        f"box, {report['machine']['date']}, commit {report['machine']['git_commit']}; "
        "`--quick` is a < 1 min smoke run). Results: `benchmarks/results/serving.json`. "
        "Load generator: `benchmarks/loadgen.py` (usable on its own against any router or "
        "decode worker). Client-side timings; ITL = gap between chunks / tokens in the chunk.",
        "",
        "![serving](benchmarks/results/serving.png)",
        "",
    ]
    for o in report.get("overhead", []):
        parts += ["### Router overhead", "", overhead_markdown(o), ""]
    if "disagg" in report:
        parts += [
            "### Disaggregated vs colocated (2 workers each)",
            "",
            disagg_markdown(report["disagg"]),
            "",
        ]
    if notes:
        parts += [notes, ""]
    return "\n".join(parts)


# -- main ----------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--quick", action="store_true", help="smoke run, < 1 min")
    p.add_argument("--only", choices=("overhead", "disagg"))
    p.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL_DIR)
    p.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    p.add_argument("--profile-router", action="store_true", help="always profile the router")
    p.add_argument(
        "--decode-threads",
        type=lambda raw: tuple(int(x) for x in raw.split(",")),
        help="(a): torch threads of the decode worker, one series each (e.g. 1,2)",
    )
    p.add_argument("--notes", type=Path, help="markdown appended to the BENCHMARKS.md section")
    p.add_argument("--no-markdown-file", action="store_true", help="leave BENCHMARKS.md alone")
    p.add_argument(
        "--replot", type=Path, help="only redraw the plot and the section from this JSON"
    )
    args = p.parse_args(argv)
    if args.replot:
        # Redraw from a saved run (e.g. after adding notes), without measuring anything.
        saved = json.loads(args.replot.read_text())
        plot(saved, args.replot.with_suffix(".png"))
        body = section_markdown(saved, args.notes.read_text() if args.notes else "")
        print(body)
        if (
            args.replot.resolve() == result_path(RESULTS_DIR, "serving")
            and not args.no_markdown_file
        ):
            write_markdown_section(BENCHMARKS_MD, SECTION, body)
        return 0
    sizes = QUICK if args.quick else FULL
    if args.decode_threads:
        sizes = replace(sizes, overhead_threads=args.decode_threads)
    model_dir = ensure_model(args.model_dir)
    args.results_dir.mkdir(parents=True, exist_ok=True)
    log_dir = Path(tempfile.mkdtemp(prefix="tandem-bench-serving-"))
    log(f"server logs in {log_dir}")
    report: dict[str, Any] = {
        "benchmark": "serving",
        "quick": args.quick,
        "command": " ".join([COMMAND, *(argv if argv is not None else sys.argv[1:])]),
        "machine": machine_info(**machine_extra()),
        "sizes": asdict(sizes),
        "model_dir": str(model_dir),
    }
    if args.only in (None, "overhead"):
        report["overhead"] = [
            bench_overhead(model_dir, sizes, t, log_dir, args.profile_router)
            for t in sizes.overhead_threads
        ]
    if args.only in (None, "disagg"):
        report["disagg"] = bench_disagg(model_dir, sizes, log_dir)
    report["duration_s"] = time.perf_counter() - _START
    suffix = "-quick" if args.quick else ""
    json_path = result_path(args.results_dir, "serving", suffix)
    png_path = result_path(args.results_dir, "serving", suffix, "png")
    write_json(json_path, report, indent=1)
    plot(report, png_path)
    log(f"wrote {json_path} and {png_path}")
    notes = args.notes.read_text() if args.notes else ""
    body = section_markdown(report, notes)
    print(body)
    # Only a complete run into the default results folder may stand for the section.
    if (
        not args.quick
        and not args.only
        and is_default_results_dir(args.results_dir)
        and not args.no_markdown_file
    ):
        write_markdown_section(BENCHMARKS_MD, SECTION, body)
        log(f"updated the '{SECTION}' section of {BENCHMARKS_MD}")
    failed = sum(
        o["overall"][m]["num_failed"] for o in report.get("overhead", []) for m in (DIRECT, ROUTER)
    )
    if "disagg" in report:
        failed += sum(s["num_failed"] for s in report["disagg"]["overall"].values())
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
