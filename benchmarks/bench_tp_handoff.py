"""KV hand-off between tensor-parallel layouts: pull time of a prompt's KV for P TP=1 -> D TP=1,
P TP=2 -> D TP=1, P TP=1 -> D TP=2 and P TP=2 -> D TP=2, in the same run (issue 29).

    .venv/bin/python benchmarks/bench_tp_handoff.py [--quick] [--reps N] [--results-dir DIR]

An owner process (the prefill worker) registers two NIXL agents: one single cache of the
`small` benchmark model's geometry (12 layers, 4 KV heads, head_dim 64, block_size 16,
float32: 384 KiB a block), and one split over 2 ranks (2 heads each), each rank's cache in a
shared file mapped as a tensor-parallel worker's rank 0 maps them (tandem.engine.loading). This
(reader) process has the same two layouts as decode workers and times `KVTransport.read` of
512-, 2k- and 8k-token prompts (contiguous blocks) with the notification, as the decode worker
does: TP=1 -> TP=1 is today's single read; a split side goes through `RemoteKV.ranks`
(direct reads into a cache holding one source's heads, else staged whole blocks and copies).
Cases are interleaved rep by rep (a shared machine's load hits all alike); every read is
checked against the owner's contents. Reported: median ms and GB/s of the prompt's KV bytes.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import sys
import time
import uuid
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # siblings import by name
from report import RESULTS_DIR, machine_info, result_path, write_json

from tandem.engine.kv_cache import map_kv_file, shared_kv_dir
from tandem.services.common.runtime.process import configure_native_libraries
from tandem.transfer import KVTransport, RemoteKV
from tandem.transfer.nixl import NixlTransport

NUM_LAYERS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM = 12, 16, 4, 64
DTYPE = torch.float32
BLOCK_BYTES = NUM_LAYERS * 2 * BLOCK_SIZE * NUM_KV_HEADS * HEAD_DIM * 4
PROMPT_TOKENS = (512, 2048, 8192)
QUICK_PROMPT_TOKENS = (512, 2048)
PAIRS = ((1, 1), (2, 1), (1, 2), (2, 2))
POLL_S = 100e-6
_START = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - _START:7.1f}s] {msg}", file=sys.stderr, flush=True)


def contents(num_blocks: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    shape = (num_blocks, NUM_LAYERS, 2, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    return torch.rand(shape, generator=gen, dtype=DTYPE)


def make_caches(num_blocks: int, tp: int) -> list[tuple[torch.Tensor, int]]:
    """A TP=1 engine's cache (a plain tensor), or a TP engine's rank caches as rank 0 maps
    them (shared files, unlinked once mapped)."""
    if tp == 1:
        shape = (num_blocks, NUM_LAYERS, 2, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
        return [(torch.zeros(shape, dtype=DTYPE), 0)]
    per = NUM_KV_HEADS // tp
    out = []
    for r in range(tp):
        path = os.path.join(shared_kv_dir(), f"bench-tp-{uuid.uuid4().hex}")
        shape = (num_blocks, NUM_LAYERS, 2, BLOCK_SIZE, per, HEAD_DIM)
        out.append((map_kv_file(path, shape, DTYPE, create=True), r * per))
        os.unlink(path)
    return out


def register(name: str, caches: list[tuple[torch.Tensor, int]]) -> NixlTransport:
    t = NixlTransport(name)
    t.register(caches[0][0], ranks=caches if len(caches) > 1 else ())
    return t


def owner_main(conn: Connection, num_blocks: int) -> None:
    torch.set_num_threads(1)
    configure_native_libraries()
    whole = contents(num_blocks)
    transports = {}
    for tp in (1, 2):
        caches = make_caches(num_blocks, tp)
        for cache, start in caches:
            cache.copy_(whole[..., start : start + cache.shape[4], :])
        transports[tp] = register(f"bench-owner-tp{tp}", caches)
    del whole
    conn.send("ready")
    while True:
        for t in transports.values():
            t.poll()
        try:
            if not conn.poll(POLL_S):
                continue
            cmd, arg = conn.recv()
        except (EOFError, OSError):
            break
        if cmd == "export":
            tp, ids = arg
            conn.send(transports[tp].export(ids))
        elif cmd == "stop":
            break
    for t in transports.values():
        t.close()


def whole_view(caches: list[tuple[torch.Tensor, int]], ids: list[int]) -> torch.Tensor:
    parts = [cache[ids] for cache, _ in sorted(caches, key=lambda c: c[1])]
    return torch.cat(parts, dim=4)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    args = ap.parse_args()
    configure_native_libraries()
    torch.set_num_threads(1)
    sizes = QUICK_PROMPT_TOKENS if args.quick else PROMPT_TOKENS
    reps = args.reps or (5 if args.quick else 15)
    num_blocks = max(sizes) // BLOCK_SIZE + 8
    ctx = multiprocessing.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=owner_main, args=(child, num_blocks), daemon=True)
    proc.start()
    child.close()
    readers: dict[int, tuple[KVTransport, list[tuple[torch.Tensor, int]]]] = {}
    try:
        assert conn.poll(300) and conn.recv() == "ready"

        def export(tp: int, ids: list[int]) -> RemoteKV:
            conn.send(("export", (tp, ids)))
            assert conn.poll(60)
            remote: RemoteKV = conn.recv()
            return remote

        for tp in (1, 2):
            caches = make_caches(num_blocks, tp)
            readers[tp] = (register(f"bench-reader-tp{tp}", caches), caches)
        whole = contents(num_blocks)
        times: dict[tuple[int, int, int], list[float]] = {}
        for tokens in sizes:
            n = tokens // BLOCK_SIZE
            remote_ids = list(range(4, 4 + n))
            local_ids = list(range(2, 2 + n))
            handles = {p: export(p, remote_ids) for p in (1, 2)}
            for p, d in PAIRS:  # warm: connect, fault the pages, allocate staging
                readers[d][0].read(handles[p], local_ids, notif=b"w")
            for rep in range(reps):
                for p, d in PAIRS:
                    reader, caches = readers[d]
                    for cache, _ in caches:
                        cache[local_ids] = 0
                    t0 = time.perf_counter()
                    reader.read(handles[p], local_ids, notif=b"r")
                    dt = time.perf_counter() - t0
                    times.setdefault((tokens, p, d), []).append(dt)
                    if rep == 0:
                        assert torch.equal(whole_view(caches, local_ids), whole[remote_ids])
            log(f"{tokens} tokens done")
    finally:
        if proc.is_alive():
            conn.send(("stop", None))
            proc.join(30)
        for reader, _ in readers.values():
            reader.close()
    rows: list[dict[str, Any]] = []
    print("| prompt tokens | KV MiB | P TP -> D TP | pull ms (median) | GB/s | vs TP=1 -> TP=1 |")
    print("|---:|---:|:---:|---:|---:|---:|")
    for tokens in sizes:
        nbytes = tokens // BLOCK_SIZE * BLOCK_BYTES
        base = statistics.median(times[(tokens, 1, 1)])
        for p, d in PAIRS:
            ms = statistics.median(times[(tokens, p, d)]) * 1e3
            all_ms = [round(t * 1e3, 3) for t in times[(tokens, p, d)]]
            row = {"prompt_tokens": tokens, "kv_bytes": nbytes, "prefill_tp": p, "decode_tp": d}
            rows.append({**row, "pull_ms_median": round(ms, 3), "pull_ms_all": all_ms})
            print(
                f"| {tokens} | {nbytes / 2**20:.0f} | {p} -> {d} | {ms:.2f} | "
                f"{nbytes / ms / 1e6:.1f} | {ms / (base * 1e3):.2f}x |"
            )
    suffix = "-quick" if args.quick else ""
    write_json(
        result_path(args.results_dir, "tp_handoff", suffix),
        {"machine": machine_info(reps=reps), "rows": rows},
        indent=2,
    )


if __name__ == "__main__":
    main()
