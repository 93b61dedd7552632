"""KV tiers (issue 44): what host memory and disk behind the device prefix cache buy, and
what they cost -- one engine in this process, every configuration in the same run.

    .venv/bin/python benchmarks/bench_kv_tiers.py workloads [--model-dir DIR] [--tiers LIST]
    .venv/bin/python benchmarks/bench_kv_tiers.py bandwidth
    .venv/bin/python benchmarks/bench_kv_tiers.py slow-disk [--model-dir DIR]
    .venv/bin/python benchmarks/bench_kv_tiers.py up [--model-dir DIR]
    .venv/bin/python benchmarks/bench_kv_tiers.py overhead [--model-dir DIR]

workloads: a multi-turn chat (conversations x turns, each turn its whole history plus a new
  user message) and an agent loop (agents with a long fixed prefix each, many short turns),
  each with a working set about 4x the device KV cache, served one request at a time:
  TTFT p50/p90 (add_request to first token: tier reads included), prompt tokens computed,
  hits per tier; tiers off, host, host + disk; and a workload with no reuse (throughput).
bandwidth: bringing a block back per tier (read + verify) against the floor -- a plain
  copy of the same bytes from memory, a plain read of the same file -- and verification
  (BLAKE2b keyed digest) per block against a copy.
slow-disk: a disk that takes 50 ms per write: decode ITL of requests that never use the
  tier, against no tiers, and the offloads the disk pushed back.
overhead: no reuse at all, every block written through to host memory and disk for
  nothing: two engines (none; host + disk) alternating over the same prompts, paired.
up: `tandem up` (Redis, a prefill and a decode worker, the router; --kv-cache-bytes 50000000
  per worker) with and without --kv-host-bytes 1000000000, a multi-turn chat through the
  Python client: TTFT as the client sees it, and the prompt tokens the workers had cached.

Default model: SmolLM2-135M-Instruct (the CLI's default; bfloat16 where the CPU runs it
natively, else float32). Writes benchmarks/results/kv_tiers.json and
benchmarks/plots/kv-tiers-ttft.png.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from tandem.config import CacheConfig, EngineConfig, SchedulerConfig
from tandem.engine.engine import LLMEngine
from tandem.engine.sampling import SamplingParams
from tandem.tiers import record
from tandem.tiers.cache import TierCache
from tandem.tiers.stores import DiskStore

ROOT = Path(__file__).resolve().parent
RESULTS = ROOT / "results" / "kv_tiers.json"
PLOT = ROOT / "plots" / "kv-tiers-ttft.png"
DEFAULT_MODEL = Path.home() / ".cache" / "tandem" / "models" / "SmolLM2-135M-Instruct"
BLOCK = 16
ANSWER = 8  # tokens generated per turn


def engine(model_dir: Path, device_tokens: int, tiers: str, disk_dir: str) -> LLMEngine:
    cache: dict[str, Any] = {"num_blocks": device_tokens // BLOCK + 8, "block_size": BLOCK}
    if "host" in tiers:
        cache["kv_host_bytes"] = 4 << 30
    if "disk" in tiers:
        cache["kv_disk_dir"], cache["kv_disk_bytes"] = disk_dir, 4 << 30
    cfg = EngineConfig(
        model_dir=str(model_dir),
        dtype="auto",
        cache=CacheConfig(**cache),
        scheduler=SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=8),
    )
    e = LLMEngine(cfg)
    e.warm_up()
    return e


def serve(e: LLMEngine, prompt: list[int], rid: str) -> tuple[float, list[int], int]:
    """One request alone: (TTFT s, its tokens, cached prompt tokens)."""
    params = SamplingParams(max_tokens=ANSWER, temperature=0.0, ignore_eos=True)
    t0 = time.perf_counter()
    request = e.add_request(e.spec(rid, prompt, params))
    ttft = None
    while e.has_unfinished():
        for out in e.step():
            if out.request_id == rid and out.new_token_ids and ttft is None:
                ttft = time.perf_counter() - t0
    assert ttft is not None
    return ttft, list(request.output_token_ids), request.num_cached_tokens or 0


def chat(vocab: int, conversations: int, turns: int, rng: random.Random) -> list[list[int]]:
    """Turn t of every conversation, then turn t + 1 of every one: each prompt is its
    conversation's history (earlier prompts and their answers, stood in for by fixed
    tokens here) plus a new message."""
    system = rng.choices(range(100, vocab), k=64)
    history = [list(system) for _ in range(conversations)]
    out = []
    for _ in range(turns):
        for c in range(conversations):
            history[c] += rng.choices(range(100, vocab), k=64)
            out.append(list(history[c]))
            history[c] += rng.choices(range(100, vocab), k=ANSWER)
    return out


def agents(vocab: int, num: int, turns: int, rng: random.Random) -> list[list[int]]:
    """`num` agents, each a 768-token fixed prefix (instructions, tool schemas) and a
    short turn (a tool result) per request, round robin."""
    prefixes = [rng.choices(range(100, vocab), k=768) for _ in range(num)]
    return [p + rng.choices(range(100, vocab), k=32) for _ in range(turns) for p in prefixes]


def no_reuse(vocab: int, n: int, rng: random.Random) -> list[list[int]]:
    return [rng.choices(range(100, vocab), k=256) for _ in range(n)]


def run_workload(
    model_dir: Path, name: str, prompts: list[list[int]], device: int, configs: list[str]
) -> list[dict]:
    rows, reference = [], None
    for tiers in configs:
        with tempfile.TemporaryDirectory() as disk:
            e = engine(model_dir, device, tiers, disk)
            ttfts, outputs, computed = [], [], 0
            t0 = time.perf_counter()
            for i, p in enumerate(prompts):
                ttft, toks, cached = serve(e, p, f"{name}-{i}")
                ttfts.append(ttft)
                outputs.append(toks)
                computed += len(p) - cached
            wall = time.perf_counter() - t0
            stats = {s.tier: s for s in e.tier_stats()}
            e.close()
        if reference is None:
            reference = outputs
        q = statistics.quantiles(ttfts, n=10)
        total = sum(map(len, prompts))
        tier_hits = sum(s.hit_tokens for s in stats.values())
        row = {
            "workload": name, "tiers": tiers, "requests": len(prompts),
            "prompt_tokens": total, "device_tokens": device,
            "ttft_p50_ms": round(statistics.median(ttfts) * 1e3, 1),
            "ttft_p90_ms": round(q[8] * 1e3, 1),
            "prefill_tokens_computed": computed,
            "hit_rate_device": round((total - computed - tier_hits) / total, 3),
            "hit_rate_host": round(stats["host"].hit_tokens / total, 3) if "host" in stats else 0.0,
            "hit_rate_disk": round(stats["disk"].hit_tokens / total, 3) if "disk" in stats else 0.0,
            "output_tokens_per_s": round(len(prompts) * ANSWER / wall, 1),
            "identical_to_no_tiers": outputs == reference,
            "skipped_offloads": sum(s.skipped_offloads for s in stats.values()),
            "digest_mismatches": sum(s.digest_mismatches for s in stats.values()),
        }  # fmt: skip
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def cmd_workloads(args: argparse.Namespace) -> dict:
    vocab = json.loads((args.model_dir / "config.json").read_text())["vocab_size"]
    rng = random.Random(0)
    device = args.device_tokens
    work = {
        "chat": chat(vocab, 16, 6, rng),  # ~9k tokens of histories
        "agent": agents(vocab, 12, 4, rng),  # 12 x 800 tokens
        "no-reuse": no_reuse(vocab, 24, rng),
    }
    rows = []
    for name, prompts in work.items():
        if name in args.workloads.split(","):
            rows += run_workload(args.model_dir, name, prompts, device, args.tiers.split(","))
    plot(rows)
    return {
        "workloads": rows,
        "model": args.model_dir.name,
        "torch_threads": torch.get_num_threads(),
    }


def plot(rows: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = [w for w in ("chat", "agent") if any(r["workload"] == w for r in rows)]
    fig, axes = plt.subplots(1, len(names), figsize=(5 * len(names), 3.5), squeeze=False)
    for ax, name in zip(axes[0], names, strict=True):
        sel = [r for r in rows if r["workload"] == name]
        x = range(len(sel))
        ax.bar([i - 0.2 for i in x], [r["ttft_p50_ms"] for r in sel], 0.4, label="p50")
        ax.bar([i + 0.2 for i in x], [r["ttft_p90_ms"] for r in sel], 0.4, label="p90")
        ax.set_xticks(list(x), [r["tiers"] for r in sel])
        ax.set_title(f"{name}: TTFT (ms), working set ~4x device KV")
        ax.legend()
    fig.tight_layout()
    PLOT.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(PLOT, dpi=110)


def timed(fn: Any, reps: int) -> float:
    fn()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t0) / reps


def cmd_bandwidth(args: argparse.Namespace) -> dict:
    """Per block size: host onload (verify; the copy into the device cache) and disk onload
    (read + verify) against a plain copy and a plain file read of the same bytes."""
    out = []
    ident = record.identity({"bench": 1})
    for block_bytes in (96 << 10, 1 << 20, 2 << 20):  # SmolLM2 bf16 / 1B / Llama-3-8B-shape
        src = torch.randint(0, 256, (block_bytes,), dtype=torch.uint8)
        n = 64
        with tempfile.TemporaryDirectory() as d:
            tiers = TierCache(ident, block_bytes, host_bytes=(n + 4) * block_bytes,
                              disk_dir=d, disk_bytes=(n + 4) * (block_bytes + 4096))  # fmt: skip
            for k in range(1, n + 1):
                tiers.offer(k, 0, src.clone())
            assert tiers.drain(60)
            keys = list(range(1, n + 1))

            def onload(tiers: TierCache = tiers, keys: list[int] = keys) -> None:
                job = tiers.onload(keys)
                job.done.wait()
                assert len(job.payloads) == len(keys)

            host_s = timed(onload, 3) / n
            assert tiers.host is not None and tiers.disk is not None
            for k in keys:  # the disk's records alone now
                tiers.host.drop(k)
            disk_s = timed(onload, 3) / n
            paths = [tiers.disk.path(k) for k in keys]
            read_s = timed(lambda ps=paths: [p.read_bytes() for p in ps], 3) / n
            tiers.close()
        # the floors over the same number of distinct blocks (not one block, cache-hot)
        many = torch.randint(0, 256, (n * block_bytes,), dtype=torch.uint8)
        into = torch.empty_like(many)
        copy_s = timed(lambda d=into, s=many: d.copy_(s), 3) / n
        view = memoryview(many.numpy())  # type: ignore[arg-type]
        verify_s = timed(lambda v=view: record.digest(ident, 1, 0, v), 3) / n
        row = {
            "block_bytes": block_bytes,
            "copy_gb_s": round(block_bytes / copy_s / 1e9, 2),
            "file_read_gb_s": round(block_bytes / read_s / 1e9, 2),
            "host_onload_gb_s": round(block_bytes / host_s / 1e9, 2),
            "disk_onload_gb_s": round(block_bytes / disk_s / 1e9, 2),
            "verify_gb_s": round(block_bytes / verify_s / 1e9, 2),
            "verify_vs_copy": round(verify_s / copy_s, 1),
        }
        print(json.dumps(row), flush=True)
        out.append(row)
    return {"bandwidth": out}


def cmd_slow_disk(args: argparse.Namespace) -> dict:
    """Requests that never hit the tier (distinct prompts) decode while a 50 ms-per-write
    disk takes every freed block: ITL against no tiers, same run."""
    original = DiskStore._write

    def slow(path: Path, header: bytes, payload: memoryview) -> None:
        time.sleep(0.05)
        original(path, header, payload)

    vocab = json.loads((args.model_dir / "config.json").read_text())["vocab_size"]
    rng = random.Random(1)
    prompts = no_reuse(vocab, 24, rng)
    rows = []
    for tiers in ("none", "slow disk", "none again"):
        DiskStore._write = staticmethod(slow) if tiers == "slow disk" else staticmethod(original)  # type: ignore[method-assign]
        with tempfile.TemporaryDirectory() as disk:
            e = engine(args.model_dir, 1024, "disk" if tiers == "slow disk" else "none", disk)
            params = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
            gaps: list[float] = []
            for i in range(0, len(prompts), 4):  # four at a time
                last: dict[str, float] = {}
                for j, p in enumerate(prompts[i : i + 4]):
                    e.add_request(e.spec(f"s{i}-{j}", p, params))
                while e.has_unfinished():
                    for out in e.step():
                        now = time.perf_counter()
                        if out.request_id in last and out.new_token_ids:
                            gaps.append(now - last[out.request_id])
                        last[out.request_id] = now
            stats = e.tier_stats()
            e.close()
        row = {
            "tiers": tiers,
            "itl_p50_ms": round(statistics.median(gaps) * 1e3, 2),
            "itl_p90_ms": round(statistics.quantiles(gaps, n=10)[8] * 1e3, 2),
            "skipped_offloads": sum(s.skipped_offloads for s in stats),
            "disk_blocks_written": sum(s.blocks for s in stats),
        }
        print(json.dumps(row), flush=True)
        rows.append(row)
    DiskStore._write = staticmethod(original)  # type: ignore[method-assign]
    return {"slow_disk": rows}


async def chat_through(address: str, prompts: list[list[int]]) -> tuple[list[float], list[int]]:
    """Each prompt in turn through the router: (TTFT s, cached prompt tokens) per request."""
    from tandem.client import AsyncTandemClient, Result

    ttfts, cached = [], []
    client = AsyncTandemClient(address)
    try:
        for p in prompts:
            result, t0, first = Result(), time.perf_counter(), 0.0
            async for _ in client.stream(
                p, max_tokens=ANSWER, temperature=0.0, ignore_eos=True, result=result
            ):
                first = first or time.perf_counter() - t0
            ttfts.append(first)
            cached.append(result.cached_prompt_tokens)
    finally:
        await client.close()
    return ttfts, cached


def cmd_up(args: argparse.Namespace) -> dict:
    from tandem.services.up import Cluster, UpConfig, wait_for_router

    vocab = json.loads((args.model_dir / "config.json").read_text())["vocab_size"]
    prompts = chat(vocab, 8, 5, random.Random(2))
    rows = []
    for host in (0, 1_000_000_000):
        config = UpConfig(model_dir=str(args.model_dir), port=0, http_port=0,
                          kv_cache_bytes=50_000_000, kv_host_bytes=host)  # fmt: skip
        cluster = Cluster(config)
        cluster.start()
        try:
            wait_for_router(cluster.router_address)
            ttfts, cached = asyncio.run(chat_through(cluster.router_address, prompts))
        finally:
            cluster.stop()
        row = {
            "kv_host_bytes": host, "requests": len(prompts),
            "prompt_tokens": sum(map(len, prompts)), "cached_prompt_tokens": sum(cached),
            "ttft_p50_ms": round(statistics.median(ttfts) * 1e3, 1),
            "ttft_p90_ms": round(statistics.quantiles(ttfts, n=10)[8] * 1e3, 1),
        }  # fmt: skip
        print(json.dumps(row), flush=True)
        rows.append(row)
    return {"up": rows}


def cmd_overhead(args: argparse.Namespace) -> dict:
    """What the tiers cost when nothing is reused: two engines in this process, one without
    tiers and one with host + disk, serving the same prompts (no shared prefix) alternately,
    the order swapped every request (a paired comparison: drift on this shared box hits
    both alike)."""
    vocab = json.loads((args.model_dir / "config.json").read_text())["vocab_size"]
    prompts = no_reuse(vocab, 40, random.Random(3))
    with tempfile.TemporaryDirectory() as disk:
        engines = {t: engine(args.model_dir, args.device_tokens, t, disk)
                   for t in ("none", "host+disk")}  # fmt: skip
        times: dict[str, list[float]] = {t: [] for t in engines}
        for i, p in enumerate(prompts):
            order = list(engines) if i % 2 == 0 else list(reversed(engines))
            for t in order:
                t0 = time.perf_counter()
                serve(engines[t], p, f"o{i}")
                times[t].append(time.perf_counter() - t0)
        stats = engines["host+disk"].tier_stats()
        for e in engines.values():
            e.close()
    base, tiered_ = (statistics.median(times[t]) for t in ("none", "host+disk"))
    row = {
        "requests": len(prompts), "prompt_tokens": 256, "output_tokens": ANSWER,
        "request_ms_p50_none": round(base * 1e3, 1),
        "request_ms_p50_tiers": round(tiered_ * 1e3, 1),
        "tiers_over_none": round(tiered_ / base, 3),
        "blocks_offloaded": {s.tier: s.blocks + s.evictions for s in stats},
        "skipped_offloads": sum(s.skipped_offloads for s in stats),
    }  # fmt: skip
    print(json.dumps(row), flush=True)
    return {"overhead": row}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("cmd", choices=("workloads", "bandwidth", "slow-disk", "up", "overhead"))
    parser.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL)
    parser.add_argument("--tiers", default="none,host,host+disk",
                        help="workloads: the configurations, in order (none first: the "
                        "reference outputs)")  # fmt: skip
    parser.add_argument("--workloads", default="chat,agent,no-reuse")
    parser.add_argument("--device-tokens", type=int, default=2048,
                        help="device KV cache, in tokens (the working sets are ~4x)")  # fmt: skip
    args = parser.parse_args()
    fn = {"workloads": cmd_workloads, "bandwidth": cmd_bandwidth, "slow-disk": cmd_slow_disk,
          "up": cmd_up, "overhead": cmd_overhead}  # fmt: skip
    result = fn[args.cmd](args)
    results = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    results.update(result)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
