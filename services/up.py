"""`tandem up`: a whole cluster on one machine, as separate processes.

    redis  <-  prefill worker(s), decode worker(s)   (register + heartbeat)
    router ->  follows the registry, serves tandem.v1.Router on --port
    controller (--autoscale, in this process) -> starts and stops workers, serves
               tandem.v1.Admin on --admin-port for `tandem ctl`

Every child dies with this process (PR_SET_PDEATHSIG), and Ctrl-C stops them in order:
router first (no new requests), then workers (they drain), then Redis.
"""

from __future__ import annotations

import asyncio
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
    device: str = "cpu"  # every worker's engine; "cuda" puts them all on the visible GPU(s)
    dtype: str = "auto"
    disagg_min_uncached_tokens: int = 64  # router: shorter prompts skip the prefill worker
    redis_port: int = 0  # 0: a unix socket in the run directory
    run_dir: str = ""  # logs and sockets; default: a fresh temporary directory
    ready_timeout_s: float = 120.0
    autoscale: bool = False  # run the ratio controller with the local actuator
    admin_port: int = 50061  # the controller's admin API (with autoscale)
    controller_args: tuple[str, ...] = ()  # ControllerConfig flags, e.g. ("--max-prefill", "4")

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
    controller_address: str = ""
    run_dir: Path = Path()
    _worker_args: list[str] = field(default_factory=list)
    _next_index: dict[str, int] = field(default_factory=dict)
    _stopping: set[str] = field(default_factory=set)
    _lock: threading.RLock = field(default_factory=threading.RLock)
    _controller_stop: tuple[asyncio.AbstractEventLoop, asyncio.Event] | None = None
    _controller_thread: threading.Thread | None = None

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
        redis = self._spawn("redis", ["services.common.redis.server", *redis_args], " at ")
        self.redis_url = redis.ready_line.rsplit(" at ", 1)[1].strip()
        self._worker_args = [
            "--model-dir",
            cfg.model_dir,
            "--redis-url",
            self.redis_url,
            "--transport",
            cfg.transport,
            "--kv-cache-bytes",
            str(cfg.kv_cache_bytes),
            "--device",
            cfg.device,
            "--dtype",
            cfg.dtype,
        ]
        started = [
            self._spawn_worker(role)
            for role, n in (("prefill", cfg.num_prefill), ("decode", cfg.num_decode))
            for _ in range(n)
        ]
        for child in started:
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
        if cfg.autoscale:
            self._start_controller()

    # -- worker processes (also the local actuator's ProcessPool) ------------------------

    def _spawn_worker(self, role: str) -> Child:
        with self._lock:
            i = self._next_index.get(role, 0)
            self._next_index[role] = i + 1
            name = f"{role}-{i}"
            args = [f"services.{role}", *self._worker_args, "--worker-id", name]
            return self._spawn(name, args, "READY", wait=False)

    def workers(self, role: str) -> list[Child]:
        """Running workers of a role, oldest first, not counting those told to stop."""
        with self._lock:
            return [
                c
                for c in self.children
                if c.name.startswith(role + "-")
                and c.name not in self._stopping
                and c.proc.poll() is None
            ]

    def count(self, role: str) -> int:
        return len(self.workers(role))

    def add_worker(self, role: str) -> None:
        child = self._spawn_worker(role)
        print(f"started {child.name}", file=sys.stderr)

    def remove_worker(self, role: str) -> None:
        """SIGTERM the newest worker of `role`: it drains its requests, then exits."""
        with self._lock:
            victims = self.workers(role)
            if not victims:
                return
            child = victims[-1]
            self._stopping.add(child.name)
        child.proc.send_signal(signal.SIGTERM)
        print(f"draining {child.name}", file=sys.stderr)
        threading.Thread(target=self._reap, args=(child,), daemon=True).start()

    def _reap(self, child: Child) -> None:
        child.proc.wait()
        with self._lock:
            if child in self.children:
                self.children.remove(child)
            self._stopping.discard(child.name)

    def _start_controller(self) -> None:
        from services.common.flags import parse_config
        from services.controller.actuators import LocalActuator
        from services.controller.config import ControllerConfig
        from services.controller.server import Controller

        config = parse_config(
            ControllerConfig,
            [
                *self.config.controller_args,
                "--redis-url", self.redis_url,
                "--actuator", "local",
                "--host", self.config.host,
                "--port", str(self.config.admin_port),
                "--metrics-port", "0",
            ],
            prog="tandem up --controller-args",
        )  # fmt: skip
        ready = threading.Event()
        failure: list[BaseException] = []

        async def serve() -> None:
            stop = asyncio.Event()
            controller = Controller(config, LocalActuator(self))
            try:
                await controller.start()
            except BaseException as exc:
                failure.append(exc)
                ready.set()
                return
            self.controller_address = controller.address
            self._controller_stop = (asyncio.get_running_loop(), stop)
            ready.set()
            await stop.wait()
            await controller.stop()

        self._controller_thread = threading.Thread(
            target=asyncio.run, args=(serve(),), name="controller", daemon=True
        )
        self._controller_thread.start()
        ready.wait()
        if failure:
            self.stop()
            raise RuntimeError(f"controller did not start: {failure[0]}")

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
        """Stop the controller, then SIGTERM in reverse start order (router, workers, redis),
        then SIGKILL stragglers."""
        if self._controller_stop is not None:
            loop, event = self._controller_stop
            loop.call_soon_threadsafe(event.set)
            self._controller_stop = None
            if self._controller_thread is not None:
                self._controller_thread.join(timeout=10)
        with self._lock:
            rank = {"router": 0, "redis": 2}
            children = sorted(reversed(self.children), key=lambda c: rank.get(c.name, 1))
        for child in children:
            if child.proc.poll() is None:
                child.proc.send_signal(signal.SIGTERM)
                try:
                    child.proc.wait(timeout=timeout_s)
                except subprocess.TimeoutExpired:
                    child.proc.kill()
                    child.proc.wait()
        with self._lock:
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
