"""Prefix-index benchmark: `RedisPrefixIndex` at cluster scale against a real Redis/Valkey.

    .venv/bin/python benchmarks/bench_index.py [--quick] [--blocks N] [--workers N]
        [--batch N] [--lookups N] [--concurrency N] [--unix] [--results-dir DIR]

It starts its own server (TCP on loopback by default, `--unix` for a unix socket) and:

1. builds a workload with realistic prefix sharing: shared "system prompt" prefixes (8-64
   blocks, Zipf-popular) each continued by conversations with a private tail (16-320
   blocks); every conversation lives on one of `--workers` workers (64), so popular prefixes
   are held by many workers. Conversations are added until `--blocks` distinct blocks (1M)
   are indexed;
2. loads it the way workers do: each worker joins (snapshot at seq 0) and then publishes its
   blocks in `EventBatch`es of `--batch` stored hashes, all workers concurrently through one
   client; reports events/s and batches/s;
3. times lookups of 256-block chains from one client, one at a time (latency p50/p90/p99/max
   and lookups/s) and with `--concurrency` in flight (lookups/s). The chain mix: 40% a
   returning conversation (its blocks, then new ones up to 256), 30% a new conversation on a
   shared prefix, 30% cold (nothing cached). A sample of answers is checked against the
   contract's reference computation. The first 5000 are timed again through redis-py's MGET
   (`fast_lookup=False`) for comparison, and 1-block lookups give the round-trip floor (on a
   busy machine, scheduling delays show up in every percentile);
4. times the operations that block Redis for a whole worker: re-snapshotting a worker's full
   set (unchanged, the common repair case), snapshotting it from scratch, and removing it.

The workload's Python structures are moved out of the garbage collector's reach (gc.freeze)
before timing, so collection pauses reflect a router's heap, not the benchmark's. Progress goes
to stderr, a markdown table to stdout, JSON to <results-dir>/index.json (`--quick`: 100k
blocks, fewer lookups, `index-quick.json`, under 30 s).
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import random
import socket
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis

sys.path.insert(0, str(Path(__file__).resolve().parent))  # siblings import by name
from report import RESULTS_DIR, machine_info, result_path, write_json

from tandem.index import ApplyResult, EventBatch
from tandem.index.base import leading_counts_reference
from tandem.services.common.redis.index import RedisPrefixIndex
from tandem.services.common.redis.server import RedisServer

SEED = 20240604
MODEL = "bench-model"
CHAIN_BLOCKS = 256
TARGET_P99_MS = 2.0
CHECKED_LOOKUPS = 200
REDIS_PY_LOOKUPS = 5000


def log(msg: str) -> None:
    print(f"[bench_index] {msg}", file=sys.stderr, flush=True)


@dataclass
class Workload:
    """Every worker's blocks in publication order, and the conversations they came from."""

    blocks: list[list[int]]  # per worker
    prefixes: list[list[int]]
    conversations: list[tuple[int, list[int]]] = field(default_factory=list)  # worker, chain
    distinct: int = 0

    @property
    def entries(self) -> int:
        return sum(len(b) for b in self.blocks)


def build_workload(num_workers: int, target_blocks: int, rng: random.Random) -> Workload:
    """Conversations over shared prefixes until `target_blocks` distinct hashes exist.

    Hashes are random u64s: real block hashes are BLAKE2b digests, just as uniform, and the
    index never looks inside them.
    """
    num_prefixes = max(16, target_blocks // 5000)
    prefixes = [
        [rng.getrandbits(64) for _ in range(rng.randint(8, 64))] for _ in range(num_prefixes)
    ]
    # Zipf(1) popularity: a few system prompts dominate, as in a real deployment.
    weights = [1.0 / (rank + 1) for rank in range(num_prefixes)]
    work = Workload(blocks=[[] for _ in range(num_workers)], prefixes=prefixes)
    held: list[set[int]] = [set() for _ in range(num_workers)]
    seen_prefix: set[int] = set()
    distinct = 0
    while distinct < target_blocks:
        p = rng.choices(range(num_prefixes), weights)[0]
        tail = [rng.getrandbits(64) for _ in range(rng.randint(16, 320))]
        worker = rng.randrange(num_workers)
        chain = prefixes[p] + tail
        for h in chain:
            if h not in held[worker]:
                held[worker].add(h)
                work.blocks[worker].append(h)
        if p not in seen_prefix:
            seen_prefix.add(p)
            distinct += len(prefixes[p])
        distinct += len(tail)
        work.conversations.append((worker, chain))
    work.distinct = distinct
    return work


def build_queries(work: Workload, n: int, rng: random.Random) -> list[list[int]]:
    """256-block chains: 40% returning conversations, 30% new on a shared prefix, 30% cold."""
    queries: list[list[int]] = []
    for _ in range(n):
        kind = rng.random()
        if kind < 0.4:
            _, chain = rng.choice(work.conversations)
            chain = chain[:CHAIN_BLOCKS]
        elif kind < 0.7:
            chain = list(rng.choice(work.prefixes))
        else:
            chain = []
        chain = chain + [rng.getrandbits(64) for _ in range(CHAIN_BLOCKS - len(chain))]
        queries.append(chain)
    return queries


def percentiles(samples_s: list[float]) -> dict[str, float]:
    ordered = sorted(samples_s)

    def pct(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1e3

    return {
        "p50_ms": pct(0.50),
        "p90_ms": pct(0.90),
        "p99_ms": pct(0.99),
        "max_ms": ordered[-1] * 1e3,
        "mean_ms": statistics.fmean(ordered) * 1e3,
    }


async def load(index: RedisPrefixIndex, work: Workload, batch_size: int) -> dict[str, Any]:
    """Every worker joins, then publishes its blocks in batches, all workers concurrently."""
    num_batches = 0

    async def publish(worker: int) -> None:
        nonlocal num_batches
        wid = f"worker-{worker:02d}"
        assert await index.snapshot(wid, MODEL, 1, 0, []) is ApplyResult.APPLIED
        blocks = work.blocks[worker]
        for seq, start in enumerate(range(0, len(blocks), batch_size), start=1):
            batch = EventBatch(wid, MODEL, 1, seq, tuple(blocks[start : start + batch_size]))
            result = await index.apply(batch)
            if result is not ApplyResult.APPLIED:
                raise RuntimeError(f"{wid} batch {seq}: {result}")
            num_batches += 1

    started = time.perf_counter()
    await asyncio.gather(*(publish(w) for w in range(len(work.blocks))))
    elapsed = time.perf_counter() - started
    return {
        "seconds": elapsed,
        "events": work.entries,
        "batches": num_batches,
        "batch_size": batch_size,
        "events_per_s": work.entries / elapsed,
        "batches_per_s": num_batches / elapsed,
    }


async def time_lookups(
    index: RedisPrefixIndex, queries: list[list[int]], concurrency: int
) -> dict[str, Any]:
    """Sequential latency over all queries, then throughput with `concurrency` in flight."""
    for chain in queries[:200]:  # warm the connections and the slot-table cache
        await index.lookup(MODEL, chain)
    samples: list[float] = []
    hits = 0
    started = time.perf_counter()
    for chain in queries:
        t0 = time.perf_counter()
        counts = await index.lookup(MODEL, chain)
        samples.append(time.perf_counter() - t0)
        hits += bool(counts)
    sequential_s = time.perf_counter() - started

    pending = iter(queries)

    async def client() -> None:
        for chain in pending:
            await index.lookup(MODEL, chain)

    started = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(concurrency)))
    concurrent_s = time.perf_counter() - started
    return {
        "lookups": len(queries),
        "chain_blocks": len(queries[0]),
        "hit_fraction": hits / len(queries),
        **percentiles(samples),
        "lookups_per_s": len(queries) / sequential_s,
        "concurrency": concurrency,
        "concurrent_lookups_per_s": len(queries) / concurrent_s,
    }


async def check_answers(index: RedisPrefixIndex, work: Workload, queries: list[list[int]]) -> int:
    """Compare a sample of lookups with the contract's reference computation."""
    holdings = {f"worker-{w:02d}": set(b) for w, b in enumerate(work.blocks)}
    for chain in queries[:CHECKED_LOOKUPS]:
        got = await index.lookup(MODEL, chain)
        want = leading_counts_reference(holdings, chain)
        if got != want:
            raise RuntimeError(f"lookup mismatch: got {got}, want {want}")
    return min(CHECKED_LOOKUPS, len(queries))


async def time_worker_ops(index: RedisPrefixIndex, work: Workload) -> dict[str, Any]:
    """Snapshot (unchanged set, then from scratch) and remove of the largest worker."""
    worker = max(range(len(work.blocks)), key=lambda w: len(work.blocks[w]))
    wid = f"worker-{worker:02d}"
    blocks = work.blocks[worker]
    epoch, seq = (await index.workers())[wid]
    t0 = time.perf_counter()
    assert await index.snapshot(wid, MODEL, epoch, seq, blocks) is ApplyResult.APPLIED
    t1 = time.perf_counter()
    await index.remove_worker(wid)
    t2 = time.perf_counter()
    assert await index.snapshot(wid, MODEL, epoch, seq, blocks) is ApplyResult.APPLIED
    t3 = time.perf_counter()
    return {
        "worker_blocks": len(blocks),
        "snapshot_unchanged_ms": (t1 - t0) * 1e3,
        "remove_worker_ms": (t2 - t1) * 1e3,
        "snapshot_fresh_ms": (t3 - t2) * 1e3,
    }


def free_tcp_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def server_info(url: str) -> dict[str, Any]:
    client = redis.Redis.from_url(url)
    try:
        info: dict[str, Any] = client.info()
        return {
            "server": info.get("server_name", "redis"),
            "version": info.get("valkey_version", info.get("redis_version")),
            "used_memory": info["used_memory"],
            "keys": client.dbsize(),
        }
    finally:
        client.close()


async def run(url: str, work: Workload, queries: list[list[int]], args: Any) -> dict[str, Any]:
    index = RedisPrefixIndex(url, socket_timeout_s=5.0)
    try:
        log(f"loading {work.entries:,} events from {len(work.blocks)} workers ...")
        loaded = await load(index, work, args.batch)
        log(f"loaded in {loaded['seconds']:.1f} s ({loaded['events_per_s']:,.0f} events/s)")
        memory = server_info(url)
        checked = await check_answers(index, work, queries)
        log(f"{checked} lookups match the reference; timing {len(queries):,} lookups ...")
        gc.collect()
        gc.freeze()  # the workload's millions of ints are not a router's heap
        lookups = await time_lookups(index, queries, args.concurrency)
        log(f"lookup p50 {lookups['p50_ms']:.3f} ms, p99 {lookups['p99_ms']:.3f} ms")
        # 1-block chains: the round trip plus fixed costs, i.e. the floor this machine's
        # scheduling noise puts under every percentile.
        floor = await time_lookups(index, [q[:1] for q in queries[:REDIS_PY_LOOKUPS]], 1)
        log(f"1-block lookup p50 {floor['p50_ms']:.3f} ms, p99 {floor['p99_ms']:.3f} ms")
        # The same lookups through redis-py's MGET (pure-Python parser: no hiredis here), to
        # show what the lean lookup client buys.
        slow = RedisPrefixIndex(url, socket_timeout_s=5.0, fast_lookup=False)
        try:
            baseline = await time_lookups(slow, queries[:REDIS_PY_LOOKUPS], args.concurrency)
        finally:
            await slow.close()
        log(f"redis-py lookup p50 {baseline['p50_ms']:.3f} ms, p99 {baseline['p99_ms']:.3f} ms")
        worker_ops = await time_worker_ops(index, work)
    finally:
        await index.close()
    return {
        "load": loaded,
        "redis": memory,
        "checked_lookups": checked,
        "lookup": lookups,
        "lookup_via_redis_py": baseline,
        "lookup_1_block": floor,
        "worker_ops": worker_ops,
    }


def markdown(payload: dict[str, Any]) -> str:
    """The headline numbers as a two-column markdown table."""
    w, mem, load_r = payload["workload"], payload["redis"], payload["load"]
    look, base, ops = payload["lookup"], payload["lookup_via_redis_py"], payload["worker_ops"]
    n = f"{ops['worker_blocks']:,}"
    per_entry = mem["used_memory"] / w["entries"]
    memory = f"{mem['used_memory'] / 2**20:,.0f} MiB ({per_entry:.0f} B/entry)"
    load_rate = (
        f"{load_r['events_per_s']:,.0f} events/s "
        f"({load_r['batches_per_s']:,.0f} batches/s of {load_r['batch_size']})"
    )
    baseline = (
        f"{base['p50_ms']:.3f} / {base['p99_ms']:.3f} ms ({base['lookups_per_s']:,.0f} lookups/s)"
    )
    one = payload["lookup_1_block"]
    floor = f"{one['p50_ms']:.3f} / {one['p99_ms']:.3f} ms"
    rows = [
        ("workers", f"{w['workers']}"),
        ("distinct blocks indexed", f"{w['distinct_blocks']:,}"),
        ("(worker, block) entries", f"{w['entries']:,}"),
        ("Redis memory", memory),
        ("load rate", load_rate),
        (f"lookup of {look['chain_blocks']} blocks: p50", f"{look['p50_ms']:.3f} ms"),
        ("lookup p90", f"{look['p90_ms']:.3f} ms"),
        ("lookup p99", f"{look['p99_ms']:.3f} ms (target < {TARGET_P99_MS} ms)"),
        ("lookup max", f"{look['max_ms']:.3f} ms"),
        ("lookups/s, one at a time", f"{look['lookups_per_s']:,.0f}"),
        (f"lookups/s, {look['concurrency']} in flight", f"{look['concurrent_lookups_per_s']:,.0f}"),
        ("lookups with a hit", f"{look['hit_fraction']:.0%}"),
        ("same lookups via redis-py MGET: p50 / p99", baseline),
        ("1-block lookups (round-trip floor): p50 / p99", floor),
        (f"snapshot of {n} blocks, unchanged", f"{ops['snapshot_unchanged_ms']:.0f} ms"),
        (f"snapshot of {n} blocks, fresh", f"{ops['snapshot_fresh_ms']:.0f} ms"),
        (f"remove worker of {n} blocks", f"{ops['remove_worker_ms']:.0f} ms"),
    ]
    lines = ["| metric | value |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in rows]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="100k blocks, fewer lookups")
    parser.add_argument("--blocks", type=int, default=None, help="distinct blocks to index")
    parser.add_argument("--workers", type=int, default=64, help="workers (at most 64)")
    parser.add_argument("--batch", type=int, default=64, help="stored hashes per EventBatch")
    parser.add_argument("--lookups", type=int, default=None, help="timed lookups")
    parser.add_argument("--concurrency", type=int, default=8, help="lookups in flight")
    parser.add_argument("--unix", action="store_true", help="unix socket instead of TCP")
    parser.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    args = parser.parse_args(argv)
    blocks = args.blocks if args.blocks is not None else (100_000 if args.quick else 1_000_000)
    lookups = args.lookups if args.lookups is not None else (2_000 if args.quick else 20_000)
    positive = {
        "--blocks": blocks,
        "--lookups": lookups,
        "--batch": args.batch,
        "--concurrency": args.concurrency,
        "--workers": args.workers,
    }
    for name, value in positive.items():
        if value < 1:
            parser.error(f"{name} must be >= 1, got {value}")
    if args.workers > 64:
        parser.error(f"--workers must be <= 64 (slots per model), got {args.workers}")

    t_start = time.perf_counter()
    rng = random.Random(SEED)
    work = build_workload(args.workers, blocks, rng)
    queries = build_queries(work, lookups, rng)
    log(
        f"workload: {work.distinct:,} distinct blocks, {work.entries:,} entries, "
        f"{len(work.conversations):,} conversations"
    )
    server = RedisServer(port=None if args.unix else free_tcp_port())
    with server:
        log(f"server {server.binary} at {server.url}")
        result = asyncio.run(run(server.url, work, queries, args))
    payload: dict[str, Any] = {
        "benchmark": "index",
        "quick": args.quick,
        "command": " ".join(["python", "benchmarks/bench_index.py", *sys.argv[1:]]),
        "machine": machine_info(redis_py=redis.__version__),
        "transport": "unix" if args.unix else "tcp-loopback",
        "workload": {
            "workers": args.workers,
            "distinct_blocks": work.distinct,
            "entries": work.entries,
            "conversations": len(work.conversations),
            "shared_prefixes": len(work.prefixes),
            "query_mix": {"returning": 0.4, "shared_prefix": 0.3, "cold": 0.3},
        },
        **result,
        "target_p99_ms": TARGET_P99_MS,
        "meets_target": result["lookup"]["p99_ms"] < TARGET_P99_MS,
        "duration_s": time.perf_counter() - t_start,
    }
    out = result_path(args.results_dir, "index", "-quick" if args.quick else "")
    write_json(out, payload, indent=2)
    log(f"wrote {out} in {payload['duration_s']:.1f} s")
    print(markdown(payload))
    return 0


if __name__ == "__main__":
    sys.exit(main())
