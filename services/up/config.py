"""`tandem up`'s settings (UpConfig; its flags and TANDEM_* variables, one per field, are
added to the `tandem` command by tandem.services.cli.main; tandem.services.cli.up builds it)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from tandem.config import CacheConfig, EngineConfig, SpeculativeConfig
from tandem.services.common.runtime.flags import PUBLIC_NAMES
from tandem.services.common.runtime.supervision import RestartConfig
from tandem.services.router.config import DEFAULT_MAX_QUEUE_DELAY_S
from tandem.tools import get_format
from tandem.transfer import TRANSPORT_KINDS

_RESTART_DEFAULTS = RestartConfig()
# RestartConfig's field names in its messages, which UpConfig spells restart_<name>.
_RESTART_NAMES = re.compile(r"\b(?:backoff_s|max_backoff_s|window_s)\b")
# UCX opens a TCP listener on every network device it may use (its tcp transport), so a
# worker would listen on the host's external addresses too; on one host, loopback is all it
# needs (KV moves by cma/shared memory or CUDA IPC; TCP carries only control). A
# UCX_NET_DEVICES of the user's environment wins.
LOOPBACK_UCX_ENV = {"UCX_NET_DEVICES": "lo"}
# SpeculativeConfig's fields -> UpConfig's (the workers' flags: runtime.flags.PUBLIC_NAMES).
SPECULATIVE_FIELDS = {
    name: PUBLIC_NAMES.get(("speculative", name), name)
    for name in SpeculativeConfig.__dataclass_fields__
}


@dataclass(frozen=True, slots=True)
class UpConfig:
    """One `tandem up` cluster. Flags of `tandem up` map 1:1 to the fields, and so do
    environment variables with the prefix TANDEM_ (tandem.services.common.runtime.flags, as for
    every
    service: `--num-decode 2` or TANDEM_NUM_DECODE=2 set num_decode; the flag wins). Two fields
    the command sets itself: model_dir from --model (a directory or .gguf, resolved by
    tandem.services.cli.model), and kv_cache_bytes, unless asked for, sized from the model.

    Attributes:
        model_dir: the served model's directory (`tandem up --model`).
        host: where every process listens (loopback: nothing of the cluster is reachable from
            another host).
        port: the router's gRPC port (0: a free port).
        http_port: the router's OpenAI HTTP API; 0: a free port; -1: off.
        num_prefill: prefill workers at start; 0: every prompt is prefilled on a decode
            worker.
        num_decode: decode workers at start (at least 1).
        transport: the workers' KV transport, nixl or local.
        kv_cache_bytes: KV cache per worker on a CPU (`tandem up`: enough for one full context
            of the model, at least 256 MiB; `tandem generate`: 256 MiB); the old spelling
            --kv-cache-mb takes MiB.
        kv_host_bytes: KV tier in host memory behind each worker's prefix cache
            (tandem.tiers): cached blocks the device evicts are kept there and brought back
            on a later hit instead of recomputed; 0: no host tier.
        kv_disk_dir: KV tier on disk below the host tier: its directory (a fast local
            volume); `tandem up` gives each worker its own subdirectory, DIR/<worker name>
            (two workers never share one); "": no disk tier.
        kv_disk_bytes: bytes each worker's disk tier may hold; 0: no disk tier (set with
            kv_disk_dir).
        device: torch device of the engine (`tandem up`: of every worker's): cpu, cuda,
            cuda:1. `tandem up` with "cuda": the workers go round-robin over the visible GPUs,
            in start order (prefill first); "cuda:N": all on that GPU.
        gpu_memory_utilization: on a GPU, the fraction of its memory for weights, activations
            and KV cache (`tandem up`: of each GPU, split among the workers placed on it:
            tandem.gpus.place_workers).
        dtype: model dtype: auto, float32, bfloat16 or float16; auto: bfloat16 on CUDA and
            on a CPU that runs it natively (AVX512-BF16 or AMX), float32 on other CPUs.
        quantization: every worker's layer-matrix weights: none, int8, int4 or fp8
            (tandem.config.EngineConfig.quantization); the default model's Q4_1 weights are
            served as shipped with int4.
        quantization_group_size: int4's inputs per scale: 32, 64 or 128.
        kv_cache_dtype: KV cache dtype of every worker: auto (the model's dtype) or fp8
            (e4m3 with per-layer scales: twice the tokens per byte of bfloat16; prefill and
            decode workers must agree, tandem.quant.kv).
        tensor_parallel_size: ranks per worker (`--tp`; tensor parallelism,
            tandem.parallel.sharding): every worker spawns that many rank processes, each
            holding 1/N of the model and of its KV heads (gloo on a CPU; `num_threads` is
            then per rank). `tandem up` places one GPU per worker, so on CUDA it stays 1
            (the chart's per-role tensorParallelSize gives a pod that many GPUs).
        expert_parallel: a mixture-of-experts model's experts split whole among each
            worker's ranks (EP = tensor_parallel_size) instead of every expert's columns
            (tandem.config.EngineConfig.expert_parallel).
        replicate_attention: every rank of a worker computes every attention head, not a
            share (tandem.config.EngineConfig.replicate_attention).
        tp_exact_sums: with tensor_parallel_size > 1, o and down split by their outputs so
            every rank count answers bit for bit as one rank (None: yes on a CPU;
            tandem.config.EngineConfig.tp_exact_sums).
        cpu_matmul: on a CPU, auto, plain or onednn (tandem.config.EngineConfig.cpu_matmul).
        speculative: speculative decoding on every worker's decode steps (issue 45,
            tandem.config.SpeculativeConfig): none, ngram (prompt lookup), suffix (a
            suffix index over the request's tokens) or draft (a smaller model, draft_model);
            greedy and seeded outputs unchanged.
        num_speculative_tokens: most tokens drafted per request and step (1..16).
        speculative_max_batch: speculation pauses while a step decodes more requests than
            this.
        speculative_ngram_max: the longest suffix n-gram the lookup tries (<= 16).
        speculative_ngram_min: the shortest (>= 1).
        speculative_suffix_share: suffix: also draft from recent requests of the same tenant
            (the same cache_salt).
        speculative_adaptive: draft the k that pays for each request's acceptance (none
            when no k does); false: always num_speculative_tokens, for measuring.
        draft_model: draft: the draft model's directory (`tandem up` resolves it as --model's:
            a .gguf converted once), on every worker: a prefill worker prefills the draft too
            and hands its KV over with the target's; "" otherwise.
        disagg_min_uncached_tokens: the router's threshold: prompts with fewer uncached tokens
            skip the prefill worker.
        max_queue_delay_s: refuse a request at once (HTTP 429 / RESOURCE_EXHAUSTED, with
            Retry-After) when its expected wait for the first token exceeds this; 0: no limit.
        tool_call_parser: the router's (how the model writes tool calls): auto, hermes,
            llama3_json or mistral.
        redis_port: Redis's TCP port; 0: a unix socket in the run directory.
        api_keys: the router wants an API key (one is generated for tenant "default" and
            printed: Cluster.api_key).
        run_dir: logs and sockets; default: a fresh temporary directory.
        ready_timeout_s: how long each process may take to say it is ready.
        autoscale: run the ratio controller, adding and removing workers (local actuator).
        admin_port: the controller's admin API (with autoscale), for `tandem ctl`.
        controller_args: controller flags (python -m tandem.services.controller --help), split as a
            shell would: '--max-prefill 4'.
        host_cores: with autoscale: the cores the host capacity rule counts (one worker per
            core); 0: measured (affinity and cgroup quota, services/controller/host.py).
        num_threads: torch threads per CPU worker; 0: `cpu_threads_per_worker` of the
            host's cores and the workers at start (one core left to the router and the
            clients: on 2 cores, 1 thread each).
        restart_backoff_s: delay before restarting a process that exited on its own; doubles
            per exit within the window, up to restart_max_backoff_s
            (services/common/runtime/supervision.py).
        restart_max_backoff_s: the cap on that delay.
        max_restarts: restarts of one process within restart_window_s before tandem up stops
            the cluster and exits 1 (0: the first exit does).
        restart_window_s: how far back a process's exits count.
    """

    model_dir: str
    host: str = "127.0.0.1"
    port: int = 50051
    http_port: int = 8000
    num_prefill: int = 1
    num_decode: int = 1
    transport: str = "nixl"
    kv_cache_bytes: int = 256 << 20
    kv_host_bytes: int = 0
    kv_disk_dir: str = ""
    kv_disk_bytes: int = 0
    device: str = "cpu"
    gpu_memory_utilization: float = 0.9
    dtype: str = "auto"
    quantization: str = "none"
    quantization_group_size: int = 64
    kv_cache_dtype: str = "auto"
    tensor_parallel_size: int = 1
    expert_parallel: bool = False
    replicate_attention: bool = False
    tp_exact_sums: bool | None = None
    cpu_matmul: str = "auto"
    speculative: str = "none"
    num_speculative_tokens: int = 4
    speculative_max_batch: int = 2  # SpeculativeConfig.max_batch
    speculative_ngram_max: int = 4
    speculative_ngram_min: int = 2
    speculative_suffix_share: bool = False
    speculative_adaptive: bool = True
    draft_model: str = ""  # SpeculativeConfig.draft_model
    disagg_min_uncached_tokens: int = 64
    max_queue_delay_s: float = DEFAULT_MAX_QUEUE_DELAY_S
    tool_call_parser: str = "auto"
    redis_port: int = 0
    api_keys: bool = False
    run_dir: str = ""
    ready_timeout_s: float = 120.0
    autoscale: bool = False
    admin_port: int = 50061
    controller_args: tuple[str, ...] = ()
    host_cores: int = 0
    num_threads: int = 0
    restart_backoff_s: float = _RESTART_DEFAULTS.backoff_s
    restart_max_backoff_s: float = _RESTART_DEFAULTS.max_backoff_s
    max_restarts: int = _RESTART_DEFAULTS.max_restarts
    restart_window_s: float = _RESTART_DEFAULTS.window_s

    def __post_init__(self) -> None:
        if self.num_prefill < 0 or self.num_decode < 1:
            raise ValueError(
                f"need num_decode >= 1 and num_prefill >= 0, got {self.num_decode}, "
                f"{self.num_prefill}"
            )
        if self.transport not in TRANSPORT_KINDS:
            raise ValueError(f"transport must be one of {TRANSPORT_KINDS}, got {self.transport!r}")
        if self.tool_call_parser != "auto":
            get_format(self.tool_call_parser)  # ValueError naming the formats
        if self.num_threads < 0:
            raise ValueError(f"num_threads must be >= 0 (0: auto), got {self.num_threads}")
        if self.host_cores < 0:
            raise ValueError(f"host_cores must be >= 0 (0: measured), got {self.host_cores}")
        if self.tensor_parallel_size > 1 and self.device.startswith("cuda"):
            raise ValueError(
                f"tensor_parallel_size {self.tensor_parallel_size} on {self.device}: tandem up "
                "places one GPU per worker; serve tensor-parallel GPU workers with the chart "
                "(tensorParallelSize), or try it here with device cpu"
            )
        self.engine_config()  # dtype, kv_cache_bytes, gpu_memory_utilization: the workers' checks
        try:
            self.restart_config()
        except ValueError as exc:  # in this config's names: the flags' own
            raise ValueError(_RESTART_NAMES.sub(lambda m: "restart_" + m[0], str(exc))) from None

    def engine_config(self) -> EngineConfig:
        """The engine settings every worker gets (validated as the workers validate them)."""
        return EngineConfig(
            model_dir=self.model_dir,
            device=self.device,
            dtype=self.dtype,
            quantization=self.quantization,
            quantization_group_size=self.quantization_group_size,
            kv_cache_dtype=self.kv_cache_dtype,
            tensor_parallel_size=self.tensor_parallel_size,
            expert_parallel=self.expert_parallel,
            replicate_attention=self.replicate_attention,
            tp_exact_sums=self.tp_exact_sums,
            cpu_matmul=self.cpu_matmul,
            cache=CacheConfig(
                kv_cache_bytes=self.kv_cache_bytes,
                gpu_memory_utilization=self.gpu_memory_utilization,
                kv_host_bytes=self.kv_host_bytes,
                kv_disk_dir=self.kv_disk_dir,
                kv_disk_bytes=self.kv_disk_bytes,
            ),
            speculative=SpeculativeConfig(
                **{name: getattr(self, up) for name, up in SPECULATIVE_FIELDS.items()}
            ),
        )

    def worker_disk_dir(self, worker_name: str) -> str:
        """The disk tier's directory of worker `worker_name` ("prefill-0", "decode-1"):
        its own under kv_disk_dir, since two workers must never share one (a restarted
        worker keeps its name, and so its directory); "" without a disk tier."""
        return str(Path(self.kv_disk_dir) / worker_name) if self.kv_disk_dir else ""

    def worker_args(self, worker_name: str) -> list[str]:
        """The flags of worker `worker_name` that come from this config: the same for every
        worker but the disk tier's directory (worker_disk_dir)."""
        disk = ["--kv-disk-dir", self.worker_disk_dir(worker_name)] if self.kv_disk_dir else []
        tp_exact_sums = "none" if self.tp_exact_sums is None else str(self.tp_exact_sums)
        return [
            "--model-dir", self.model_dir,
            "--host", self.host,
            "--transport", self.transport,
            "--kv-cache-bytes", str(self.kv_cache_bytes),
            "--kv-host-bytes", str(self.kv_host_bytes),
            *disk,
            "--kv-disk-bytes", str(self.kv_disk_bytes),
            "--dtype", self.dtype,
            "--kv-cache-dtype", self.kv_cache_dtype,
            "--quantization", self.quantization,
            "--quantization-group-size", str(self.quantization_group_size),
            "--tensor-parallel-size", str(self.tensor_parallel_size),
            "--expert-parallel", str(self.expert_parallel).lower(),
            "--replicate-attention", str(self.replicate_attention).lower(),
            "--tp-exact-sums", tp_exact_sums.lower(),
            "--cpu-matmul", self.cpu_matmul,
            "--speculative", self.speculative,
            "--num-speculative-tokens", str(self.num_speculative_tokens),
            "--speculative-max-batch", str(self.speculative_max_batch),
            "--speculative-ngram-max", str(self.speculative_ngram_max),
            "--speculative-ngram-min", str(self.speculative_ngram_min),
            "--speculative-suffix-share", str(self.speculative_suffix_share).lower(),
            "--speculative-adaptive", str(self.speculative_adaptive).lower(),
            "--draft-model", self.draft_model,
        ]  # fmt: skip

    def restart_config(self) -> RestartConfig:
        return RestartConfig(
            backoff_s=self.restart_backoff_s,
            max_backoff_s=self.restart_max_backoff_s,
            max_restarts=self.max_restarts,
            window_s=self.restart_window_s,
        )


def cpu_threads_per_worker(num_cores: int, num_workers: int, autoscale: bool) -> int:
    """Torch threads for each CPU worker on a host of `num_cores` that `tandem up` shares
    with its router and the clients: one core is left to them and the rest split evenly
    (with autoscale, one each: the controller adds a worker per free core). At least 1.

    Measured on 2 cores (BENCHMARKS.md, issue 24): 1 thread per worker serves faster than
    torch's default of one per core, which oversubscribes the cores the router, the other
    worker and the clients need."""
    if autoscale or num_workers <= 0:
        return 1
    return max(1, (num_cores - 1) // num_workers)
