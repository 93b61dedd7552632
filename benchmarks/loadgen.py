"""Load generator for a Tandem router (or one decode worker, to measure the router's cost).

    python benchmarks/loadgen.py --router 127.0.0.1:50051 [--rate 2] [--concurrency 8]
        [--num-requests 64] [--prompt-len 64:256] [--output-len 64:128]
        [--mix 0.3:512-1024:8-32,0.7:16-48:128-256] [--num-prefixes 4 --prefix-len 256]
        [--ttft-sla-ms 2000] [--itl-sla-ms 100] [--json out.json]
    python benchmarks/loadgen.py --decode 127.0.0.1:PORT ...   # DecodeWorker.Decode directly

Workload: requests arrive as a seeded Poisson process at `--rate` per second (`--rate 0`:
closed loop, the next request is sent as soon as one of the `--concurrency` slots frees).
A semaphore caps the requests in flight in both cases, so an overloaded server shows up as
client-side queueing (reported as `queue`) instead of an unbounded pile of open streams.
Prompt and output lengths are drawn uniformly from inclusive ranges, per request class
(`--mix weight:prompt_lo-prompt_hi:out_lo-out_hi,...`). Prompts are random token ids from
the ordinary vocabulary; with `--num-prefixes N --prefix-len L` each prompt starts with one
of N shared L-token prefixes and continues with a unique suffix. Sampling is greedy with
ignore_eos, so every request produces exactly its drawn number of tokens.

Per request, measured on the client with `time.perf_counter`:
  TTFT   send -> first chunk carrying a token.
  ITL    gaps between successive chunks. A chunk carrying k tokens contributes k samples of
         gap / k: the tokens arrived together, and splitting the gap evenly keeps the
         statistics token-weighted and makes the ITLs of a request sum to its decode time
         (k - 1 zero gaps plus one full gap would report a burst as free tokens).
  E2E    send -> end of stream.
  queue  time spent waiting for a concurrency slot before the send.
Summary: p50/p90/p99 of each (ITL pooled over all tokens of all requests), output tokens/s
and requests/s over the measured window (first arrival -> last completion), and goodput:
requests/s that met the SLA (TTFT <= --ttft-sla-ms and that request's own ITL p90 <=
--itl-sla-ms). Failed requests count against goodput and are reported.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import random
import sys
import time
import uuid
from collections.abc import AsyncIterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parent))  # siblings import by name
from report import percentile, write_json

from tandem.client import AsyncTandemClient, Result, TandemError, build_request
from tandem.v1 import worker_pb2 as wpb
from tandem.v1 import worker_pb2_grpc as wgrpc

# Ids 0-4 are the special tokens of the tiny models; a BOS/EOS mid-prompt would be odd input.
FIRST_ORDINARY_ID = 5
DEFAULT_VOCAB_SIZE = 8192
PERCENTILES = (50, 90, 99)


# -- workload ------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class RequestClass:
    """One kind of request in the mix: its share and its (inclusive) length ranges."""

    weight: float
    prompt_len: tuple[int, int]
    output_len: tuple[int, int]
    name: str = ""

    def __post_init__(self) -> None:
        for label, (lo, hi) in (("prompt_len", self.prompt_len), ("output_len", self.output_len)):
            if not 1 <= lo <= hi:
                raise ValueError(f"{label} must be a range 1 <= lo <= hi, got {lo}-{hi}")
        if self.weight <= 0:
            raise ValueError(f"weight must be positive, got {self.weight}")

    @property
    def label(self) -> str:
        return self.name or (
            f"p{self.prompt_len[0]}-{self.prompt_len[1]}/o{self.output_len[0]}-{self.output_len[1]}"
        )


@dataclass(frozen=True, slots=True)
class Workload:
    """Everything that decides which requests are sent and when.

    `seed` fixes arrivals, classes and lengths; `prompt_salt` only the token contents, so
    two runs can share a workload's shape without sharing prompts (the workers' prefix
    caches would otherwise turn the second run's prefills into cache hits).
    """

    classes: tuple[RequestClass, ...]
    num_requests: int = 64
    rate: float = 0.0  # requests/s of the Poisson process; 0: closed loop
    concurrency: int = 8
    num_prefixes: int = 0
    prefix_len: int = 0
    seed: int = 0
    prompt_salt: int = 0
    vocab_size: int = DEFAULT_VOCAB_SIZE
    warmup_requests: int = 0  # sent (closed loop) and discarded before the measured run

    def __post_init__(self) -> None:
        if not self.classes:
            raise ValueError("need at least one request class")
        if self.num_requests <= 0 or self.concurrency <= 0:
            raise ValueError("num_requests and concurrency must be positive")
        if self.rate < 0:
            raise ValueError(f"rate must be >= 0, got {self.rate}")
        if self.num_prefixes and self.prefix_len <= 0:
            raise ValueError("num_prefixes needs a positive prefix_len")


@dataclass(frozen=True, slots=True)
class RequestSpec:
    index: int
    arrival_s: float  # offset from the start of the run
    prompt: list[int]
    max_tokens: int
    kind: str


def make_requests(w: Workload) -> list[RequestSpec]:
    """The run's requests, deterministic in (seed, prompt_salt)."""
    shape = random.Random(w.seed)
    tokens = random.Random(f"{w.seed}/{w.prompt_salt}")
    hi = w.vocab_size

    def ids(n: int) -> list[int]:
        return [tokens.randrange(FIRST_ORDINARY_ID, hi) for _ in range(n)]

    prefixes = [ids(w.prefix_len) for _ in range(w.num_prefixes)]
    weights = [c.weight for c in w.classes]
    specs = []
    t = 0.0
    for i in range(w.num_requests):
        if w.rate > 0 and i > 0:
            t += shape.expovariate(w.rate)
        cls = shape.choices(w.classes, weights)[0]
        prompt_len = shape.randint(*cls.prompt_len)
        max_tokens = shape.randint(*cls.output_len)
        prefix = prefixes[shape.randrange(len(prefixes))] if prefixes else []
        # The drawn length is the unique suffix's; a shared prefix comes on top of it.
        specs.append(RequestSpec(i, t, prefix + ids(prompt_len), max_tokens, cls.label))
    return specs


# -- targets -------------------------------------------------------------------------------


class Target(Protocol):
    """Where requests go. `stream` yields the number of tokens in each chunk received and
    may leave what the server said about the request (placement, timings) in `info`."""

    name: str

    def stream(self, spec: RequestSpec, info: dict[str, Any]) -> AsyncIterator[int]: ...

    async def close(self) -> None: ...


def _sampling_kwargs(spec: RequestSpec) -> dict[str, Any]:
    return {"max_tokens": spec.max_tokens, "temperature": 0.0, "ignore_eos": True}


class RouterTarget:
    """The public API, through the router (tandem.client)."""

    def __init__(self, address: str, name: str = "") -> None:
        self.name = name or f"router {address}"
        self.client = AsyncTandemClient(address)

    async def stream(self, spec: RequestSpec, info: dict[str, Any]) -> AsyncIterator[int]:
        result = Result()
        async for chunk in self.client.stream(spec.prompt, result=result, **_sampling_kwargs(spec)):
            yield len(chunk.token_ids)
        info.update(
            disaggregated=result.disaggregated,
            prefill_worker=result.prefill_worker,
            decode_worker=result.decode_worker,
            cached_prompt_tokens=result.cached_prompt_tokens,
            route_cached_tokens=result.route_cached_tokens,
            router_ttft_ms=result.first_token_ms,
        )

    async def close(self) -> None:
        await self.client.close()


class DecodeTarget:
    """One decode worker, called as the router would for a colocated request (no KV handle:
    the worker prefills itself). Same workload, minus the router hop."""

    def __init__(self, address: str) -> None:
        self.name = f"decode {address}"
        self.channel = grpc.aio.insecure_channel(address)
        self.stub = wgrpc.DecodeWorkerStub(self.channel)

    async def stream(self, spec: RequestSpec, info: dict[str, Any]) -> AsyncIterator[int]:
        # The router forwards the client's SamplingParams unchanged; build them the same way.
        sampling = build_request(spec.prompt, **_sampling_kwargs(spec)).sampling
        req = wpb.DecodeRequest(
            request_id=uuid.uuid4().hex, prompt_token_ids=spec.prompt, sampling=sampling
        )
        try:
            async for msg in self.stub.Decode(req):
                if msg.WhichOneof("kind") == "chunk":
                    yield len(msg.chunk.token_ids)
        except grpc.aio.AioRpcError as exc:
            raise TandemError(exc.code(), exc.details() or "") from None

    async def close(self) -> None:
        await self.channel.close()


# -- measurement ---------------------------------------------------------------------------


@dataclass(slots=True)
class RequestRecord:
    index: int
    kind: str
    prompt_tokens: int
    max_tokens: int
    arrival_s: float = 0.0  # scheduled, from the run's start
    queue_s: float = 0.0
    send_s: float = 0.0  # from the run's start
    ttft_s: float = math.nan
    e2e_s: float = math.nan
    output_tokens: int = 0
    num_chunks: int = 0
    itls_s: list[float] = field(default_factory=list)
    error: str = ""
    info: dict[str, Any] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.error and self.output_tokens == self.max_tokens

    def itl_p90(self) -> float:
        return percentile(self.itls_s, 90) if self.itls_s else 0.0


async def _one(
    target: Target, spec: RequestSpec, sem: asyncio.Semaphore, t0: float, holds_slot: bool
) -> RequestRecord:
    rec = RequestRecord(spec.index, spec.kind, len(spec.prompt), spec.max_tokens, spec.arrival_s)
    t_ready = time.perf_counter()
    if not holds_slot:
        await sem.acquire()
    try:
        t_send = time.perf_counter()
        rec.queue_s = t_send - t_ready
        rec.send_s = t_send - t0
        t_prev = t_send
        try:
            async for n in target.stream(spec, rec.info):
                t = time.perf_counter()
                if n <= 0:
                    continue  # a text-only chunk: no token, no ITL sample
                if rec.output_tokens == 0:
                    rec.ttft_s = t - t_send
                    # The first chunk's extra tokens (if any) arrived with token 1.
                    rec.itls_s.extend([0.0] * (n - 1))
                else:
                    rec.itls_s.extend([(t - t_prev) / n] * n)
                rec.output_tokens += n
                rec.num_chunks += 1
                t_prev = t
        except TandemError as exc:
            rec.error = str(exc)
        rec.e2e_s = time.perf_counter() - t_send
    finally:
        sem.release()
    if not rec.error and rec.output_tokens != spec.max_tokens:
        rec.error = f"got {rec.output_tokens} tokens, asked for {spec.max_tokens}"
    return rec


async def run_workload(target: Target, workload: Workload) -> RunResult:
    """Send the workload (after its warmup) and collect one record per request."""
    if workload.warmup_requests:
        # Closed loop, own prompts: warms the channels and the worker without leaving
        # cached prefixes behind for the measured requests.
        warm = replace(
            workload,
            num_requests=workload.warmup_requests,
            rate=0.0,
            prompt_salt=-1 - workload.prompt_salt,
        )
        await _run(target, make_requests(warm), warm.concurrency, closed_loop=True)
    specs = make_requests(workload)
    return await _run(target, specs, workload.concurrency, closed_loop=workload.rate == 0)


async def _run(
    target: Target, specs: Sequence[RequestSpec], concurrency: int, closed_loop: bool
) -> RunResult:
    sem = asyncio.Semaphore(concurrency)
    t0 = time.perf_counter()
    tasks = []
    for spec in specs:
        if closed_loop:
            # Take the slot here and hand it to the request, so the next one is created
            # only when a slot frees: sends keep arrival order and `queue` stays ~0.
            await sem.acquire()
        else:
            # Sleep to each arrival time (not by intervals), so scheduling delays don't add up.
            delay = t0 + spec.arrival_s - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(_one(target, spec, sem, t0, closed_loop)))
    records = list(await asyncio.gather(*tasks))
    return RunResult(records, time.perf_counter() - t0)


# -- statistics ----------------------------------------------------------------------------


def quantiles_ms(values: Sequence[float]) -> dict[str, float]:
    out = {f"p{q}": percentile(values, q) * 1e3 for q in PERCENTILES}
    out["mean"] = (sum(values) / len(values) * 1e3) if values else math.nan
    out["max"] = max(values) * 1e3 if values else math.nan
    return out


@dataclass(frozen=True, slots=True)
class Sla:
    ttft_ms: float
    itl_p90_ms: float

    def met(self, r: RequestRecord) -> bool:
        return r.ok and r.ttft_s * 1e3 <= self.ttft_ms and r.itl_p90() * 1e3 <= self.itl_p90_ms


@dataclass(slots=True)
class RunResult:
    records: list[RequestRecord]
    wall_s: float

    def itls(self, kind: str | None = None) -> list[float]:
        return [x for r in self.records if kind in (None, r.kind) for x in r.itls_s]

    def window(self) -> tuple[float, float]:
        """First send -> last completion (of any request, failed ones included)."""
        start = min((r.send_s for r in self.records), default=0.0)
        end = max((r.send_s + r.e2e_s for r in self.records if r.e2e_s == r.e2e_s), default=0.0)
        return start, max(start, end)

    @staticmethod
    def concat(results: Sequence[RunResult]) -> RunResult:
        """Several runs as if back to back: each run's window follows the previous one, so
        rates over the merged result are totals over the summed windows."""
        records = []
        offset = 0.0
        for res in results:
            start, end = res.window()
            for r in res.records:
                records.append(replace(r, send_s=r.send_s - start + offset))
            offset += end - start
        return RunResult(records, sum(r.wall_s for r in results))

    def summary(self, sla: Sla) -> dict[str, Any]:
        done = [r for r in self.records if r.ok]
        # Window: first send -> last completion, so a closed loop's warm start and the last
        # request's tail are both inside it, and an idle client tail is not.
        start, end = self.window()
        window = max(end - start, 1e-9)
        disagg = [r.info["disaggregated"] for r in done if "disaggregated" in r.info]
        out_tokens = sum(r.output_tokens for r in done)
        good = sum(1 for r in self.records if sla.met(r))
        kinds = sorted({r.kind for r in self.records})
        return {
            "num_requests": len(self.records),
            "num_ok": len(done),
            "num_failed": len(self.records) - len(done),
            "errors": sorted({r.error for r in self.records if r.error})[:5],
            "window_s": window,
            "output_tokens": out_tokens,
            "prompt_tokens": sum(r.prompt_tokens for r in done),
            "throughput_tok_s": out_tokens / window,
            "request_rate": len(done) / window,
            "goodput_req_s": good / window,
            "sla_met": good,
            "sla_met_fraction": good / len(self.records) if self.records else math.nan,
            "sla": asdict(sla),
            "ttft_ms": quantiles_ms([r.ttft_s for r in done]),
            "itl_ms": quantiles_ms(self.itls()),
            # Token 1 -> token 2: on a disaggregated request this gap holds the hand-off (KV
            # read, joining the decode batch), so it is worth seeing on its own.
            "second_token_gap_ms": quantiles_ms([r.itls_s[0] for r in done if r.itls_s]),
            "e2e_ms": quantiles_ms([r.e2e_s for r in done]),
            "queue_ms": quantiles_ms([r.queue_s for r in self.records]),
            "tokens_per_chunk": out_tokens / max(1, sum(r.num_chunks for r in done)),
            "num_chunks": sum(r.num_chunks for r in done),
            "disaggregated_fraction": (sum(disagg) / len(disagg)) if disagg else None,
            "by_kind": {
                k: {
                    "num_requests": sum(1 for r in self.records if r.kind == k),
                    "sla_met": sum(1 for r in self.records if r.kind == k and sla.met(r)),
                    "ttft_ms": quantiles_ms([r.ttft_s for r in done if r.kind == k]),
                    "itl_ms": quantiles_ms(self.itls(k)),
                    "second_token_gap_ms": quantiles_ms(
                        [r.itls_s[0] for r in done if r.kind == k and r.itls_s]
                    ),
                }
                for k in kinds
            }
            if len(kinds) > 1
            else {},
        }


def markdown_table(rows: Sequence[tuple[str, dict[str, Any]]]) -> str:
    """One row per (label, summary)."""
    head = (
        "| run | reqs ok | TTFT p50 / p90 / p99 (ms) | ITL p50 / p90 / p99 (ms) "
        "| E2E p50 / p99 (ms) | out tok/s | req/s | goodput req/s (met) |"
    )
    lines = [head, "|" + "---|" * 8]
    for label, s in rows:
        t, i, e = s["ttft_ms"], s["itl_ms"], s["e2e_ms"]
        lines.append(
            f"| {label} | {s['num_ok']}/{s['num_requests']} "
            f"| {t['p50']:.0f} / {t['p90']:.0f} / {t['p99']:.0f} "
            f"| {i['p50']:.1f} / {i['p90']:.1f} / {i['p99']:.1f} "
            f"| {e['p50']:.0f} / {e['p99']:.0f} "
            f"| {s['throughput_tok_s']:.1f} | {s['request_rate']:.2f} "
            f"| {s['goodput_req_s']:.2f} ({s['sla_met']}/{s['num_requests']}) |"
        )
    return "\n".join(lines)


# -- CLI -----------------------------------------------------------------------------------


def _range(raw: str) -> tuple[int, int]:
    lo, _, hi = raw.replace(":", "-").partition("-")
    return int(lo), int(hi or lo)


def parse_mix(raw: str) -> tuple[RequestClass, ...]:
    """`weight:prompt_lo-prompt_hi:out_lo-out_hi[,...]` -> request classes."""
    classes = []
    for part in raw.split(","):
        weight, prompt, output = part.split(":")
        classes.append(RequestClass(float(weight), _range(prompt), _range(output)))
    return tuple(classes)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0] if __doc__ else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--router", help="router address host:port (tandem.v1.Router)")
    where.add_argument("--decode", help="decode worker address: DecodeWorker.Decode directly")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--rate", type=float, default=0.0, help="Poisson req/s; 0 = closed loop")
    p.add_argument("--concurrency", type=int, default=8, help="max requests in flight")
    p.add_argument("--prompt-len", type=_range, default=(64, 256), help="LO-HI tokens")
    p.add_argument("--output-len", type=_range, default=(64, 128), help="LO-HI tokens")
    p.add_argument("--mix", type=parse_mix, help="W:P_LO-P_HI:O_LO-O_HI,... (overrides lens)")
    p.add_argument("--num-prefixes", type=int, default=0)
    p.add_argument("--prefix-len", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prompt-salt", type=int, default=0)
    p.add_argument("--vocab-size", type=int, default=DEFAULT_VOCAB_SIZE)
    p.add_argument("--warmup", type=int, default=0, help="requests sent and discarded first")
    p.add_argument("--ttft-sla-ms", type=float, default=2000.0)
    p.add_argument("--itl-sla-ms", type=float, default=100.0, help="bound on a request's ITL p90")
    p.add_argument("--json", type=Path, help="write the summary (and per-request data) here")
    return p.parse_args(argv)


def workload_from_args(args: argparse.Namespace) -> Workload:
    classes = args.mix or (RequestClass(1.0, args.prompt_len, args.output_len),)
    return Workload(
        classes=classes,
        num_requests=args.num_requests,
        rate=args.rate,
        concurrency=args.concurrency,
        num_prefixes=args.num_prefixes,
        prefix_len=args.prefix_len,
        seed=args.seed,
        prompt_salt=args.prompt_salt,
        vocab_size=args.vocab_size,
        warmup_requests=args.warmup,
    )


async def _main(args: argparse.Namespace) -> dict[str, Any]:
    target: Target = RouterTarget(args.router) if args.router else DecodeTarget(args.decode)
    workload = workload_from_args(args)
    try:
        result = await run_workload(target, workload)
    finally:
        await target.close()
    sla = Sla(args.ttft_sla_ms, args.itl_sla_ms)
    return {
        "target": target.name,
        "workload": asdict(workload),
        "summary": result.summary(sla),
        "requests": [
            {k: v for k, v in asdict(r).items() if k != "itls_s"} | {"itl_p90_s": r.itl_p90()}
            for r in result.records
        ],
    }


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    report = asyncio.run(_main(args))
    print(markdown_table([(report["target"], report["summary"])]))
    if args.json:
        write_json(args.json, report, indent=1)
    failed = report["summary"]["num_failed"]
    if failed:
        print(f"{failed} requests failed: {report['summary']['errors']}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
