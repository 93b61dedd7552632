"""`tandem up`'s settings (UpConfig; its flags are the CLI's, services.cli.main)."""

from __future__ import annotations

from dataclasses import dataclass

from services.common.runtime.supervision import RestartConfig
from services.router.config import DEFAULT_MAX_QUEUE_DELAY_S

_RESTART_DEFAULTS = RestartConfig()
# UCX opens a TCP listener on every network device it may use (its tcp transport), so a
# worker would listen on the host's external addresses too; on one host, loopback is all it
# needs (KV moves by cma/shared memory or CUDA IPC; TCP carries only control). A
# UCX_NET_DEVICES of the user's environment wins.
LOOPBACK_UCX_ENV = {"UCX_NET_DEVICES": "lo"}


@dataclass(frozen=True, slots=True)
class UpConfig:
    model_dir: str
    host: str = "127.0.0.1"
    port: int = 50051
    http_port: int = 8000  # the router's OpenAI HTTP API; 0: a free port; -1: off
    num_prefill: int = 1
    num_decode: int = 1
    transport: str = "nixl"
    kv_cache_bytes: int = 256 << 20
    # Every worker's engine. "cuda": the workers go round-robin over the visible GPUs, in
    # start order (prefill first); "cuda:N": all on that GPU. Workers sharing a GPU split its
    # gpu_memory_utilization (tandem.gpus.place_workers).
    device: str = "cpu"
    gpu_memory_utilization: float = 0.9
    dtype: str = "auto"
    disagg_min_uncached_tokens: int = 64  # router: shorter prompts skip the prefill worker
    # router: refuse at once (429) what could not get its first token within this; 0: off
    max_queue_delay_s: float = DEFAULT_MAX_QUEUE_DELAY_S
    redis_port: int = 0  # 0: a unix socket in the run directory
    api_keys: bool = False  # the router wants an API key (a generated one: Cluster.api_key)
    run_dir: str = ""  # logs and sockets; default: a fresh temporary directory
    ready_timeout_s: float = 120.0
    autoscale: bool = False  # run the ratio controller with the local actuator
    admin_port: int = 50061  # the controller's admin API (with autoscale)
    controller_args: tuple[str, ...] = ()  # ControllerConfig flags, e.g. ("--max-prefill", "4")
    # With autoscale: the cores the host capacity rule counts (one worker per core); 0:
    # measured (affinity and cgroup quota, services/controller/host.py).
    host_cores: int = 0
    # Supervision (see services/common/runtime/supervision.py): a child that exits on its own is
    # restarted after restart_backoff_s, doubling per exit up to restart_max_backoff_s; the
    # exit after max_restarts restarts within restart_window_s stops the cluster instead.
    restart_backoff_s: float = _RESTART_DEFAULTS.backoff_s
    restart_max_backoff_s: float = _RESTART_DEFAULTS.max_backoff_s
    max_restarts: int = _RESTART_DEFAULTS.max_restarts  # 0: the first exit stops the cluster
    restart_window_s: float = _RESTART_DEFAULTS.window_s

    def __post_init__(self) -> None:
        if self.num_prefill < 0 or self.num_decode < 1:
            raise ValueError(
                f"need num_decode >= 1 and num_prefill >= 0, got {self.num_decode}, "
                f"{self.num_prefill}"
            )
        if self.host_cores < 0:
            raise ValueError(f"host_cores must be >= 0 (0: measured), got {self.host_cores}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        self.restart_config()  # raises ValueError naming the bad knob

    def restart_config(self) -> RestartConfig:
        return RestartConfig(
            backoff_s=self.restart_backoff_s,
            max_backoff_s=self.restart_max_backoff_s,
            max_restarts=self.max_restarts,
            window_s=self.restart_window_s,
        )
