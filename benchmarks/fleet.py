"""The fault-matrix fleet: a private Redis, two prefill and two decode workers, two routers,
all real processes over real gRPC and NIXL. One fleet serves the whole fault suite
(tests/faults: each case restores what it broke, restarts the killed process under the same
worker id, and leaves the fleet clean, `Fleet.assert_clean`) and `benchmarks/bench_faults.py`.
It lives here, beside the benchmark, so that no benchmark imports test code.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import grpc

from tandem.services.common.redis.registry import Registry
from tandem.services.common.redis.server import RedisServer
from tandem.types import Role
from tandem.v1 import worker_pb2 as wpb
from tandem.v1 import worker_pb2_grpc as wgrpc

KV_BYTES = 32 << 20
WAIT_S = 60.0  # every wait in the suite is bounded by this
MAX_INFLIGHT = 8  # router r1's limit (the overload case); r0 keeps the default
WORKERS = {"p0": Role.PREFILL, "p1": Role.PREFILL, "d0": Role.DECODE, "d1": Role.DECODE}


def wait_until(what: str, ok: Callable[[], bool], timeout_s: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not ok():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f}s waiting until {what}")
        time.sleep(0.05)


class Fleet:
    """Args:
    roles: worker name -> role.
    routers: router name -> its extra flags.
    worker_args: flags every worker gets besides the fleet's own.
    """

    def __init__(
        self,
        model_dir: Path,
        run_dir: Path,
        roles: dict[str, str] | None = None,
        routers: dict[str, list[str]] | None = None,
        worker_args: tuple[str, ...] = (),
    ) -> None:
        self.model_dir = model_dir
        self.run_dir = run_dir
        self.roles = roles or WORKERS
        # r0 holds a stream whose decode workers all died for 2 s (tandem.routing.recovery:
        # hold_s), r1 not at all: the fault tests see both the hold's bound and a prompt fail
        self.routers = routers or {
            "r0": ["--stream-hold-s", "2"],
            "r1": ["--max-inflight", str(MAX_INFLIGHT), "--stream-hold-s", "0"],
        }
        self.worker_args = list(worker_args)
        self.redis = RedisServer(unix_socket=run_dir / "redis.sock", workdir=run_dir / "redis")
        self.procs: dict[str, subprocess.Popen[str]] = {}
        self.addresses: dict[str, str] = {}
        self._args: dict[str, list[str]] = {}

    # -- processes ---------------------------------------------------------------------------

    def start(self) -> None:
        self.redis.start()
        for name, role in self.roles.items():
            self._args[name] = [
                f"tandem.services.{role}",
                "--model-dir", str(self.model_dir),
                "--redis-url", self.redis.url,
                "--worker-id", name,
                "--kv-cache-bytes", str(KV_BYTES),
                "--heartbeat-interval-s", "0.2",
                "--registry-ttl-s", "1.0",
                "--lease-ttl-s", "3",
                "--drain-timeout-s", "2",
                *self.worker_args,
            ]  # fmt: skip
        for name, extra in self.routers.items():
            self._args[name] = [
                "tandem.services.router",
                "--model-dir", str(self.model_dir),
                "--redis-url", self.redis.url,
                "--port", "0",
                "--worker-refresh-s", "0.1",
                "--keepalive-s", "1.0",
                "--disagg-min-uncached-tokens", "32",
                *extra,
            ]  # fmt: skip
        for name in self.roles:
            self._spawn(name)
        for name in self.roles:
            self._wait_ready(name)
        for name in self.routers:
            self._spawn(name)
            self._wait_ready(name)
        self.wait_registered(*self.roles)

    def _spawn(self, name: str) -> None:
        log = (self.run_dir / f"{name}.log").open("a")
        self.procs[name] = subprocess.Popen(
            [sys.executable, "-m", *self._args[name]],
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
        )

    def _wait_ready(self, name: str) -> None:
        proc = self.procs[name]
        assert proc.stdout is not None
        line = proc.stdout.readline()  # READY comes within seconds, or the process exits
        log = (self.run_dir / f"{name}.log").read_text()[-3000:]
        assert line.startswith("READY"), f"{name} did not start:\n{log}"
        self.addresses[name] = line.split()[-1]

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        os.kill(self.procs[name].pid, sig)
        if sig == signal.SIGKILL:
            self.procs[name].wait(timeout=10)

    def restart(self, name: str) -> None:
        """Start a killed process again under its name (a new incarnation)."""
        assert self.procs[name].poll() is not None, f"{name} is still running"
        self._spawn(name)
        self._wait_ready(name)
        if name in self.roles:
            self.wait_registered(name)

    def wait_registered(self, *names: str) -> None:
        async def listed() -> set[str]:
            registry = Registry(self.redis.url)
            try:
                return {w.worker_id for w in await registry.list_workers()}
            except Exception:
                return set()
            finally:
                await registry.close()

        wait_until(f"{names} are registered", lambda: set(names) <= asyncio.run(listed()))
        time.sleep(0.3)  # the routers poll every 0.1 s

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
        self.redis.stop()

    # -- checks ------------------------------------------------------------------------------

    def stats(self, name: str) -> wpb.WorkerStats:
        prefill = self.roles[name] == Role.PREFILL
        stub_cls = wgrpc.PrefillWorkerStub if prefill else wgrpc.DecodeWorkerStub
        with grpc.insecure_channel(self.addresses[name]) as channel:
            return stub_cls(channel).GetStats(wpb.GetStatsRequest(), timeout=5)  # type: ignore[no-any-return]

    def assert_clean(self) -> None:
        """Every live worker has every block free, no lease pinned and no request left
        (waiting out leases of dead readers and aborts racing the end of calls)."""
        live = [n for n in self.roles if self.procs[n].poll() is None]
        last: dict[str, wpb.WorkerStats] = {}

        def clean() -> bool:
            for name in live:
                last[name] = self.stats(name)
            return all(
                s.num_free_blocks == s.num_blocks
                and s.num_pinned_requests == 0
                and s.num_running == 0
                and s.num_waiting == 0
                for s in last.values()
            )

        try:
            wait_until("no worker holds blocks, leases or requests", clean, timeout_s=15)
        except AssertionError as exc:
            raise AssertionError(f"{exc}: {last}") from None
        # Freed by the calls, aborts and leases themselves: the strict KV audit (on in
        # tests) found no accounting error and the orphan reaper had nothing to do.
        for name, s in last.items():
            assert s.num_audit_violations == 0 and s.num_reaped_blocks == 0, f"{name}: {s}"
