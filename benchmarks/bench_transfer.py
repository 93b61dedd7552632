"""KV transfer benchmark: a decode process pulls a prompt's KV blocks from a prefill process.

    .venv/bin/python benchmarks/bench_transfer.py [--quick] [--cold] [--reps N]
        [--torch-threads N] [--no-hugepages] [--results-dir DIR]

The prefill (owner) process registers a KV cache with the geometry of the `small` benchmark
model (12 layers, 4 KV heads, head_dim 64, block_size 16, float32: 384 KiB per block) and keeps
calling `poll()`; this (reader) process reads the blocks of 512-, 2k- and 8k-token prompts with
`NixlTransport.read`, with the prompt's blocks (a) contiguous and (b) scattered (a random
sample, in random order) in the owner's cache, always into contiguous local blocks. Each read is
timed against an in-process copy of the same block pattern (`torch.index_select` into the same
destination) in the same run, interleaved rep by rep so that load from other processes on a
shared machine hits both alike. Reported: median GB/s (1e9 B/s) of each, NIXL / in-process.

`NIXL + notif` times the production path, a read that also tells the owner it is done; it
completes only once the owner's poll loop has run, so it adds up to one poll interval.

Fairness: the in-process copy runs on `--torch-threads` threads (default 1) because a NIXL read
moves the data on one thread (UCX cma: process_vm_readv in the reader's thread), and its source
tensor gets the same transparent huge pages as the registered caches (`--no-hugepages` turns
them off everywhere). At 512 tokens (12 MiB) the in-process copy runs largely from the CPU
caches; `--cold` evicts them before every timed operation, as after a real prefill.

Progress goes to stderr, a markdown table to stdout, JSON to <results-dir>/transfer.json and a
plot to <results-dir>/transfer.png (`--quick`: fewer sizes and reps, files suffixed `-quick`;
`--cold`: suffixed `-cold`).
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # siblings import by name
from report import RESULTS_DIR, machine_info, result_path, write_json

from tandem.services.common.runtime.process import configure_native_libraries
from tandem.transfer import RemoteKV, coalesce
from tandem.transfer.hugepages import advise_hugepages
from tandem.transfer.nixl import NixlTransport

# The `small` preset (tandem/weights/tiny.py) with the default block size, one block:
# [num_layers, 2 (K and V), block_size, num_kv_heads, head_dim]
NUM_LAYERS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM = 12, 16, 4, 64
BLOCK_SHAPE = (NUM_LAYERS, 2, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
DTYPE = torch.float32
BLOCK_BYTES = NUM_LAYERS * 2 * BLOCK_SIZE * NUM_KV_HEADS * HEAD_DIM * 4  # 393216

PROMPT_TOKENS = (512, 2048, 8192)
QUICK_PROMPT_TOKENS = (512, 2048)
LAYOUTS = ("contiguous", "scattered")
TARGET_RATIO = 0.70  # NIXL GB/s over in-process GB/s, at least
OWNER_NAME = "bench-prefill"
READER_NAME = "bench-decode"
OWNER_POLL_INTERVAL_S = 100e-6
COLD_SCRATCH_BYTES = 256 << 20
SEED = 0

_START = time.perf_counter()


def log(msg: str) -> None:
    """Progress line on stderr (stdout carries only the markdown report)."""
    print(f"[{time.perf_counter() - _START:7.1f}s] {msg}", file=sys.stderr, flush=True)


def owner_contents(num_blocks: int) -> torch.Tensor:
    """The owner's cache, reproducible in any process (the reader checks what it read)."""
    gen = torch.Generator().manual_seed(SEED)
    return torch.rand((num_blocks, *BLOCK_SHAPE), generator=gen, dtype=DTYPE)


# -- owner process -------------------------------------------------------------------------


def owner_main(conn: Connection, num_blocks: int, hugepages: bool) -> None:
    """Prefill side: register the cache, serve export requests, poll() in between."""
    torch.set_num_threads(1)
    # The environment is inherited from main(); this quiets NIXL's logger in this process.
    configure_native_libraries()
    transport = NixlTransport(OWNER_NAME, hugepages=hugepages)
    transport.register(owner_contents(num_blocks))
    conn.send(("ready", transport.hugepage_bytes))
    notifs = 0
    while True:
        notifs += len(transport.poll())
        try:
            if not conn.poll(OWNER_POLL_INTERVAL_S):
                continue
            cmd, arg = conn.recv()
        except (EOFError, OSError):  # the reader went away
            break
        if cmd == "export":
            conn.send(transport.export(arg))
        elif cmd == "notifs":
            conn.send(notifs)
        elif cmd == "stop":
            break
    transport.close()


class OwnerProcess:
    def __init__(self, num_blocks: int, hugepages: bool) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=owner_main, args=(child, num_blocks, hugepages), daemon=True)
        self.proc.start()
        child.close()
        if not self.conn.poll(300):
            raise RuntimeError("owner process did not start")
        ready, self.hugepage_bytes = self.conn.recv()
        assert ready == "ready"

    def call(self, cmd: str, arg: Any = None) -> Any:
        self.conn.send((cmd, arg))
        if not self.conn.poll(60):
            raise RuntimeError(f"owner did not answer {cmd!r}")
        return self.conn.recv()

    def export(self, block_ids: Sequence[int]) -> RemoteKV:
        remote = self.call("export", list(block_ids))
        assert isinstance(remote, RemoteKV)
        return remote

    def stop(self) -> None:
        if self.proc.is_alive():
            self.conn.send(("stop", None))
            self.proc.join(30)
        if self.proc.is_alive():
            self.proc.kill()
        self.conn.close()


# -- measurement ---------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Case:
    prompt_tokens: int
    layout: str
    num_blocks: int
    num_bytes: int
    descriptors: int
    nixl_gbps: float
    nixl_notif_gbps: float
    inproc_gbps: float
    ratio: float
    nixl_ms: list[float]
    nixl_notif_ms: list[float]
    inproc_ms: list[float]


def inproc_copy(
    src: torch.Tensor, dst: torch.Tensor, remote_ids: torch.Tensor, local_ids: Sequence[int]
) -> Callable[[], object]:
    """The same block pattern copied inside one process, in one pass over the data."""
    lo = local_ids[0]
    if list(local_ids) == list(range(lo, lo + len(local_ids))):
        out = dst[lo : lo + len(local_ids)]
        return lambda: torch.index_select(src, 0, remote_ids, out=out)
    local_t = torch.tensor(list(local_ids))
    return lambda: dst.index_copy_(0, local_t, src.index_select(0, remote_ids))


def time_once(fn: Callable[[], Any], scratch: torch.Tensor | None = None) -> float:
    """Seconds `fn` takes; with `scratch`, first (untimed) evict the CPU caches by writing it."""
    if scratch is not None:
        scratch.fill_(1.0)
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def measure(
    owner: OwnerProcess,
    reader: NixlTransport,
    src: torch.Tensor,
    prompt_tokens: int,
    layout: str,
    reps: int,
    rng: random.Random,
    scratch: torch.Tensor | None,
) -> Case:
    n = prompt_tokens // BLOCK_SIZE
    owner_blocks = src.shape[0]
    if layout == "contiguous":
        start = rng.randrange(0, owner_blocks - n + 1)
        remote_ids = list(range(start, start + n))
    else:
        remote_ids = rng.sample(range(owner_blocks), n)
    local_ids = list(range(n))
    remote = owner.export(remote_ids)
    dst = reader.kv_cache
    copy = inproc_copy(src, dst, torch.tensor(remote_ids), local_ids)
    expected = src[remote_ids]
    tag = f"{prompt_tokens}-{layout}"

    # Warm-up (connection, page faults, allocator) and a correctness check of both paths.
    for _ in range(2):
        dst.zero_()
        reader.read(remote, local_ids)
        if not torch.equal(dst[:n], expected):
            raise RuntimeError(f"{tag}: NIXL read returned wrong data")
        dst.zero_()
        copy()
        if not torch.equal(dst[:n], expected):
            raise RuntimeError(f"{tag}: in-process copy returned wrong data")
    descriptors = reader.last_num_descriptors
    assert descriptors == len(coalesce(remote_ids, local_ids))

    nixl_s: list[float] = []
    notif_s: list[float] = []
    inproc_s: list[float] = []
    methods: list[tuple[list[float], Callable[[], Any]]] = [
        (nixl_s, lambda: reader.read(remote, local_ids)),
        (inproc_s, copy),
        (notif_s, lambda: reader.read(remote, local_ids, notif=tag.encode())),
    ]
    for rep in range(reps):
        # Rotate the order so that no method always runs right after the same other one.
        for k in range(len(methods)):
            samples, fn = methods[(rep + k) % len(methods)]
            samples.append(time_once(fn, scratch))
    if not torch.equal(dst[:n], expected):
        raise RuntimeError(f"{tag}: wrong data after the timed reads")

    nbytes = n * BLOCK_BYTES

    def gbps(samples: list[float]) -> float:
        return nbytes / statistics.median(samples) / 1e9

    case = Case(
        prompt_tokens=prompt_tokens,
        layout=layout,
        num_blocks=n,
        num_bytes=nbytes,
        descriptors=descriptors,
        nixl_gbps=gbps(nixl_s),
        nixl_notif_gbps=gbps(notif_s),
        inproc_gbps=gbps(inproc_s),
        ratio=gbps(nixl_s) / gbps(inproc_s),
        nixl_ms=[s * 1e3 for s in nixl_s],
        nixl_notif_ms=[s * 1e3 for s in notif_s],
        inproc_ms=[s * 1e3 for s in inproc_s],
    )
    log(
        f"{tag}: {n} blocks, {descriptors} descriptors: NIXL {case.nixl_gbps:.2f} GB/s, "
        f"+notif {case.nixl_notif_gbps:.2f}, in-process {case.inproc_gbps:.2f} GB/s, "
        f"ratio {case.ratio:.2f}"
    )
    return case


# -- reporting -----------------------------------------------------------------------------


def machine_extra(torch_threads: int) -> dict[str, Any]:
    """This script's fields of the results' `machine` (report.machine_info)."""
    env = {k: v for k, v in os.environ.items() if k.startswith(("UCX_", "NIXL_"))}
    return {"torch_version": torch.__version__, "torch_threads": torch_threads, "ucx_nixl_env": env}


def markdown(cases: Sequence[Case]) -> str:
    lines = [
        "| prompt tokens | owner blocks | MiB | descriptors | NIXL GB/s | NIXL+notif GB/s "
        "| in-process GB/s | NIXL / in-process |",
        "|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for c in cases:
        ok = "" if c.ratio >= TARGET_RATIO else " (below target)"
        lines.append(
            f"| {c.prompt_tokens} | {c.layout} | {c.num_bytes / 2**20:.0f} | {c.descriptors} "
            f"| {c.nixl_gbps:.2f} | {c.nixl_notif_gbps:.2f} | {c.inproc_gbps:.2f} "
            f"| {c.ratio:.0%}{ok} |"
        )
    return "\n".join(lines)


def plot(cases: Sequence[Case], path: Path, quick: bool, cold: bool) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display on servers and CI
        import matplotlib.pyplot as plt
    except ImportError:
        log("plot: matplotlib is not installed (pip install -e '.[bench]'); skipping")
        return
    labels = [f"{c.prompt_tokens} tok\n{c.layout}" for c in cases]
    series = [
        ("NIXL read", [c.nixl_gbps for c in cases], "tab:blue"),
        ("NIXL read + notif", [c.nixl_notif_gbps for c in cases], "tab:cyan"),
        ("in-process copy", [c.inproc_gbps for c in cases], "tab:gray"),
    ]
    width = 0.27
    fig, ax = plt.subplots(figsize=(max(7.0, 1.6 * len(cases)), 4.8))
    for k, (name, values, color) in enumerate(series):
        xs = [i + (k - 1) * width for i in range(len(cases))]
        ax.bar(xs, values, width, label=name, color=color)
    for i, c in enumerate(cases):
        top = max(c.nixl_gbps, c.nixl_notif_gbps, c.inproc_gbps)
        ax.text(i, top * 1.02, f"{c.ratio:.0%}", ha="center", va="bottom", fontsize=9)
    ax.set_xticks(range(len(cases)), labels)
    ax.set_ylabel("GB/s (median)")
    ax.set_ylim(0, max(max(c.nixl_gbps, c.inproc_gbps, c.nixl_notif_gbps) for c in cases) * 1.3)
    ax.legend(loc="upper center", ncol=3, fontsize=9)
    title = (
        "KV pull prefill -> decode process (NIXL/UCX) vs in-process copy; "
        f"label: NIXL / in-process (target {TARGET_RATIO:.0%})"
    )
    title += f"\n{os.cpu_count()} CPUs, 1-min load average {os.getloadavg()[0]:.1f}"
    if cold:
        title += ", caches evicted before every operation"
    ax.set_title(title + ("\n--quick: not meaningful" if quick else ""), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    log(f"plot: wrote {path}")


# -- main ----------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer sizes and reps (smoke test)")
    parser.add_argument("--reps", type=int, default=None, help="timed reads per case (>= 10)")
    parser.add_argument("--torch-threads", type=int, default=1, help="threads of the copy")
    parser.add_argument(
        "--no-hugepages", action="store_true", help="keep 4 KiB pages (register(hugepages=False))"
    )
    parser.add_argument(
        "--cold",
        action="store_true",
        help="evict CPU caches before every timed operation (files suffixed -cold)",
    )
    parser.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    args = parser.parse_args(argv)
    reps = args.reps if args.reps is not None else (10 if args.quick else 20)
    if reps < 1:
        parser.error(f"--reps must be >= 1, got {reps}")
    tokens = QUICK_PROMPT_TOKENS if args.quick else PROMPT_TOKENS
    torch.set_num_threads(args.torch_threads)

    # Room for the largest prompt twice over, so that scattered blocks really are scattered.
    reader_blocks = max(tokens) // BLOCK_SIZE
    owner_blocks = 2 * reader_blocks
    log(
        f"owner cache {owner_blocks} blocks ({owner_blocks * BLOCK_BYTES / 2**20:.0f} MiB), "
        f"reader cache {reader_blocks} blocks, {reps} reps per case"
    )
    t0 = time.perf_counter()
    hugepages = not args.no_hugepages
    # Before the owner process starts (it inherits the environment): the UCX settings the
    # figures in BENCHMARKS.md were measured with, as in the services.
    configure_native_libraries()
    owner = OwnerProcess(owner_blocks, hugepages)
    reader = NixlTransport(READER_NAME, hugepages=hugepages)
    try:
        reader.register(torch.zeros((reader_blocks, *BLOCK_SHAPE), dtype=DTYPE))
        src = owner_contents(owner_blocks)  # the same bytes, in this process
        # The same page size as the NIXL owner's cache (register() moves it to huge pages),
        # so the in-process copy is not handicapped by 4 KiB-page TLB misses.
        src_huge = advise_hugepages(src) if hugepages else 0
        huge = {
            "owner": owner.hugepage_bytes,
            "reader": reader.hugepage_bytes,
            "in_process_src": src_huge,
        }
        log(f"bytes on huge pages: {huge}")
        log(f"setup done in {time.perf_counter() - t0:.1f}s")
        # Larger than any last-level cache we run on: written before every timed operation.
        scratch = torch.empty(COLD_SCRATCH_BYTES // 4, dtype=DTYPE) if args.cold else None
        rng = random.Random(SEED)
        cases = [
            measure(owner, reader, src, n, layout, reps, rng, scratch)
            for n in tokens
            for layout in LAYOUTS
        ]
        # Every notif read must have reached the owner (2 warm-up reads had none).
        deadline = time.monotonic() + 10
        while owner.call("notifs") < reps * len(cases) and time.monotonic() < deadline:
            time.sleep(0.01)
        notifs = owner.call("notifs")
        if notifs != reps * len(cases):
            raise RuntimeError(f"owner got {notifs} notifications, expected {reps * len(cases)}")
    finally:
        reader.close()
        owner.stop()

    suffix = ("-quick" if args.quick else "") + ("-cold" if args.cold else "")
    args.results_dir.mkdir(parents=True, exist_ok=True)
    out = result_path(args.results_dir, "transfer", suffix)
    payload = {
        "benchmark": "transfer",
        "quick": args.quick,
        "command": " ".join(["python", "benchmarks/bench_transfer.py", *sys.argv[1:]]),
        "machine": machine_info(**machine_extra(args.torch_threads)),
        "geometry": {
            "block_shape": list(BLOCK_SHAPE),
            "dtype": str(DTYPE),
            "block_bytes": BLOCK_BYTES,
            "owner_blocks": owner_blocks,
            "reader_blocks": reader_blocks,
        },
        "reps": reps,
        "cold_caches": args.cold,
        "hugepage_bytes": huge,
        "owner_poll_interval_s": OWNER_POLL_INTERVAL_S,
        "target_ratio": TARGET_RATIO,
        "meets_target": all(c.ratio >= TARGET_RATIO for c in cases),
        "duration_s": time.perf_counter() - t0,
        "results": [asdict(c) for c in cases],
    }
    write_json(out, payload, indent=2)
    log(f"wrote {out}")
    plot(cases, result_path(args.results_dir, "transfer", suffix, "png"), args.quick, args.cold)
    flags = "".join(f" (--{f})" for f in ("quick", "cold") if getattr(args, f))
    print(f"### KV transfer{flags}\n\n{markdown(cases)}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
