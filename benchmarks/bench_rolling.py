"""Zero-failure operations (issue 46): a rolling restart of every worker under mixed load, and
the only decode worker killed under load, on `tandem up` (real processes).

    .venv/bin/python benchmarks/bench_rolling.py rolling [--load-s 20] [--concurrency 6]
    .venv/bin/python benchmarks/bench_rolling.py decode-kill [--concurrency 6]

rolling      1 prefill + 2 decode workers. Mixed load (concurrent streams, prompts of 20-400
             tokens, 32-160 output tokens, greedy) runs --load-s seconds undisturbed, then
             while every worker in turn is SIGTERMed -- it drains (a prefill worker serves
             its pending hand-offs' KV; a decode worker moves its streams with their KV to
             the other) and `tandem up` restarts it -- each next one only once the last is
             back. Reports failed requests, re-prefilled hand-offs, moved and migrated
             streams, and TTFT / ITL percentiles before vs during.
decode-kill  1 prefill + 1 decode worker. Under the same load the decode worker is SIGKILLed
             once; the router holds its streams (--stream-hold-s) until `tandem up` has
             restarted it, then resumes them. Reports streams resumed vs failed and the
             longest gap between two tokens of each resumed stream (the added latency).

The model is the generated `tiny` preset (the figures are about failures and latency under
faults, not speed). Writes benchmarks/results/rolling.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from itertools import pairwise
from pathlib import Path

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent))

from tandem.client import AsyncTandemClient, Result, TandemError  # noqa: E402
from tandem.services.up import Cluster, UpConfig, wait_for_router  # noqa: E402
from tandem.weights.tiny import make_tiny_model  # noqa: E402

RESULTS = ROOT / "results" / "rolling.json"


@dataclass
class Stream:
    """One request's outcome and timing (perf_counter seconds)."""

    t_start: float
    token_times: list[float] = field(default_factory=list)
    result: Result | None = None
    error: str = ""


async def one(address: str, rng: random.Random, out: list[Stream]) -> None:
    s = Stream(time.perf_counter())
    out.append(s)
    prompt = rng.choices(range(5, 500), k=rng.randint(20, 400))
    result = Result()
    try:
        async with AsyncTandemClient(address, timeout_s=120) as client:
            async for chunk in client.stream(
                prompt, result=result, max_tokens=rng.randint(32, 160), temperature=0.0,
                ignore_eos=True,
            ):  # fmt: skip
                s.token_times += [time.perf_counter()] * len(chunk.token_ids)
        s.result = result
    except TandemError as exc:
        s.error = f"{exc.code.name}: {exc.message}"


async def load(address: str, concurrency: int, stop: asyncio.Event, out: list[Stream]) -> None:
    """`concurrency` clients, each sending one request after another until `stop`."""

    async def client(i: int) -> None:
        rng = random.Random(i)
        while not stop.is_set():
            await one(address, rng, out)

    await asyncio.gather(*(client(i) for i in range(concurrency)))


def pct(values: list[float], q: int) -> float:
    """The q-th percentile of `values` (seconds) in ms."""
    if len(values) < 2:
        return round(values[0] * 1e3, 1) if values else float("nan")
    return round(statistics.quantiles(values, n=100)[q - 1] * 1e3, 1)


def latency(streams: list[Stream]) -> dict[str, float]:
    ttft = [s.token_times[0] - s.t_start for s in streams if s.token_times]
    itl = [b - a for s in streams for a, b in pairwise(s.token_times) if b > a]
    return {"requests": len(streams), "ttft_p50_ms": pct(ttft, 50), "ttft_p90_ms": pct(ttft, 90),
            "itl_p50_ms": pct(itl, 50), "itl_p99_ms": pct(itl, 99)}  # fmt: skip


def outcomes(streams: list[Stream]) -> dict[str, object]:
    done = [s.result for s in streams if s.result is not None]
    lines = [line for r in done for line in r.recoveries]
    errors = sorted({s.error[:160] for s in streams if s.error})
    return {
        "errors": errors[:5],  # the distinct failures (first 5)
        "recovery_kinds": sorted({line.split(";")[0][:120] for line in lines}),
        "failed": sum(1 for s in streams if s.error),
        "completed": len(done),
        # a draining decode worker's hand-off continued elsewhere (a stream may move twice)
        "moves_with_kv": sum("decode_moved" in line and ": migrate" in line for line in lines),
        "held": sum(": hold" in line for line in lines),  # waited for a decode worker
        "migrated": sum(r.migrations for r in done),
        "reprefilled": sum(r.reprefills for r in done),
        "recomputed_on_decode": sum(
            line.startswith("kv_pull_failed") and "recompute" in line for line in lines
        ),  # fmt: skip
    }


def start(model: Path, run: Path, num_decode: int) -> Cluster:
    config = UpConfig(
        model_dir=str(model), run_dir=str(run), port=0, http_port=0, dtype="float32",
        num_decode=num_decode, disagg_min_uncached_tokens=32, restart_backoff_s=0.1,
        restart_max_backoff_s=0.2,
    )  # fmt: skip
    cluster = Cluster(config)
    cluster.start()
    wait_for_router(cluster.router_address)
    return cluster


def back(cluster: Cluster, name: str, old_pid: int, timeout_s: float = 120) -> None:
    """Wait until `tandem up` has restarted `name` and it printed its ready line."""
    deadline = time.monotonic() + timeout_s
    while True:
        [child] = [c for c in cluster.children if c.name == name]
        if (
            child.proc.pid != old_pid
            and child.proc.poll() is None
            and name not in getattr(cluster, "_recovering", {})
        ):
            return
        if time.monotonic() > deadline:
            raise SystemExit(f"{name} did not come back within {timeout_s:.0f} s")
        time.sleep(0.2)


async def run_phases(cluster: Cluster, args: argparse.Namespace, disturb) -> dict:  # type: ignore[no-untyped-def]
    before: list[Stream] = []
    stop = asyncio.Event()
    task = asyncio.create_task(load(cluster.router_address, args.concurrency, stop, before))
    await asyncio.sleep(args.load_s)
    stop.set()
    await task
    during: list[Stream] = []
    stop = asyncio.Event()
    task = asyncio.create_task(load(cluster.router_address, args.concurrency, stop, during))
    await asyncio.sleep(2.0)
    events = await asyncio.to_thread(disturb)
    await asyncio.sleep(3.0)
    stop.set()
    await task
    return {"before": latency(before), "during": latency(during),
            "outcomes_before": outcomes(before), "outcomes_during": outcomes(during),
            "events": events, "streams": during}  # fmt: skip


def cmd_rolling(args: argparse.Namespace, model: Path, run: Path) -> dict:
    cluster = start(model, run, num_decode=2)
    try:

        def roll() -> list[str]:
            events = []
            for name in ("prefill-0", "decode-0", "decode-1"):
                [child] = [c for c in cluster.children if c.name == name]
                pid, t0 = child.proc.pid, time.monotonic()
                os.kill(pid, signal.SIGTERM)  # drain; tandem up restarts it when it exits
                back(cluster, name, pid)
                events.append(f"{name}: drained and back in {time.monotonic() - t0:.1f} s")
                print(events[-1], flush=True)
            return events

        out = asyncio.run(run_phases(cluster, args, roll))
    finally:
        cluster.stop()
    out.pop("streams")
    return out


def cmd_decode_kill(args: argparse.Namespace, model: Path, run: Path) -> dict:
    cluster = start(model, run, num_decode=1)
    kill_at: list[float] = []
    try:

        def kill() -> list[str]:
            [child] = [c for c in cluster.children if c.name == "decode-0"]
            pid = child.proc.pid
            kill_at.append(time.perf_counter())
            os.kill(pid, signal.SIGKILL)
            t0 = time.monotonic()
            back(cluster, "decode-0", pid)
            return [f"decode-0 SIGKILLed; restarted by tandem up in {time.monotonic() - t0:.1f} s"]

        out = asyncio.run(run_phases(cluster, args, kill))
    finally:
        cluster.stop()
    streams: list[Stream] = out.pop("streams")
    hit = [s for s in streams if s.token_times and s.t_start < kill_at[0] < s.token_times[-1]]
    resumed = [s for s in hit if s.result is not None]
    gaps = [max(b - a for a, b in pairwise(s.token_times)) for s in resumed
            if len(s.token_times) > 1]  # fmt: skip
    out["in_flight_at_kill"] = len(hit)
    out["resumed"] = len(resumed)
    out["failed_of_those"] = sum(1 for s in hit if s.error)
    out["resumed_gap_ms"] = {"p50": pct(gaps, 50), "max": round(max(gaps) * 1e3, 1) if gaps else 0}
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("cmd", choices=("rolling", "decode-kill"))
    parser.add_argument("--load-s", type=float, default=20.0)
    parser.add_argument("--concurrency", type=int, default=6)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = make_tiny_model(Path(tmp) / "tiny", preset="tiny", seed=0)
        run = Path(tmp) / "run"
        run.mkdir()
        result = (cmd_rolling if args.cmd == "rolling" else cmd_decode_kill)(args, model, run)
    print(json.dumps(result, indent=1))
    saved = json.loads(RESULTS.read_text()) if RESULTS.is_file() else {}
    saved[args.cmd] = result
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(saved, indent=1) + "\n")


if __name__ == "__main__":
    main()
