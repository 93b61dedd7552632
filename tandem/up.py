"""`tandem up`: a whole cluster on one machine, as separate processes.

    redis  <-  prefill worker(s), decode worker(s)   (register + heartbeat)
    router ->  follows the registry, serves tandem.v1.Router on --port

Every child dies with this process (PR_SET_PDEATHSIG), and Ctrl-C stops them in order:
router first (no new requests), then workers (they drain), then Redis.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> None:
    # Runs in the child between fork and exec: a SIGKILLed supervisor leaves no orphans.
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


@dataclass(frozen=True, slots=True)
class UpConfig:
    model_dir: str
    host: str = "127.0.0.1"
    port: int = 50051
    num_prefill: int = 1
    num_decode: int = 1
    transport: str = "nixl"
    kv_cache_bytes: int = 256 << 20
    disagg_min_uncached_tokens: int = 64  # router: shorter prompts skip the prefill worker
    redis_port: int = 0  # 0: a unix socket in the run directory
    run_dir: str = ""  # logs and sockets; default: a fresh temporary directory
    ready_timeout_s: float = 120.0

    def __post_init__(self) -> None:
        if self.num_prefill < 0 or self.num_decode < 1:
            raise ValueError(
                f"need num_decode >= 1 and num_prefill >= 0, got {self.num_decode}, "
                f"{self.num_prefill}"
            )


@dataclass(slots=True)
class Child:
    name: str
    proc: subprocess.Popen[str]
    log_path: Path
    ready_line: str = ""


@dataclass(slots=True)
class Cluster:
    config: UpConfig
    children: list[Child] = field(default_factory=list)
    redis_url: str = ""
    router_address: str = ""
    run_dir: Path = Path()

    def start(self) -> None:
        import tempfile

        cfg = self.config
        self.run_dir = Path(cfg.run_dir or tempfile.mkdtemp(prefix="tandem-up-"))
        self.run_dir.mkdir(parents=True, exist_ok=True)
        redis_args = (
            ["--port", str(cfg.redis_port)]
            if cfg.redis_port
            else ["--unix-socket", str(self.run_dir / "redis.sock")]
        )
        redis = self._spawn("redis", ["services.common.redis_server", *redis_args], " at ")
        self.redis_url = redis.ready_line.rsplit(" at ", 1)[1].strip()
        common = [
            "--model-dir",
            cfg.model_dir,
            "--redis-url",
            self.redis_url,
            "--transport",
            cfg.transport,
            "--kv-cache-bytes",
            str(cfg.kv_cache_bytes),
        ]
        workers = [
            (f"{role}-{i}", role)
            for role, n in (("prefill", cfg.num_prefill), ("decode", cfg.num_decode))
            for i in range(n)
        ]
        for name, role in workers:
            self._spawn(
                name, [f"services.{role}", *common, "--worker-id", name], "READY", wait=False
            )
        for child in self.children[1:]:
            self._wait_ready(child, "READY")
        router = self._spawn(
            "router",
            [
                "services.router",
                "--model-dir",
                cfg.model_dir,
                "--redis-url",
                self.redis_url,
                "--host",
                cfg.host,
                "--port",
                str(cfg.port),
                "--disagg-min-uncached-tokens",
                str(cfg.disagg_min_uncached_tokens),
            ],
            "READY",
        )
        self.router_address = router.ready_line.split()[-1]

    def _spawn(self, name: str, module_args: list[str], ready: str, wait: bool = True) -> Child:
        log_path = self.run_dir / f"{name}.log"
        log_file = open(log_path, "w")  # noqa: SIM115 - owned by the child's lifetime
        proc = subprocess.Popen(
            [sys.executable, "-m", *module_args],
            stdout=subprocess.PIPE,
            stderr=log_file,
            text=True,
            preexec_fn=_die_with_parent,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        child = Child(name, proc, log_path)
        self.children.append(child)
        if wait:
            self._wait_ready(child, ready)
        return child

    def _wait_ready(self, child: Child, marker: str) -> None:
        assert child.proc.stdout is not None
        found: list[str] = []
        reader = threading.Thread(target=_read_until, args=(child.proc.stdout, marker, found))
        reader.start()
        reader.join(self.config.ready_timeout_s)
        if not found:
            tail = child.log_path.read_text()[-2000:] if child.log_path.exists() else ""
            self.stop()
            raise RuntimeError(f"{child.name} did not start (log {child.log_path}):\n{tail}")
        child.ready_line = found[0]

    def stop(self, timeout_s: float = 30.0) -> None:
        """SIGTERM in reverse start order (router, workers, redis), then SIGKILL stragglers."""
        for child in reversed(self.children):
            if child.proc.poll() is None:
                child.proc.send_signal(signal.SIGTERM)
                try:
                    child.proc.wait(timeout=timeout_s)
                except subprocess.TimeoutExpired:
                    child.proc.kill()
                    child.proc.wait()
        self.children.clear()

    def pids(self) -> list[int]:
        return [c.proc.pid for c in self.children]


def _read_until(stream: IO[str], marker: str, found: list[str]) -> None:
    for line in stream:
        if marker in line:
            found.append(line.strip())
            return


def wait_for_router(address: str, timeout_s: float = 60.0) -> None:
    """Until the router answers and at least one decode worker serves a request."""
    from tandem.client import TandemClient, TandemError

    deadline = time.monotonic() + timeout_s
    with TandemClient(address, timeout_s=30) as client:
        while True:
            try:
                client.generate([5], max_tokens=1)
                return
            except TandemError as exc:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"router at {address} not ready: {exc}") from None
                time.sleep(0.2)
