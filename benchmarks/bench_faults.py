"""Fault tolerance, measured with real processes: what a worker or Redis fault costs the
requests in flight and how soon the cluster serves normally again; what an overloaded router
answers and how fast; whether 1 MiB prompts disturb live streams.

    python benchmarks/bench_faults.py [--quick] [--only matrix|overload|itl]
        [--results-dir DIR] [--notes FILE] [--no-markdown-file] [--replot JSON]

The fleet is the fault suite's (`benchmarks/fleet.py`): a private Redis, prefill workers
p0 and p1, decode workers d0 and d1, routers r0 (default admission) and r1
(`--max-inflight 8`), the `tiny` model, every worker with 1 torch thread (TANDEM_NUM_THREADS;
the box has 2 cores). Greedy sampling with ignore_eos fixes every output length.

(1) Fault matrix, on r0. Each repetition runs every fault once next to a no-fault round of
    the same workload (same prompt and output lengths, fresh token ids so no round hits the
    prefix cache of another; order AB in even repetitions, BA in odd ones):
      prefill-sigkill  4 prompts of 1900 tokens homed on p0 (the kv policy's tie-break)
                       sent while p0 is frozen (SIGSTOP), so those placed on p0 are in its
                       Prefill; SIGKILL p0 0.3 s later (the freeze is counted in their extra
                       latency, and reported net of it too).
      decode-sigkill   4 streams (prompts 8, 8, 120, 120; 1200 tokens out); SIGKILL d0 once
                       every stream has 100 tokens.
      decode-sigstop   the same streams; SIGSTOP d1 at the same point, SIGCONT 10 s later.
      redis-sigkill    the same streams plus 4 prompts of 120 tokens sent 0.5 s into the
                       outage; SIGKILL Redis at the same point, restart it 3 s later.
    Per round: requests completed / failed (by status code), migrated, re-prefilled; the
    extra latency of a recovered request (router total_ms minus that of the request with the
    same index, hence the same lengths, in the paired no-fault round); and the time to
    normal: from the fault on, a probe (48-token prompt, 4 tokens out) goes out every 100 ms;
    the time to normal is the send time of the first probe of the final run of clean probes
    (completed, no recovery step), which must be >= 10 probes long. The probes stop once the
    workload ended, the fault was lifted (SIGCONT, Redis back) and such a run exists. After
    each round the killed process is restarted under its name and every worker must be clean
    (`Fleet.assert_clean`: no block, lease or request left).
(2) Overload, on r1: bursts of 1x (the reference), 2x, 4x and 8x max_inflight concurrent
    requests (8-token prompts, 300 tokens out) over one warm channel, burst sizes in rotating
    order: rejection latency (send -> RESOURCE_EXHAUSTED at the client), admitted count,
    admitted TTFT.
(3) Router ITL: 8 live streams (8-token prompts, 1500 tokens out) on r0, with a separate
    process sending 1 MiB text prompts to r0 twice a second (each must be refused with
    INVALID_ARGUMENT before tokenizing) or without, rounds alternating AB BA; ITL p50 / p99
    with / without as a ratio.

Progress goes to stderr and markdown to stdout; results to <results-dir>/faults.json and
faults.png (`--quick`: faults-quick.*, about a minute). A complete, non-quick run into the
default results folder rewrites the "## Fault tolerance (issue 14)" section of BENCHMARKS.md
(and only that section); `--replot` redraws plot and section from a saved JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parent))  # siblings import by name
from fleet import MAX_INFLIGHT, Fleet
from loadgen import RequestClass, RouterTarget, RunResult, Workload, run_workload
from report import (
    BENCHMARKS_MD,
    REPO_ROOT,
    RESULTS_DIR,
    is_default_results_dir,
    machine_info,
    percentile,
    result_path,
    write_json,
    write_markdown_section,
)

from tandem.client import AsyncTandemClient, Result, TandemError
from tandem.engine.prefix_hash import hash_blocks
from tandem.routing.policy import home_rank, prefix_key
from tandem.weights.tiny import make_tiny_model

SECTION = "## Fault tolerance (issue 14)"
BEFORE_SECTION = "## GPU check"  # the new section goes in front of this one
COMMAND = ".venv/bin/python benchmarks/bench_faults.py"
VOCAB = 512  # the tiny model's
FIRST_ID = 5  # ids below are special tokens
BLOCK = 16
CALL_TIMEOUT_S = 60.0  # no client call waits longer
MIB = 1 << 20
_START = time.perf_counter()

FAULTS = ("prefill-sigkill", "decode-sigkill", "decode-sigstop", "redis-sigkill")

# RedisServer starts redis-server with PR_SET_PDEATHSIG, which the kernel ties to the thread
# that forked it: a restart from asyncio.to_thread's pool dies with that thread (SIGKILL when
# the scenario's event loop closes its pool). Restarts go through this one thread instead; it
# lives until the fleet is stopped.
REDIS_THREAD = ThreadPoolExecutor(1, thread_name_prefix="redis-restart")


def log(msg: str) -> None:
    """Progress line on stderr (stdout carries only the markdown report)."""
    print(f"[{time.perf_counter() - _START:7.1f}s] {msg}", file=sys.stderr, flush=True)


@dataclass(frozen=True, slots=True)
class Sizes:
    """What one mode (full or --quick) runs."""

    fault_reps: int
    prefill_prompt_len: int
    prefill_num: int
    prefill_tokens: int
    prefill_freeze_s: float  # p0 is stopped this long before the SIGKILL
    stream_prompt_lens: tuple[int, ...]
    stream_tokens: int
    fault_after_tokens: int  # the fault comes once every stream has this many tokens
    sigstop_s: float
    redis_down_s: float
    redis_extra_prompt_len: int
    redis_extra_num: int
    redis_extra_tokens: int
    probe_interval_s: float
    probe_streak: int  # clean probes in a row that count as "serving normally"
    probe_cap_s: float  # probes stop this long after the fault, normal or not
    probe_prompt_len: int
    probe_tokens: int
    overload_multipliers: tuple[int, ...]
    overload_reps: int
    overload_tokens: int
    itl_pairs: int
    itl_streams: int
    itl_tokens: int
    mib_rate: float  # 1 MiB prompts per second


FULL = Sizes(
    fault_reps=6,
    prefill_prompt_len=1900,
    prefill_num=4,
    prefill_tokens=16,
    prefill_freeze_s=0.3,
    stream_prompt_lens=(8, 8, 120, 120),
    stream_tokens=1200,
    fault_after_tokens=100,
    sigstop_s=10.0,
    redis_down_s=3.0,
    redis_extra_prompt_len=120,
    redis_extra_num=4,
    redis_extra_tokens=8,
    probe_interval_s=0.1,
    probe_streak=10,
    probe_cap_s=30.0,
    probe_prompt_len=48,
    probe_tokens=4,
    overload_multipliers=(1, 2, 4, 8),
    overload_reps=5,
    overload_tokens=300,
    itl_pairs=6,
    itl_streams=8,
    itl_tokens=1500,
    mib_rate=2.0,
)
QUICK = replace(FULL, fault_reps=1, sigstop_s=4.0, overload_reps=1, itl_pairs=1)


def prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(FIRST_ID, VOCAB) for _ in range(n)]


def homed_on(
    worker_id: str, model_id: str, rng: random.Random, n: int, length: int
) -> list[list[int]]:
    """Prompts whose prefix home among p0, p1 (the kv policy's tie-break) is `worker_id`."""
    out: list[list[int]] = []
    while len(out) < n:
        p = prompt(rng, length)
        key = prefix_key(hash_blocks(p, BLOCK, (model_id,)), 16)
        assert key is not None
        if max(("p0", "p1"), key=lambda w: home_rank(key, w)) == worker_id:
            out.append(p)
    return out


def cpu_s(pid: int) -> float:
    """utime + stime of a process, all its threads, from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def q_ms(values: Sequence[float]) -> dict[str, float | int]:
    """p50 / p99 / max of millisecond values (nan when empty), and how many there were."""
    return {
        "n": len(values),
        "p50": percentile(values, 50),
        "p99": percentile(values, 99),
        "max": max(values) if values else math.nan,
    }


# -- one request ---------------------------------------------------------------------------


@dataclass(slots=True)
class Outcome:
    """One workload request as the client saw it, plus what the router reported."""

    index: int
    prompt_tokens: int
    max_tokens: int
    code: str = ""  # "OK" (completed with every token) or the status code's name
    message: str = ""
    tokens: int = 0
    ttft_ms: float = math.nan  # client: send -> first token
    e2e_ms: float = math.nan  # client: send -> end
    total_ms: float = math.nan  # router: admission -> complete
    migrations: int = 0
    reprefills: int = 0
    recoveries: list[str] = field(default_factory=list)
    prefill_worker: str = ""
    decode_worker: str = ""
    index_degraded: bool = False
    retry_after_s: float | None = None

    @property
    def recovered(self) -> bool:
        return bool(self.recoveries or self.migrations or self.reprefills)


async def request(
    client: AsyncTandemClient,
    index: int,
    tokens: list[int],
    max_tokens: int,
    progress: asyncio.Event | None = None,
    progress_tokens: int = 1,
) -> Outcome:
    """Stream one greedy request; set `progress` once `progress_tokens` tokens arrived."""
    out = Outcome(index, len(tokens), max_tokens)
    result = Result()
    t0 = time.perf_counter()
    try:
        async for chunk in client.stream(
            tokens, result=result, max_tokens=max_tokens, temperature=0.0, ignore_eos=True
        ):
            if chunk.token_ids and out.tokens == 0:
                out.ttft_ms = (time.perf_counter() - t0) * 1e3
            out.tokens += len(chunk.token_ids)
            if progress is not None and out.tokens >= progress_tokens:
                progress.set()
        out.code = "OK" if out.tokens == max_tokens else "SHORT"
    except TandemError as exc:
        out.code, out.message = exc.code.name, exc.message[:200]
        out.retry_after_s = getattr(exc, "retry_after_s", None)
    out.e2e_ms = (time.perf_counter() - t0) * 1e3
    if progress is not None:
        progress.set()  # a failed request must not hold the scenario up
    if result.finish_reason is not None:
        out.total_ms = result.total_ms
        out.migrations, out.reprefills = result.migrations, result.reprefills
        out.recoveries = list(result.recoveries)
        out.prefill_worker, out.decode_worker = result.prefill_worker, result.decode_worker
        out.index_degraded = result.index_degraded
    return out


# -- probes --------------------------------------------------------------------------------


@dataclass(slots=True)
class Probe:
    sent_s: float  # from the fault
    done: bool = False
    code: str = ""
    steps: int = 0  # recovery steps the router took for it
    degraded: bool = False  # placed without the prefix index (Redis unreachable)
    latency_ms: float = math.nan
    message: str = ""  # the error, when it failed

    @property
    def clean(self) -> bool:
        return self.done and self.code == "OK" and self.steps == 0


def final_run_start(probes: Sequence[Probe], good: Callable[[Probe], bool]) -> int | None:
    """Index of the first probe of the trailing run of `good` probes; None if the last is not."""
    i = len(probes)
    while i > 0 and good(probes[i - 1]):
        i -= 1
    return i if i < len(probes) else None


class Prober:
    """Sends a short request every `interval` from `t_fault` on, until `end` is set and the
    last `streak` finished probes were clean, or `cap_s` passed."""

    def __init__(
        self, address: str, rng: random.Random, sizes: Sizes, t_fault: float, end: asyncio.Event
    ) -> None:
        self.address = address
        self.rng = rng
        self.sizes = sizes
        self.t_fault = t_fault
        self.end = end
        self.probes: list[Probe] = []

    async def _one(self, client: AsyncTandemClient, probe: Probe) -> None:
        s = self.sizes
        out = await request(client, 0, prompt(self.rng, s.probe_prompt_len), s.probe_tokens)
        probe.code, probe.latency_ms, probe.message = out.code, out.e2e_ms, out.message
        probe.steps = len(out.recoveries) or out.migrations + out.reprefills
        probe.degraded = out.index_degraded
        probe.done = True

    def _streak(self) -> int:
        """Clean probes at the end of the finished prefix of the probes."""
        n = 0
        for p in self.probes:
            if not p.done:
                break
            n = n + 1 if p.clean else 0
        return n

    async def run(self) -> list[Probe]:
        s = self.sizes
        tasks: list[asyncio.Task[None]] = []
        async with AsyncTandemClient(self.address, timeout_s=CALL_TIMEOUT_S) as client:
            i = 0
            while True:
                now = time.perf_counter()
                if self.end.is_set() and self._streak() >= s.probe_streak:
                    break
                if now - self.t_fault > s.probe_cap_s:
                    break
                probe = Probe(now - self.t_fault)
                self.probes.append(probe)
                tasks.append(asyncio.create_task(self._one(client, probe)))
                # The next slot on the schedule; slots missed while the loop was held up are
                # skipped, not sent in a burst.
                i = max(
                    i + 1, math.floor((time.perf_counter() - self.t_fault) / s.probe_interval_s) + 1
                )
                await asyncio.sleep(
                    max(0.0, self.t_fault + i * s.probe_interval_s - time.perf_counter())
                )
            await asyncio.gather(*tasks)
        return self.probes


def probe_summary(probes: Sequence[Probe], streak: int) -> dict[str, Any]:
    start = final_run_start(probes, lambda p: p.clean)
    normal = probes[start].sent_s if start is not None and len(probes) - start >= streak else None
    idx = final_run_start(probes, lambda p: p.clean and not p.degraded)
    return {
        "num_probes": len(probes),
        "normal_after_s": normal,
        "index_back_after_s": probes[idx].sent_s if idx is not None else None,
        "num_failed": sum(1 for p in probes if p.code != "OK"),
        "failed_codes": dict(Counter(p.code for p in probes if p.code != "OK")),
        "num_recovered": sum(1 for p in probes if p.code == "OK" and p.steps),
        "num_degraded": sum(1 for p in probes if p.degraded),
        "latency_ms": q_ms([p.latency_ms for p in probes if p.code == "OK"]),
        "window_s": probes[-1].sent_s if probes else 0.0,
        # [sent_s, status, recovery steps, index_degraded, latency_ms(, error message)]
        "trace": [
            [round(p.sent_s, 3), p.code, p.steps, p.degraded, round(p.latency_ms, 2)]
            + ([p.message] if p.message else [])
            for p in probes
        ],
    }


# -- (1) the fault matrix ------------------------------------------------------------------


@dataclass(slots=True)
class Round:
    fault: str
    injected: bool
    rep: int
    outcomes: list[Outcome] = field(default_factory=list)
    probes: dict[str, Any] = field(default_factory=dict)
    notes: dict[str, Any] = field(default_factory=dict)
    restore_s: float = 0.0
    clean: bool = True
    clean_error: str = ""


async def sigkill(fleet: Fleet, name: str) -> None:
    """SIGKILL a fleet process at once and reap it off the event loop (a dying process can
    take a while to exit on a loaded box; Fleet.kill would block the probes meanwhile)."""
    if name == "redis":
        assert fleet.redis.pid is not None
        os.kill(fleet.redis.pid, signal.SIGKILL)
        await asyncio.to_thread(fleet.redis.kill)  # reaps it; the files stay for restart()
        return
    os.kill(fleet.procs[name].pid, signal.SIGKILL)
    await asyncio.to_thread(fleet.procs[name].wait, 10)


async def _streams_then(
    fleet: Fleet,
    rng: random.Random,
    sizes: Sizes,
    inject: Callable[[], Awaitable[None]] | None,
    lift: Callable[[asyncio.Event], Coroutine[Any, Any, dict[str, Any]]] | None,
) -> tuple[list[Outcome], list[Probe], dict[str, Any]]:
    """The streams workload: once every stream has `fault_after_tokens` tokens, `inject`
    (None: nothing, the no-fault round) and start probing; `lift(end)` runs alongside and sets
    `end` when the fault is over (None: when the streams are done)."""
    address = fleet.addresses["r0"]
    lens = sizes.stream_prompt_lens
    started = [asyncio.Event() for _ in lens]
    end = asyncio.Event()
    notes: dict[str, Any] = {}
    async with AsyncTandemClient(address, timeout_s=CALL_TIMEOUT_S) as client:
        tasks = [
            asyncio.create_task(
                request(client, i, prompt(rng, n), sizes.stream_tokens, e, sizes.fault_after_tokens)
            )
            for i, (n, e) in enumerate(zip(lens, started, strict=True))
        ]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), CALL_TIMEOUT_S)
        t_fault = time.perf_counter()
        # The probe task first runs while `inject` waits: its first probe follows the fault.
        prober = Prober(address, random.Random(rng.random()), sizes, t_fault, end)
        probing = asyncio.create_task(prober.run())
        if inject is not None:
            await inject()
        lifting = asyncio.create_task(lift(end)) if lift is not None else None
        outcomes = list(await asyncio.gather(*tasks))
        if lifting is not None:
            notes.update(await lifting)
            outcomes.extend(notes.pop("outcomes", []))
        end.set()
        probes = await probing
    return outcomes, probes, notes


async def scenario_prefill_sigkill(
    fleet: Fleet, rng: random.Random, sizes: Sizes, injected: bool
) -> tuple[list[Outcome], list[Probe], dict[str, Any]]:
    """p0 is frozen (SIGSTOP) before the prompts go out, so their Prefill calls are surely in
    flight on it, and SIGKILLed `prefill_freeze_s` later (shorter than keepalive needs to find
    a frozen worker: the router learns of the kill, not of the freeze). The no-fault round
    sends the same way and starts its probes after the same pause."""
    address = fleet.addresses["r0"]
    prompts = homed_on("p0", fleet.model_dir.name, rng, sizes.prefill_num, sizes.prefill_prompt_len)
    end = asyncio.Event()
    async with AsyncTandemClient(address, timeout_s=CALL_TIMEOUT_S) as client:
        await client.tokenize("warm")
        if injected:
            fleet.kill("p0", signal.SIGSTOP)
        t_sent = time.perf_counter()
        tasks = [
            asyncio.create_task(request(client, i, p, sizes.prefill_tokens))
            for i, p in enumerate(prompts)
        ]
        await asyncio.sleep(sizes.prefill_freeze_s)
        t_fault = time.perf_counter()
        prober = Prober(address, random.Random(rng.random()), sizes, t_fault, end)
        probing = asyncio.create_task(prober.run())
        if injected:
            await sigkill(fleet, "p0")
        outcomes = list(await asyncio.gather(*tasks))
        end.set()
        probes = await probing
    return outcomes, probes, {"freeze_ms": (t_fault - t_sent) * 1e3 if injected else 0.0}


async def scenario_decode_sigkill(
    fleet: Fleet, rng: random.Random, sizes: Sizes, injected: bool
) -> tuple[list[Outcome], list[Probe], dict[str, Any]]:
    async def inject() -> None:
        await sigkill(fleet, "d0")

    return await _streams_then(fleet, rng, sizes, inject if injected else None, None)


async def scenario_decode_sigstop(
    fleet: Fleet, rng: random.Random, sizes: Sizes, injected: bool
) -> tuple[list[Outcome], list[Probe], dict[str, Any]]:
    async def inject() -> None:
        fleet.kill("d1", signal.SIGSTOP)

    async def lift(end: asyncio.Event) -> dict[str, Any]:
        await asyncio.sleep(sizes.sigstop_s)
        fleet.kill("d1", signal.SIGCONT)
        end.set()
        return {"stopped_s": sizes.sigstop_s}

    if not injected:
        return await _streams_then(fleet, rng, sizes, None, None)
    return await _streams_then(fleet, rng, sizes, inject, lift)


async def scenario_redis_sigkill(
    fleet: Fleet, rng: random.Random, sizes: Sizes, injected: bool
) -> tuple[list[Outcome], list[Probe], dict[str, Any]]:
    extra = [prompt(rng, sizes.redis_extra_prompt_len) for _ in range(sizes.redis_extra_num)]
    first = len(sizes.stream_prompt_lens)

    async def inject() -> None:
        await sigkill(fleet, "redis")

    async def lift(end: asyncio.Event) -> dict[str, Any]:
        # Long prompts while Redis is down (or at the same moment of the no-fault round).
        await asyncio.sleep(0.5)
        async with AsyncTandemClient(fleet.addresses["r0"], timeout_s=CALL_TIMEOUT_S) as client:
            more = await asyncio.gather(
                *(
                    request(client, first + i, p, sizes.redis_extra_tokens)
                    for i, p in enumerate(extra)
                )
            )
        t_restart = 0.0
        if injected:
            await asyncio.sleep(max(0.0, sizes.redis_down_s - 0.5))
            t0 = time.perf_counter()
            await asyncio.get_running_loop().run_in_executor(REDIS_THREAD, fleet.redis.restart)
            await asyncio.to_thread(fleet.wait_registered, "p0", "p1", "d0", "d1")
            t_restart = time.perf_counter() - t0
        end.set()
        return {"outcomes": more, "redis_restart_and_reregister_s": t_restart}

    return await _streams_then(fleet, rng, sizes, inject if injected else None, lift)


SCENARIOS: dict[
    str,
    Callable[
        [Fleet, random.Random, Sizes, bool],
        Awaitable[tuple[list[Outcome], list[Probe], dict[str, Any]]],
    ],
] = {
    "prefill-sigkill": scenario_prefill_sigkill,
    "decode-sigkill": scenario_decode_sigkill,
    "decode-sigstop": scenario_decode_sigstop,
    "redis-sigkill": scenario_redis_sigkill,
}
KILLED = {"prefill-sigkill": "p0", "decode-sigkill": "d0"}


def check_alive(fleet: Fleet, where: str) -> None:
    """Every process of the fleet, Redis included, runs (a fault round restored them)."""
    for name, proc in fleet.procs.items():
        if proc.poll() is not None:
            raise RuntimeError(f"{name} exited ({proc.returncode}) after {where}")
    if not fleet.redis.running:
        raise RuntimeError(f"Redis is not running after {where}")


def run_round(fleet: Fleet, fault: str, injected: bool, rep: int, sizes: Sizes) -> Round:
    rnd = Round(fault, injected, rep)
    rnd.notes["loadavg_1m_before"] = os.getloadavg()[0]
    rng = random.Random(f"{fault}/{rep}/{injected}")
    coro = SCENARIOS[fault](fleet, rng, sizes, injected)
    outcomes, probes, notes = asyncio.run(asyncio.wait_for(coro, 3 * CALL_TIMEOUT_S))
    rnd.outcomes = outcomes
    rnd.notes.update(notes)
    rnd.probes = probe_summary(probes, sizes.probe_streak)
    t0 = time.perf_counter()
    if injected and fault in KILLED:
        fleet.restart(KILLED[fault])
    check_alive(fleet, f"{fault} rep {rep}")
    try:
        fleet.assert_clean()
    except AssertionError as exc:
        rnd.clean, rnd.clean_error = False, str(exc)[:2000]
        log(f"  NOT CLEAN after {fault}: {rnd.clean_error[:300]}")
    rnd.restore_s = time.perf_counter() - t0
    return rnd


def bench_matrix(fleet: Fleet, sizes: Sizes) -> dict[str, Any]:
    log("(1) fault matrix")
    for fault in FAULTS:  # warm-up: first calls, allocator, channels; not counted
        warm = run_round(fleet, fault, False, -1, sizes)
        bad = [o for o in warm.outcomes if o.code != "OK"]
        if bad:  # a fleet that fails without a fault would only measure its own breakage
            raise RuntimeError(
                f"the fleet fails requests without a fault ({fault} warm-up): "
                f"{bad[0].code} {bad[0].message}; logs in {fleet.run_dir}"
            )
    rounds: list[Round] = []
    for rep in range(sizes.fault_reps):
        for fault in FAULTS:
            order = (False, True) if rep % 2 == 0 else (True, False)
            for injected in order:
                rnd = run_round(fleet, fault, injected, rep, sizes)
                rounds.append(rnd)
                codes = Counter(o.code for o in rnd.outcomes)
                log(
                    f"  rep {rep} {fault:15s} {'FAULT' if injected else 'none ':5s}: "
                    f"{dict(codes)}, migrated {sum(o.migrations > 0 for o in rnd.outcomes)}, "
                    f"re-prefilled {sum(o.reprefills > 0 for o in rnd.outcomes)}, "
                    f"normal after {rnd.probes['normal_after_s']} s "
                    f"({rnd.probes['num_probes']} probes, {rnd.probes['num_failed']} failed, "
                    f"{rnd.probes['num_recovered']} recovered), clean {rnd.clean}"
                )
    return {"rounds": [asdict(r) for r in rounds], "summary": matrix_summary(rounds)}


def matrix_summary(rounds: Sequence[Round]) -> dict[str, Any]:
    """Per fault: totals over its fault rounds, and its paired no-fault rounds as reference."""
    out: dict[str, Any] = {}
    base = {(r.fault, r.rep): r for r in rounds if not r.injected}
    for fault in FAULTS:
        for injected in (True, False):
            mine = [r for r in rounds if r.fault == fault and r.injected == injected]
            if not mine:
                continue
            outcomes = [o for r in mine for o in r.outcomes]
            extra: list[float] = []
            net: list[float] = []
            others: list[float] = []
            for r in mine:
                ref = {o.index: o for o in base[(fault, r.rep)].outcomes if o.code == "OK"}
                for o in r.outcomes:
                    if o.code != "OK" or o.index not in ref:
                        continue
                    delta = o.total_ms - ref[o.index].total_ms
                    (extra if o.recovered else others).append(delta)
                    if o.recovered:
                        net.append(delta - r.notes.get("freeze_ms", 0.0))
            normal = [r.probes["normal_after_s"] for r in mine]
            key = fault if injected else f"{fault} (no fault)"
            out[key] = {
                "fault": fault,
                "injected": injected,
                "rounds": len(mine),
                "requests": len(outcomes),
                "completed": sum(1 for o in outcomes if o.code == "OK"),
                "failed": dict(Counter(o.code for o in outcomes if o.code != "OK")),
                "migrated": sum(1 for o in outcomes if o.migrations),
                "reprefilled": sum(1 for o in outcomes if o.reprefills),
                "recovered": sum(1 for o in outcomes if o.recovered),
                "recovery_lines": sorted({_shape(x) for o in outcomes for x in o.recoveries}),
                "extra_ms_recovered": q_ms(extra) if injected else None,
                "extra_ms_recovered_net_of_freeze": q_ms(net) if injected else None,
                "delta_ms_unaffected": q_ms(others) if injected else None,
                "normal_after_s": normal,
                "normal_after_s_p50": statistics.median([x for x in normal if x is not None])
                if any(x is not None for x in normal)
                else None,
                "never_normal": sum(1 for x in normal if x is None),
                "index_back_after_s": [r.probes["index_back_after_s"] for r in mine],
                "probes": sum(r.probes["num_probes"] for r in mine),
                "probes_failed": sum(r.probes["num_failed"] for r in mine),
                "probes_failed_codes": dict(
                    sum((Counter(r.probes["failed_codes"]) for r in mine), Counter())
                ),
                "probes_recovered": sum(r.probes["num_recovered"] for r in mine),
                "probes_degraded": sum(r.probes["num_degraded"] for r in mine),
                "probe_latency_ms": q_ms(
                    [p[4] for r in mine for p in r.probes["trace"] if p[1] == "OK"]
                ),
                "clean_after": sum(1 for r in mine if r.clean),
            }
    return out


def _shape(line: str) -> str:
    """A recovery line cut to its kind, "<fault> on <worker> (<status>: <first words of the
    error>) -> <action> on <workers>" (the full lines are in the JSON)."""
    parts = line.split(": ")
    at = next(
        (
            i
            for i, x in enumerate(parts)
            if i > 0
            and (x == "fail" or x.startswith(("reprefill on", "recompute on", "migrate on")))
        ),
        len(parts),
    )
    why = ": ".join(parts[1:3] if at > 2 else parts[1:at])
    return f"{parts[0]} ({why}) -> {parts[at] if at < len(parts) else '?'}"


# -- (2) overload --------------------------------------------------------------------------


async def burst(address: str, n: int, sizes: Sizes, rng: random.Random) -> list[Outcome]:
    prompts = [prompt(rng, 8) for _ in range(n)]
    async with AsyncTandemClient(address, timeout_s=CALL_TIMEOUT_S) as client:
        await client.tokenize("warm")  # connect before the burst, so it measures the router
        return list(
            await asyncio.gather(
                *(request(client, i, p, sizes.overload_tokens) for i, p in enumerate(prompts))
            )
        )


def bench_overload(fleet: Fleet, sizes: Sizes) -> dict[str, Any]:
    log(f"(2) overload bursts at r1 (max_inflight {MAX_INFLIGHT})")
    check_alive(fleet, "the fault matrix")
    asyncio.run(burst(fleet.addresses["r1"], MAX_INFLIGHT, sizes, random.Random(0)))  # warm-up
    time.sleep(0.3)
    bursts: list[dict[str, Any]] = []
    for rep in range(sizes.overload_reps):
        order = sizes.overload_multipliers
        order = order if rep % 2 == 0 else tuple(reversed(order))
        for mult in order:
            n = mult * MAX_INFLIGHT
            rng = random.Random(f"overload/{rep}/{mult}")
            router0, client0 = cpu_s(fleet.procs["r1"].pid), time.process_time()
            outs = asyncio.run(
                asyncio.wait_for(burst(fleet.addresses["r1"], n, sizes, rng), CALL_TIMEOUT_S * 2)
            )
            cpu = {
                "router": cpu_s(fleet.procs["r1"].pid) - router0,
                "client": time.process_time() - client0,
            }
            ok = [o for o in outs if o.code == "OK"]
            rejected = [o for o in outs if o.code == "RESOURCE_EXHAUSTED"]
            row = {
                "rep": rep,
                "multiplier": mult,
                "requests": n,
                "admitted": len(ok),
                "rejected": len(rejected),
                "other": dict(
                    Counter(o.code for o in outs if o.code not in ("OK", "RESOURCE_EXHAUSTED"))
                ),
                "reject_ms": [round(o.e2e_ms, 3) for o in rejected],
                "retry_after_s": sorted({o.retry_after_s for o in rejected}, key=str),
                "admitted_ttft_ms": [round(o.ttft_ms, 3) for o in ok],
                "admitted_e2e_ms": [round(o.e2e_ms, 3) for o in ok],
                "messages": sorted({o.message[:120] for o in rejected})[:2],
                "cpu_s": cpu,
            }
            bursts.append(row)
            log(
                f"  rep {rep} {mult}x ({n}): admitted {len(ok)}, rejected {len(rejected)}, "
                f"other {row['other']}; reject p50 "
                f"{percentile([o.e2e_ms for o in rejected], 50):.1f} ms; admitted TTFT p99 "
                f"{percentile([o.ttft_ms for o in ok], 99):.1f} ms"
            )
            time.sleep(0.3)  # the router counts a call out just after its last message
    summary = {}
    for mult in sizes.overload_multipliers:
        mine = [b for b in bursts if b["multiplier"] == mult]
        summary[str(mult)] = {
            "multiplier": mult,
            "bursts": len(mine),
            "requests_per_burst": mult * MAX_INFLIGHT,
            "admitted": [b["admitted"] for b in mine],
            "rejected": sum(b["rejected"] for b in mine),
            "other": dict(sum((Counter(b["other"]) for b in mine), Counter())),
            "reject_ms": q_ms([x for b in mine for x in b["reject_ms"]]),
            "retry_after_s": sorted({x for b in mine for x in b["retry_after_s"]}, key=str),
            "admitted_ttft_ms": q_ms([x for b in mine for x in b["admitted_ttft_ms"]]),
            "admitted_e2e_ms": q_ms([x for b in mine for x in b["admitted_e2e_ms"]]),
            "cpu_s_per_burst": {
                k: statistics.mean(b["cpu_s"][k] for b in mine) for k in ("router", "client")
            },
        }
    return {"max_inflight": MAX_INFLIGHT, "bursts": bursts, "summary": summary}


# -- (3) router ITL beside 1 MiB prompts ---------------------------------------------------

# A separate process sends the big prompts, so their serialization never runs on the event
# loop that timestamps the streams' tokens. "start" on stdin: send at `rate` per second until
# "stop", then print what each send got as one JSON line.
_SENDER = r"""
import json, sys, threading, time
from tandem.client import TandemClient, TandemError

address, rate, size = sys.argv[1], float(sys.argv[2]), int(sys.argv[3])
text = "x" * size
client = TandemClient(address, timeout_s=30)
client.tokenize("warm")
print("READY", flush=True)
while sys.stdin.readline().strip() == "start":
    stop, sent = threading.Event(), []

    def send():
        t0 = time.perf_counter()
        i = 0
        while not stop.is_set():
            t = time.perf_counter()
            try:
                client.generate(text, max_tokens=4)
                code, msg = "OK", ""
            except TandemError as exc:
                code, msg = exc.code.name, exc.message[:160]
            sent.append({"t_s": t - t0, "ms": (time.perf_counter() - t) * 1e3, "code": code,
                         "message": msg})
            i += 1
            stop.wait(max(0.0, t0 + i / rate - time.perf_counter()))

    thread = threading.Thread(target=send)
    thread.start()
    sys.stdin.readline()
    stop.set()
    thread.join()
    print(json.dumps(sent), flush=True)
"""

WITHOUT, WITH = "without", "with 1 MiB prompts"


def bench_itl(fleet: Fleet, sizes: Sizes) -> dict[str, Any]:
    log(f"(3) ITL of {sizes.itl_streams} streams with / without 1 MiB prompts")
    check_alive(fleet, "the overload bursts")
    address = fleet.addresses["r0"]
    sender = subprocess.Popen(
        [sys.executable, "-c", _SENDER, address, str(sizes.mib_rate), str(MIB)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO_ROOT,
    )
    assert sender.stdin is not None and sender.stdout is not None
    if not sender.stdout.readline().startswith("READY"):
        raise RuntimeError("the 1 MiB sender did not start")
    workload = Workload(
        classes=(RequestClass(1.0, (8, 8), (sizes.itl_tokens, sizes.itl_tokens)),),
        num_requests=sizes.itl_streams,
        concurrency=sizes.itl_streams,
        vocab_size=VOCAB,
        seed=14,
    )

    async def streams(salt: int) -> RunResult:
        target = RouterTarget(address)
        try:
            return await run_workload(target, replace(workload, prompt_salt=salt))
        finally:
            await target.close()

    rounds: list[dict[str, Any]] = []
    results: dict[str, list[RunResult]] = {WITHOUT: [], WITH: []}
    big: list[dict[str, Any]] = []
    try:
        asyncio.run(streams(-1))  # warm the channel and the workers
        salt = 0
        for pair in range(sizes.itl_pairs):
            order = (WITHOUT, WITH) if pair % 2 == 0 else (WITH, WITHOUT)
            for mode in order:
                salt += 1
                if mode == WITH:
                    sender.stdin.write("start\n")
                    sender.stdin.flush()
                pids = {"router": fleet.procs["r0"].pid, "sender": sender.pid}
                cpu0 = {k: cpu_s(pid) for k, pid in pids.items()}
                res = asyncio.run(asyncio.wait_for(streams(salt), CALL_TIMEOUT_S * 2))
                cpu = {k: cpu_s(pid) - cpu0[k] for k, pid in pids.items()}
                sent: list[dict[str, Any]] = []
                if mode == WITH:
                    sender.stdin.write("stop\n")
                    sender.stdin.flush()
                    sent = json.loads(sender.stdout.readline())
                    big.extend(sent)
                results[mode].append(res)
                itls = [x * 1e3 for x in res.itls()]
                failed = [r.error for r in res.records if not r.ok]
                rounds.append(
                    {
                        "pair": pair,
                        "mode": mode,
                        "itl_ms": q_ms(itls),
                        "window_s": res.wall_s,
                        "cpu_s": cpu,
                        "failed": failed,
                        "big_sent": len(sent),
                        "big_codes": dict(Counter(s["code"] for s in sent)),
                    }
                )
                log(
                    f"  pair {pair} {mode:18s}: ITL p50 {percentile(itls, 50):.2f} ms, p99 "
                    f"{percentile(itls, 99):.2f} ms, {len(sent)} big prompts "
                    f"{dict(Counter(s['code'] for s in sent))}, failed {len(failed)}"
                )
    finally:
        if sender.poll() is None:
            sender.stdin.write("quit\n")
            sender.stdin.close()
            try:
                sender.wait(timeout=10)
            except subprocess.TimeoutExpired:
                sender.kill()
    pooled = {m: [x * 1e3 for r in results[m] for x in r.itls()] for m in results}
    q = {m: q_ms(v) | {"p90": percentile(v, 90)} for m, v in pooled.items()}
    pair_ratios = []
    for pair in range(sizes.itl_pairs):
        a = next(r for r in rounds if r["pair"] == pair and r["mode"] == WITHOUT)
        b = next(r for r in rounds if r["pair"] == pair and r["mode"] == WITH)
        pair_ratios.append(b["itl_ms"]["p99"] / a["itl_ms"]["p99"])
    return {
        "streams": sizes.itl_streams,
        "tokens_per_stream": sizes.itl_tokens,
        "mib_rate": sizes.mib_rate,
        "rounds": rounds,
        "itl_ms": q,
        "p99_ratio": q[WITH]["p99"] / q[WITHOUT]["p99"],
        "p50_ratio": q[WITH]["p50"] / q[WITHOUT]["p50"],
        "p99_ratio_median_of_pairs": statistics.median(pair_ratios),
        "big_prompts": {
            "sent": len(big),
            "codes": dict(Counter(s["code"] for s in big)),
            "reject_ms": q_ms([s["ms"] for s in big]),
            "messages": sorted({s["message"] for s in big})[:2],
        },
        "failed_streams": sum(len(r["failed"]) for r in rounds),
        "itl_dist": {m: _dist(v) for m, v in pooled.items()},
    }


def _dist(values: Sequence[float]) -> dict[str, Any]:
    """Quantiles for a tail plot (0.1 % steps up to 99.9 %, then the max)."""
    qs = [i / 10 for i in range(0, 1000)] + [100.0]
    return {"q": qs, "ms": [percentile(values, x) for x in qs], "n": len(values)}


# -- report --------------------------------------------------------------------------------


def _f(x: float | None, fmt: str = ".0f") -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, fmt)


def _cpu(cpu: dict[str, float] | None, *names: str) -> str:
    """CPU seconds of the named processes, or "-" for a run that did not measure them."""
    return " / ".join(f"{cpu[n]:.2f}" for n in names) if cpu else "-"


def _codes(codes: dict[str, int]) -> str:
    return ", ".join(f"{n} {c}" for c, n in sorted(codes.items())) or "0"


def matrix_markdown(m: dict[str, Any], sizes: dict[str, Any]) -> str:
    lines = [
        f"{sizes['fault_reps']} repetition(s) of each fault, each paired with a no-fault round "
        f"of the same workload. Time to normal: probes ({sizes['probe_prompt_len']}-token "
        f"prompt, {sizes['probe_tokens']} tokens) every {sizes['probe_interval_s'] * 1e3:.0f} "
        f"ms from the fault; the send time of the first of the final >= "
        f"{sizes['probe_streak']} probes that completed with no recovery step (p50 and every "
        "round's value).",
        "",
        "| fault | requests | completed | failed | migrated | re-prefilled "
        "| extra latency of a recovered request p50 / p99 (ms) (n) | others' delta p50 (ms) "
        "| time to normal p50 (s) [each round] | probes failed / recovered of sent "
        "| probe latency p50 / max (ms) | fleet clean after |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for key, s in m["summary"].items():
        extra, others = s["extra_ms_recovered"], s["delta_ms_unaffected"]
        cell = "-"
        if extra and extra["n"]:
            cell = f"{_f(extra['p50'])} / {_f(extra['p99'])} ({extra['n']})"
            net = s["extra_ms_recovered_net_of_freeze"]
            if net and net["p50"] != extra["p50"]:
                cell += f"; net of the freeze {_f(net['p50'])} / {_f(net['p99'])}"
        per_round = ", ".join(_f(x, ".1f") for x in s["normal_after_s"])
        pl = s["probe_latency_ms"]
        lines.append(
            f"| {key} | {s['requests']} | {s['completed']} | {_codes(s['failed'])} "
            f"| {s['migrated']} | {s['reprefilled']} | {cell} "
            f"| {_f(others['p50']) if others else '-'} "
            f"| {_f(s['normal_after_s_p50'], '.1f')} [{per_round}] "
            f"| {s['probes_failed']} / {s['probes_recovered']} of {s['probes']} "
            f"| {_f(pl['p50'])} / {_f(pl['max'])} "
            f"| {s['clean_after']}/{s['rounds']} |"
        )
    degraded = [
        f"{key} {s['probes_degraded']}/{s['probes']}"
        for key, s in m["summary"].items()
        if s["probes_degraded"]
    ]
    if degraded:
        lines += [
            "",
            "Probes placed without the prefix index (`index_degraded`: a lookup failed or took "
            "longer than the router's index_timeout_s): " + ", ".join(degraded) + ".",
        ]
    redis = m["summary"].get("redis-sigkill")
    if redis:
        back = ", ".join(_f(x, ".1f") for x in redis["index_back_after_s"])
        lines += [
            "",
            f"redis-sigkill: prefix index in use again (final run of clean probes placed with "
            f"the index) after [{back}] s from the kill; Redis was down for "
            f"{sizes['redis_down_s']:g} s.",
        ]
    kinds = sorted({_shape(x) for r in m["rounds"] for o in r["outcomes"] for x in o["recoveries"]})
    if kinds:
        lines += ["", "Recovery steps seen (router `recoveries` lines, details cut):", ""]
        lines += [f"- `{k}`" for k in kinds]
    return "\n".join(lines)


def overload_markdown(o: dict[str, Any]) -> str:
    lines = [
        f"Router r1, max_inflight {o['max_inflight']}; each burst sends all its requests at "
        "once over one warm channel.",
        "",
        "| burst | requests | admitted per burst | rejected (RESOURCE_EXHAUSTED) | other "
        "| rejection latency p50 / p99 (ms) | retry hint (s) | admitted TTFT p50 / p99 (ms) "
        "| admitted E2E p50 (ms) | CPU s per burst: router r1 / client |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in o["summary"].values():
        r, t, e = s["reject_ms"], s["admitted_ttft_ms"], s["admitted_e2e_ms"]
        lines.append(
            f"| {s['multiplier']}x | {s['requests_per_burst']} x {s['bursts']} "
            f"| {', '.join(map(str, s['admitted']))} | {s['rejected']} | {_codes(s['other'])} "
            f"| {_f(r['p50'], '.1f')} / {_f(r['p99'], '.1f')} "
            f"| {', '.join(_f(x, '.1f') for x in s['retry_after_s']) or '-'} "
            f"| {_f(t['p50'], '.1f')} / {_f(t['p99'], '.1f')} | {_f(e['p50'])} "
            f"| {_cpu(s.get('cpu_s_per_burst'), 'router', 'client')} |"
        )
    return "\n".join(lines)


def itl_markdown(i: dict[str, Any]) -> str:
    lines = [
        f"{i['streams']} streams of {i['tokens_per_stream']} tokens on r0; 1 MiB text prompts "
        f"at {i['mib_rate']:g}/s from another process in the `{WITH}` rounds.",
        "",
        "| pair | mode | ITL p50 / p99 / max (ms) | 1 MiB prompts (status) "
        "| CPU s: router r0 / sender |",
        "|---|---|---|---|---|",
    ]
    for r in i["rounds"]:
        q, c = r["itl_ms"], r.get("cpu_s")
        lines.append(
            f"| {r['pair']} | {r['mode']} | {q['p50']:.2f} / {q['p99']:.2f} / {q['max']:.1f} "
            f"| {_codes(r['big_codes']) if r['big_sent'] else '-'} "
            f"| {_cpu(c, 'router', 'sender')} |"
        )
    a, b, big = i["itl_ms"][WITHOUT], i["itl_ms"][WITH], i["big_prompts"]
    lines += [
        "",
        f"Pooled ITL p50 / p99: without {a['p50']:.2f} / {a['p99']:.2f} ms, with "
        f"{b['p50']:.2f} / {b['p99']:.2f} ms: ratio p99 **{i['p99_ratio']:.2f}x** (median of "
        f"pairs {i['p99_ratio_median_of_pairs']:.2f}x), p50 **{i['p50_ratio']:.2f}x**. "
        f"1 MiB prompts: {big['sent']} sent, {_codes(big['codes'])}, answered in "
        f"{_f(big['reject_ms']['p50'], '.1f')} / {_f(big['reject_ms']['p99'], '.1f')} ms "
        f"(p50 / p99). Failed streams: {i['failed_streams']}.",
    ]
    return "\n".join(lines)


def plot(report: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 4, figsize=(21, 4.4))
    m = report.get("matrix")
    if m:
        summary = m["summary"]
        faults = [k for k, s in summary.items() if s["injected"]]
        ax = axes[0]
        for x, key in enumerate(faults):
            fault = summary[key]["fault"]
            base = {
                (r["rep"], o["index"]): o["total_ms"]
                for r in m["rounds"]
                if r["fault"] == fault and not r["injected"]
                for o in r["outcomes"]
                if o["code"] == "OK"
            }
            pts = [
                (o["total_ms"] - base[(r["rep"], o["index"])], bool(o["recoveries"]))
                for r in m["rounds"]
                if r["fault"] == fault and r["injected"]
                for o in r["outcomes"]
                if o["code"] == "OK" and (r["rep"], o["index"]) in base
            ]
            for dx, (rec, color) in enumerate(((True, "C3"), (False, "C0"))):
                ys = [y for y, r in pts if r == rec]
                xs = [x - 0.12 + 0.24 * dx + 0.04 * ((i % 5) - 2) for i in range(len(ys))]
                ax.scatter(
                    xs,
                    ys,
                    s=12,
                    color=color,
                    label=None if x else ("recovered" if rec else "not recovered"),
                )
        ax.axhline(0, color="grey", lw=0.6)
        ax.set_xticks(range(len(faults)), faults, fontsize=8)
        ax.set_ylabel("total_ms - same request without the fault (ms)")
        ax.set_title("(1) extra latency per request", fontsize=10)
        ax.legend(fontsize=8)
        ax = axes[1]
        keys = list(summary)
        for x, key in enumerate(keys):
            vals = summary[key]["normal_after_s"]
            ys = [v for v in vals if v is not None]
            ax.scatter([x] * len(ys), ys, color="C3" if summary[key]["injected"] else "C2", s=16)
            if len(ys) < len(vals):
                ax.annotate(f"{len(vals) - len(ys)} never", (x, 0), fontsize=7, ha="center")
        ax.set_xticks(
            range(len(keys)),
            [k.replace(" (no fault)", "\n(none)") for k in keys],
            fontsize=7,
            rotation=30,
        )
        ax.set_ylabel("time to normal (s)")
        ax.set_title("(1) time until probes run clean", fontsize=10)
    o = report.get("overload")
    if o:
        ax = axes[2]
        mults = [s["multiplier"] for s in o["summary"].values()]
        for key, label, style in (
            ("reject_ms", "rejection p50", "C1--"),
            ("reject_ms", "rejection p99", "C1-"),
            ("admitted_ttft_ms", "admitted TTFT p50", "C0--"),
            ("admitted_ttft_ms", "admitted TTFT p99", "C0-"),
        ):
            q = "p99" if "p99" in label else "p50"
            ax.plot(
                mults, [s[key][q] for s in o["summary"].values()], style, marker="o", label=label
            )
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")  # one stalled burst must not flatten the others
        ax.set_xticks(mults, [f"{x}x" for x in mults])
        ax.set_xlabel(f"burst (x max_inflight {o['max_inflight']})")
        ax.set_ylabel("ms")
        ax.set_title("(2) overload at r1", fontsize=10)
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    i = report.get("itl")
    if i:
        ax = axes[3]
        for mode, d in i["itl_dist"].items():
            keep = [k for k, q in enumerate(d["q"]) if 1 - q / 100 > 1 / d["n"]]
            xs = [d["ms"][k] for k in keep] + [d["ms"][-1]]
            ys = [1 - d["q"][k] / 100 for k in keep] + [1 / d["n"]]
            ax.plot(xs, ys, label=mode)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlim(left=0.3)
        ax.set_xlabel("inter-token latency x (ms)")
        ax.set_ylabel("fraction of tokens with ITL > x")
        ax.set_title(f"(3) ITL of {i['streams']} streams, r0", fontsize=10)
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    for ax in axes:
        if not ax.has_data():
            ax.set_visible(False)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def section_markdown(report: dict[str, Any], notes: str) -> str:
    mc = report["machine"]
    parts = [
        SECTION,
        "",
        f"`{COMMAND}` ({report['duration_s']:.0f} s on a {mc['cpu_count']}-core box "
        f"({mc['cpu_model']}, shared: load average {mc['loadavg_1_5_15'][0]:.1f} at the start), "
        f"{mc['date']}, commit {mc['git_commit']}; `--quick` takes about a minute). Results: "
        "`benchmarks/results/faults.json`. The fleet of `benchmarks/fleet.py`: private Redis, "
        "prefill p0 p1, decode d0 d1, routers r0 and r1 (`--max-inflight 8`), the `tiny` model, "
        "1 torch thread per worker, router keepalive 0.5 s, registry TTL 1 s. The method is in "
        "the script's docstring.",
        "",
        "![faults](benchmarks/results/faults.png)",
        "",
    ]
    if "matrix" in report:
        parts += ["### Fault matrix", "", matrix_markdown(report["matrix"], report["sizes"]), ""]
    if "overload" in report:
        parts += ["### Overload", "", overload_markdown(report["overload"]), ""]
    if "itl" in report:
        parts += ["### Router ITL beside 1 MiB prompts", "", itl_markdown(report["itl"]), ""]
    if notes:
        parts += [notes.rstrip("\n"), ""]
    return "\n".join(parts)


# -- main ----------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("--quick", action="store_true", help="smoke run, about a minute")
    p.add_argument("--only", choices=("matrix", "overload", "itl"))
    p.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    p.add_argument("--notes", type=Path, help="markdown appended to the BENCHMARKS.md section")
    p.add_argument("--no-markdown-file", action="store_true", help="leave BENCHMARKS.md alone")
    p.add_argument("--replot", type=Path, help="only redraw plot and section from this JSON")
    args = p.parse_args(argv)
    notes = args.notes.read_text() if args.notes else ""
    if args.replot:
        saved = json.loads(args.replot.read_text())
        plot(saved, args.replot.with_suffix(".png"))
        body = section_markdown(saved, notes)
        print(body)
        if args.replot.resolve() == result_path(RESULTS_DIR, "faults") and not (
            args.no_markdown_file
        ):
            write_markdown_section(BENCHMARKS_MD, SECTION, body, before=BEFORE_SECTION)
        return 0
    sizes = QUICK if args.quick else FULL
    args.results_dir.mkdir(parents=True, exist_ok=True)
    run_dir = Path(tempfile.mkdtemp(prefix="tandem-bench-faults-"))
    log(f"fleet logs in {run_dir}")
    os.environ["TANDEM_NUM_THREADS"] = "1"  # 4 workers on 2 cores: no oversubscription
    report: dict[str, Any] = {
        "benchmark": "faults",
        "quick": args.quick,
        "command": " ".join([COMMAND, *(argv if argv is not None else sys.argv[1:])]),
        "machine": machine_info(grpc_version=grpc.__version__),
        "sizes": asdict(sizes),
        "run_dir": str(run_dir),
    }
    model_dir = make_tiny_model(run_dir / "tiny", preset="tiny")
    fleet = Fleet(model_dir, run_dir)
    try:
        fleet.start()
        log(f"fleet up: {fleet.addresses}")
        if args.only in (None, "matrix"):
            report["matrix"] = bench_matrix(fleet, sizes)
        if args.only in (None, "overload"):
            report["overload"] = bench_overload(fleet, sizes)
        if args.only in (None, "itl"):
            report["itl"] = bench_itl(fleet, sizes)
    finally:
        for proc in fleet.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)
        fleet.stop()
        REDIS_THREAD.shutdown()
    report["duration_s"] = time.perf_counter() - _START
    suffix = "-quick" if args.quick else ""
    json_path = result_path(args.results_dir, "faults", suffix)
    png_path = result_path(args.results_dir, "faults", suffix, "png")
    write_json(json_path, report, indent=1)
    plot(report, png_path)
    log(f"wrote {json_path} and {png_path}")
    body = section_markdown(report, notes)
    print(body)
    if (
        not args.quick
        and not args.only
        and is_default_results_dir(args.results_dir)
        and not args.no_markdown_file
    ):
        write_markdown_section(BENCHMARKS_MD, SECTION, body, before=BEFORE_SECTION)
        log(f"updated the '{SECTION}' section of {BENCHMARKS_MD}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
