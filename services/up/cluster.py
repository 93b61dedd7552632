"""The Cluster of `tandem up` (see the package): start, scale, supervise, stop."""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import threading
import time
import traceback
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from tandem.services.common.redis.server import PASSWORD_ENV
from tandem.services.common.runtime.supervision import GiveUp, RestartPolicy, describe_exit
from tandem.services.up.autoscale import EmbeddedController, start_controller
from tandem.services.up.config import LOOPBACK_UCX_ENV, UpConfig, cpu_threads_per_worker
from tandem.services.up.processes import Child, say
from tandem.services.up.processes import free_port as _free_port
from tandem.services.up.processes import popen as _popen
from tandem.services.up.processes import read_until as _read_until
from tandem.services.up.processes import write_private as _write_private
from tandem.types import Role

if TYPE_CHECKING:
    from tandem.gpus import WorkerGpu

_SUPERVISE_POLL_S = 0.2


@dataclass(slots=True)
class _Recovery:
    """A child the supervisor is bringing back: waiting out its backoff, then its READY."""

    attempt: int
    reason: str  # why the previous process ended
    restart_at: float  # monotonic
    ready_by: float | None = None  # monotonic; set once the new process is started
    found: list[str] = field(default_factory=list)  # the ready line, once the reader sees it


@dataclass(slots=True)
class Cluster:
    config: UpConfig
    children: list[Child] = field(default_factory=list)
    redis_url: str = ""  # holds the Redis password: never print it (redact_url)
    router_address: str = ""
    http_address: str = ""  # host:port of the OpenAI HTTP API ("" when off)
    controller_address: str = ""
    run_dir: Path = Path()
    cluster_secret_file: Path = Path()
    api_key: str = ""  # with config.api_keys: the key of tenant "default"
    controller_metrics_address: str = ""  # with autoscale: the controller's /metrics
    _worker_args: list[str] = field(default_factory=list)
    _service_env: dict[str, str] = field(default_factory=dict)
    _next_index: dict[str, int] = field(default_factory=dict)
    _gpus: list[WorkerGpu] = field(default_factory=list)  # with a CUDA device
    _num_spawned: int = 0  # workers started, restarts not counted
    _cpu_threads: int = 0  # torch threads of each CPU worker (start() decides; 0: not set)
    _stopping: set[str] = field(default_factory=set)
    _lock: threading.RLock = field(default_factory=threading.RLock)
    _controller: EmbeddedController | None = None  # with autoscale
    # Supervision state. `failure` is the give-up message once the supervisor has stopped
    # the cluster; `_halt` ends restarts; `_released` lets the supervisor thread exit.
    failure: str | None = None
    _policy: RestartPolicy | None = None
    _recovering: dict[str, _Recovery] = field(default_factory=dict)
    _supervisor: threading.Thread | None = None
    # Starts the workers the controller adds. A child dies with the *thread* that started it
    # (PR_SET_PDEATHSIG), and the controller's own threads end before the children are
    # stopped: started from there, an added worker would be SIGKILLed instead of drained.
    _spawner: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(1, thread_name_prefix="spawner")
    )
    _halt: threading.Event = field(default_factory=threading.Event)
    _released: threading.Event = field(default_factory=threading.Event)
    _failed: threading.Event = field(default_factory=threading.Event)
    _stop_lock: threading.Lock = field(default_factory=threading.Lock)

    def start(self) -> None:
        import tempfile

        cfg = self.config
        if cfg.device.startswith("cuda"):  # before any process: raises ValueError
            from tandem.gpus import check_device, cuda_devices, place_workers  # torch: lazily

            check_device(cfg.device)  # CUDA there at all; each worker checks its budget
            num_workers = cfg.num_prefill + cfg.num_decode
            self._gpus = place_workers(
                num_workers, cuda_devices(cfg.device), cfg.gpu_memory_utilization
            )
        if cfg.num_threads or "OMP_NUM_THREADS" not in os.environ:  # else: torch reads it
            self._cpu_threads = cfg.num_threads or cpu_threads_per_worker(
                len(os.sched_getaffinity(0)),
                (cfg.num_prefill + cfg.num_decode) * cfg.tensor_parallel_size,  # ranks
                cfg.autoscale,
            )
        self.run_dir = Path(cfg.run_dir or tempfile.mkdtemp(prefix="tandem-up-"))
        self.run_dir.mkdir(parents=True, exist_ok=True)
        redis_args = (
            ["--port", str(cfg.redis_port)]
            if cfg.redis_port
            else ["--unix-socket", str(self.run_dir / "redis.sock")]
        )
        # A --dir of ours: a SIGKILLed server wrapper would leak a temporary one per restart.
        redis_args += ["--dir", str(self.run_dir / "redis-data")]
        redis = self._spawn(
            "redis",
            ["tandem.services.common.redis.server", *redis_args],
            " at ",
            env={PASSWORD_ENV: secrets.token_urlsafe(32)},
        )
        self.redis_url = redis.ready_line.rsplit(" at ", 1)[1].strip()
        self.cluster_secret_file = _write_private(
            self.run_dir / "cluster.secret", secrets.token_bytes(32).hex()
        )
        key_args = []
        if cfg.api_keys:
            self.api_key = secrets.token_urlsafe(32)
            keys = _write_private(self.run_dir / "api-keys", f"{self.api_key} default\n")
            key_args = ["--api-keys-file", str(keys)]
        ucx = {k: v for k, v in LOOPBACK_UCX_ENV.items() if k not in os.environ}
        self._service_env = {"TANDEM_REDIS_URL": self.redis_url, **ucx}
        # The rest of a worker's flags come from the config (UpConfig.worker_args, per name).
        self._worker_args = ["--cluster-secret-file", str(self.cluster_secret_file)]
        started = [
            self._spawn_worker(role)
            for role, n in ((Role.PREFILL, cfg.num_prefill), (Role.DECODE, cfg.num_decode))
            for _ in range(n)
        ]
        for child in started:
            self._wait_ready(child, "READY")
        http_args = []
        if cfg.http_port >= 0:
            # Fixed here, not by the router: a restarted router comes back on the same port.
            self.http_address = f"{cfg.host}:{cfg.http_port or _free_port(cfg.host)}"
            http_args = ["--http-port", self.http_address.rsplit(":", 1)[1]]
        router = self._spawn(
            "router",
            [
                "tandem.services.router",
                "--model-dir",
                cfg.model_dir,
                "--cluster-secret-file",
                str(self.cluster_secret_file),
                "--host",
                cfg.host,
                "--port",
                str(cfg.port),
                "--disagg-min-uncached-tokens",
                str(cfg.disagg_min_uncached_tokens),
                "--max-queue-delay-s",
                str(cfg.max_queue_delay_s),
                "--tool-call-parser",
                cfg.tool_call_parser,
                *key_args,
                *http_args,
                *self._metrics_args(),
            ],
            "READY",
            env=self._service_env,
        )
        self.router_address = router.ready_line.split()[-1]
        # A restarted router must come back where clients know it, even after --port 0.
        port_at = router.module_args.index("--port") + 1
        router.module_args[port_at] = self.router_address.rsplit(":", 1)[1]
        if cfg.autoscale:
            try:
                self._controller = start_controller(
                    cfg, self, self.redis_url, self.cluster_secret_file
                )
            except RuntimeError:
                self.stop()
                raise
            self.controller_address = self._controller.address
            self.controller_metrics_address = self._controller.metrics_address
        self._start_supervisor()

    # -- worker processes (also the local actuator's ProcessPool) ------------------------

    def _spawn_worker(self, role: str) -> Child:
        with self._lock:
            i = self._next_index.get(role, 0)
            self._next_index[role] = i + 1
            name = f"{role}-{i}"
            if self.config.kv_disk_dir:  # its own directory (a restart reuses it)
                Path(self.config.worker_disk_dir(name)).mkdir(parents=True, exist_ok=True)
            args = [f"tandem.services.{role}", *self.config.worker_args(name)]
            args += [*self._worker_args, "--worker-id", name]
            args += self._device_args()
            args += self._metrics_args()
            return self._spawn(name, args, "READY", wait=False, env=self._service_env)

    @property
    def metrics_addresses(self) -> dict[str, str]:
        """Child name ("router", "prefill-0", "decode-0", ...; "controller" with autoscale)
        -> "host:port" of its Prometheus /metrics, for the processes running now."""
        with self._lock:
            found = {c.name: c.metrics_address for c in self.children if c.metrics_address}
        if self.controller_metrics_address:
            found["controller"] = self.controller_metrics_address
        return found

    def _device_args(self) -> list[str]:
        """The next worker's device flags. On GPUs, the place of the next worker in start
        order; a worker added later (autoscale) takes the place of the initial one it
        wraps around to, and its start-up check refuses it if that GPU has no room left."""
        if not self._gpus:
            threads = ["--num-threads", str(self._cpu_threads)] if self._cpu_threads else []
            return ["--device", self.config.device, *threads]
        gpu = self._gpus[self._num_spawned % len(self._gpus)]
        self._num_spawned += 1
        return ["--device", gpu.device, "--gpu-memory-utilization", str(gpu.gpu_memory_utilization)]

    def _metrics_args(self) -> list[str]:
        """A free port for a child's /metrics, fixed in its arguments (a restart reuses it)."""
        return ["--metrics-port", str(_free_port(self.config.host))]

    def workers(self, role: str) -> list[Child]:
        """Running workers of a role (and crashed ones being restarted), oldest first, not
        counting those told to stop."""
        with self._lock:
            return [
                c
                for c in self.children
                if c.name.startswith(role + "-")
                and c.name not in self._stopping
                and (c.proc.poll() is None or c.name in self._recovering)
            ]

    def count(self, role: str) -> int:
        """Workers of `role` asked for; one still starting counts (it is not added again)."""
        return len(self.workers(role))

    def worker_pids(self) -> list[int]:
        """Every worker process running now, starting and draining ones included: what
        holds the host's cores and memory (the local actuator's capacity)."""
        with self._lock:
            return [
                c.proc.pid
                for c in self.children
                if c.name.startswith(("prefill-", "decode-")) and c.proc.poll() is None
            ]

    def add_worker(self, role: str) -> None:
        """Start one more worker of `role` (from any thread: see `_spawner`)."""
        child = self._spawner.submit(self._spawn_worker, role).result()
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
            self._recovering.pop(child.name, None)
            if self._policy is not None:
                self._policy.forget(child.name)

    def _spawn(
        self,
        name: str,
        module_args: list[str],
        ready: str,
        wait: bool = True,
        env: dict[str, str] | None = None,
    ) -> Child:
        log_path = self.run_dir / f"{name}.log"
        env = dict(env or {})
        proc = _popen(module_args, log_path, "w", env=env)
        child = Child(name, proc, log_path, module_args, ready, env=env)
        if "--metrics-port" in module_args:
            port = module_args[module_args.index("--metrics-port") + 1]
            child.metrics_address = f"{self.config.host}:{port}"
        with self._lock:
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
        """End supervision, stop the controller, then SIGTERM in reverse start order (router,
        workers, redis), then SIGKILL stragglers. Idempotent; safe from any thread."""
        self._halt.set()
        with self._stop_lock:
            with self._lock:
                # Taking the lock waits out a supervisor pass already under way; later passes
                # see _halt and restart nothing.
                self._recovering.clear()
            if self._controller is not None:
                self._controller.stop()
                self._controller = None
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
            # Only now may the supervisor thread end: PR_SET_PDEATHSIG fires when the *thread*
            # that started a child exits, and it started every restarted child.
            self._released.set()
            self._spawner.shutdown(wait=False)
            supervisor = self._supervisor
            if supervisor is not None and supervisor is not threading.current_thread():
                supervisor.join(timeout=10)

    # -- supervision ----------------------------------------------------------------------

    def wait_failure(self, timeout_s: float | None = None) -> str | None:
        """Block until the supervisor has given up and stopped the cluster (return its
        message) or `timeout_s` passes (return None)."""
        self._failed.wait(timeout_s)
        return self.failure

    def _start_supervisor(self) -> None:
        self._policy = RestartPolicy(self.config.restart_config())
        self._supervisor = threading.Thread(target=self._supervise, name="supervisor", daemon=True)
        self._supervisor.start()

    def _supervise(self) -> None:
        while not self._halt.wait(_SUPERVISE_POLL_S):
            try:
                gave_up = self._supervise_once(time.monotonic())
            except Exception:  # a bug here must not end the thread (and kill its children)
                traceback.print_exc(file=sys.stderr)
                continue
            if gave_up is not None:
                say(gave_up)
                self.failure = gave_up
                try:
                    self.stop()
                finally:
                    self._failed.set()
                break
        self._released.wait()

    def _supervise_once(self, now: float) -> str | None:
        """One pass over the children: start those whose backoff is over, report those that
        are back, and decide for those that exited. Returns a give-up message, if any."""
        assert self._policy is not None
        with self._lock:
            if self._halt.is_set():
                return None
            for child in self.children:
                if child.name in self._stopping:
                    continue  # told to drain: its exit is expected (_reap forgets it)
                recovery = self._recovering.get(child.name)
                if recovery is not None and recovery.ready_by is None:
                    if now >= recovery.restart_at:
                        self._restart(child, recovery, now)
                    continue
                code = child.proc.poll()
                pid = child.proc.pid
                if recovery is not None:  # restarted: waiting for its ready line
                    if recovery.found:
                        child.ready_line = recovery.found[0]
                        del self._recovering[child.name]
                        say(f"{child.name} back (pid {pid})")
                        continue
                    assert recovery.ready_by is not None
                    if code is None and now < recovery.ready_by:
                        continue
                    if code is None:
                        child.proc.kill()
                        child.proc.wait()
                        reason = f"not ready within {self.config.ready_timeout_s:g} s"
                    else:
                        reason = describe_exit(code) + " before it was ready"
                elif code is None:
                    continue
                else:
                    reason = describe_exit(code)
                decision = self._policy.on_exit(child.name, now)
                if isinstance(decision, GiveUp):
                    return (
                        f"{child.name} (pid {pid}) {reason}; giving up on it: "
                        f"{decision.reason}. Its log: {child.log_path}. Stopping the cluster."
                    )
                self._recovering[child.name] = _Recovery(
                    decision.attempt, reason, now + decision.delay_s
                )
                say(
                    f"{child.name} (pid {pid}) {reason}; restarting in {decision.delay_s:g}s "
                    f"(restart {decision.attempt})"
                )
        return None

    def _restart(self, child: Child, recovery: _Recovery, now: float) -> None:
        """Start `child` again with its arguments; a thread watches for its ready line so the
        supervisor keeps polling the others meanwhile."""
        header = (
            f"\n--- tandem up: restart {recovery.attempt} of {child.name} "
            f"(the previous process {recovery.reason}) ---\n"
        )
        child.proc = _popen(child.module_args, child.log_path, "a", header, child.env)
        recovery.ready_by = now + self.config.ready_timeout_s
        assert child.proc.stdout is not None
        threading.Thread(
            target=_read_until,
            args=(child.proc.stdout, child.ready_marker, recovery.found),
            name=f"ready:{child.name}",
            daemon=True,
        ).start()

    def pids(self) -> list[int]:
        return [c.proc.pid for c in self.children]
