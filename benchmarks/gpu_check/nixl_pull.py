"""Part 3, nixl: a NIXL read of KV blocks from a second process (VRAM -> VRAM; DRAM with
--cpu) against a same-device copy of the same blocks, in GB/s (bytes moved / s). Skipped if
nixl is not importable. (Not `nixl.py`: that would shadow the nixl package.)

What it measures: both processes share the one GPU of the check machine, so UCX moves the
blocks by CUDA IPC inside that GPU. That is the NIXL/UCX software path and its descriptor
costs, not the deployed path: between pods (values-gpu.yaml) KV crosses RDMA NICs
(`rc` + GPUDirect), whose bandwidth and latency this part cannot tell."""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import math
import multiprocessing
import os
import random
import statistics
import time
from collections.abc import Callable, Sequence
from multiprocessing.connection import Connection
from typing import Any

import torch

from .common import Context, Figures, PartSkipped, sync

NIXL_OWNER, NIXL_READER = "gpu-check-owner", "gpu-check-reader"


def configure_nixl_env(device: str) -> None:
    """What a service on `device` does before it creates a transport (UCX settings, NIXL's
    logger)."""
    try:
        from tandem.services.common.runtime.process import configure_native_libraries
    except ImportError:
        # tandem.services.common.runtime.process imports the gRPC health/reflection packages, which
        # the GPU
        # machine lacks unless they are carried; these are its two effects.
        from tandem.transfer.nixl import ucx_env_defaults

        for key, value in ucx_env_defaults(device).items():
            os.environ.setdefault(key, value)
        if not os.environ.get("NIXL_LOG_LEVEL"):
            logging.getLogger("nixl").setLevel(logging.WARNING)
        return
    configure_native_libraries(device=device)


def kv_contents(shape: Sequence[int], device: str, seed: int = 0) -> torch.Tensor:
    """Random bf16 bit patterns, the same in any process on the same kind of device."""
    gen = torch.Generator(device=device).manual_seed(seed)
    bits = torch.randint(
        -(2**15), 2**15, tuple(shape), dtype=torch.int16, generator=gen, device=device
    )
    return bits.view(torch.bfloat16)


def _nixl_owner(conn: Connection, device: str, shape: tuple[int, ...]) -> None:
    """Owner process: register a known KV cache, export on request, poll() in between."""
    configure_nixl_env(device)
    from tandem.transfer import make_transport

    cache = kv_contents(shape, device)
    transport = make_transport("nixl", NIXL_OWNER)
    transport.register(cache)
    conn.send("ready")
    while True:
        transport.poll()
        try:
            if not conn.poll(100e-6):
                continue
            cmd, arg = conn.recv()
        except (EOFError, OSError):  # the reader went away
            break
        if cmd == "export":
            conn.send(transport.export(arg))
        elif cmd == "stop":
            break
    transport.close()


class NixlOwner:
    def __init__(self, device: str, shape: tuple[int, ...], timeout_s: float) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_nixl_owner, args=(child, device, shape), daemon=True)
        self.proc.start()
        child.close()
        if not self.conn.poll(timeout_s):
            self.proc.kill()
            raise RuntimeError(f"NIXL owner process not ready after {timeout_s:.0f} s")
        try:
            assert self.conn.recv() == "ready"
        except EOFError:
            self.proc.join(5)  # so that the exit code is known
            raise RuntimeError(
                f"NIXL owner process died (exit code {self.proc.exitcode})"
            ) from None

    def export(self, block_ids: Sequence[int]) -> Any:
        self.conn.send(("export", list(block_ids)))
        if not self.conn.poll(60):
            raise RuntimeError("NIXL owner did not answer export")
        return self.conn.recv()

    def stop(self) -> None:
        with contextlib.suppress(OSError):
            self.conn.send(("stop", None))
        self.proc.join(30)
        if self.proc.is_alive():
            self.proc.kill()
        self.conn.close()


def _time_s(fn: Callable[[], Any], device: str) -> float:
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t0


def check_nixl(ctx: Context) -> Figures:
    if importlib.util.find_spec("nixl") is None:
        raise PartSkipped("nixl is not importable (carry its wheel: see GPU.md)")
    s, dev = ctx.sizes, ctx.device
    configure_nixl_env(dev)  # before the owner starts: it inherits the environment
    from tandem.transfer import make_transport

    block_shape = s.nixl_block_shape
    owner_shape = (s.nixl_owner_blocks, *block_shape)
    reader_blocks = max(s.nixl_read_blocks)
    block_bytes = math.prod(block_shape) * 2
    memory = "VRAM" if ctx.cuda else "DRAM"
    ctx.log(
        f"nixl: owner {s.nixl_owner_blocks} blocks of {block_bytes / 2**20:.2f} MiB in "
        f"{memory}, reader {reader_blocks} blocks"
    )
    src = kv_contents(owner_shape, dev)  # the owner's bytes, regenerated here
    dst = torch.zeros((reader_blocks, *block_shape), dtype=torch.bfloat16, device=dev)
    owner = NixlOwner(dev, owner_shape, timeout_s=max(30.0, ctx.left_s() - 30))
    reader = None
    cases = []
    try:
        reader = make_transport("nixl", NIXL_READER)
        reader.register(dst)
        rng = random.Random(0)
        for n in s.nixl_read_blocks:
            for layout in ("contiguous", "scattered"):
                if layout == "contiguous":
                    start = rng.randrange(0, s.nixl_owner_blocks - n + 1)
                    remote_ids = list(range(start, start + n))
                else:
                    remote_ids = rng.sample(range(s.nixl_owner_blocks), n)
                cases.append(_nixl_case(ctx, owner, reader, src, dst, remote_ids, layout))
    finally:
        if reader is not None:
            reader.close()
        owner.stop()
    return {
        "memory_type": memory,
        "ucx_env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("UCX_")},
        "block_shape": list(block_shape),
        "block_bytes": block_bytes,
        "dtype": "bfloat16",
        "reps": s.nixl_reps,
        "gbps_unit": "1e9 bytes moved per second (median); a copy also reads them",
        "cases": cases,
    }


def _nixl_case(
    ctx: Context,
    owner: NixlOwner,
    reader: Any,
    src: torch.Tensor,
    dst: torch.Tensor,
    remote_ids: list[int],
    layout: str,
) -> Figures:
    dev, n = ctx.device, len(remote_ids)
    local_ids = list(range(n))
    remote = owner.export(remote_ids)
    index = torch.tensor(remote_ids, device=dev)
    expected = src[index]
    out = dst[:n]

    def nixl_read() -> None:
        reader.read(remote, local_ids)

    def copy_blocks() -> None:
        torch.index_select(src, 0, index, out=out)

    def bits(t: torch.Tensor) -> torch.Tensor:
        return t.view(torch.int16)  # random bit patterns include NaNs: compare bits

    for fn, what in ((nixl_read, "NIXL read"), (copy_blocks, "device copy")):
        out.zero_()
        # UCX copies on its own CUDA streams, unordered with this one: without the wait, the
        # zeroing could land after the read (it did for 1 GiB on the H200: "wrong data").
        sync(dev)
        fn()
        sync(dev)
        if not torch.equal(bits(out), bits(expected)):
            raise RuntimeError(f"{what} of {n} {layout} blocks returned wrong data")
    nixl_s, copy_s = [], []
    for _ in range(ctx.sizes.nixl_reps):
        nixl_s.append(_time_s(nixl_read, dev))
        copy_s.append(_time_s(copy_blocks, dev))
    if not torch.equal(bits(out), bits(expected)):
        raise RuntimeError(f"wrong data after the timed copies of {n} {layout} blocks")
    nbytes = n * src[0].numel() * src.element_size()
    nixl_gbps = nbytes / statistics.median(nixl_s) / 1e9
    copy_gbps = nbytes / statistics.median(copy_s) / 1e9
    case = {
        "blocks": n,
        "layout": layout,
        "mib": round(nbytes / 2**20, 1),
        "descriptors": reader.last_num_descriptors,
        "nixl_gbps": round(nixl_gbps, 2),
        "copy_gbps": round(copy_gbps, 2),
        "ratio_nixl_over_copy": round(nixl_gbps / copy_gbps, 3),
        "nixl_ms_median": round(statistics.median(nixl_s) * 1e3, 3),
        "copy_ms_median": round(statistics.median(copy_s) * 1e3, 3),
    }
    ctx.log(f"  nixl {n} {layout} blocks: {case}")
    return case
