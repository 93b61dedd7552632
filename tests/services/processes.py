"""Service processes for tests: `python -m <module>` with stderr to a log file, started once
its READY line names the bound address; and what /proc says about processes."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path


def spawn_logged(module: str, log: Path, *args: str) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", module, *args],
        stdout=subprocess.PIPE,
        stderr=log.open("w"),
        text=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.startswith("READY"), f"{module} failed to start: {log.read_text()[-2000:]}"
    return proc, line.split()[-1]


PAIR_KV_BYTES = 8 << 20  # each worker of a `worker_pair`


@contextlib.contextmanager
def worker_pair(
    model_dir: Path, logs: Path, prefill_args: tuple[str, ...], decode_args: tuple[str, ...]
) -> Iterator[dict[str, str]]:
    """A prefill and a decode worker on `model_dir` (each with its own extra flags, a small
    CPU KV cache), and a router that knows them only by address and sends every prompt to be
    prefilled on the prefill worker; logs in `logs`. Yields the three addresses ("router",
    "prefill", "decode"); stops them all on exit."""
    procs: list[subprocess.Popen[str]] = []

    def start(module: str, *args: str) -> str:
        proc, address = spawn_logged(module, logs / f"{module.split('.')[-1]}.log", *args)
        procs.append(proc)
        return address

    try:
        common = ("--model-dir", str(model_dir), "--kv-cache-bytes", str(PAIR_KV_BYTES))
        common += ("--device", "cpu")
        prefill = start(
            "tandem.services.prefill", *common, "--worker-id", "prefill-0", *prefill_args
        )
        decode = start("tandem.services.decode", *common, "--worker-id", "decode-0", *decode_args)
        router = start(
            "tandem.services.router", "--model-dir", str(model_dir), "--port", "0",
            "--prefill-addresses", prefill, "--decode-addresses", decode,
            "--disagg-min-uncached-tokens", "0",
        )  # fmt: skip
        yield {"router": router, "prefill": prefill, "decode": decode}
    finally:
        stop(*reversed(procs))


def stop(*procs: subprocess.Popen[str]) -> None:
    """Terminate `procs` in order, then wait for each (killed after 30 s)."""
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (a process binds it moments later)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def children_of(pid: int) -> list[int]:
    """Pids of the processes whose parent is `pid` (from /proc)."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(entry))
    return out


def alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"
