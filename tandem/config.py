"""Frozen configuration dataclasses, one per component, composed into `EngineConfig`.

Field names are the contract: CLI flags, environment variables and Helm values map to them
one-to-one (parsed only in each service's main.py). Every config validates itself.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from enum import StrEnum

from tandem.types import Role

DEFAULT_BLOCK_SIZE = 16  # tokens per KV block; routers and workers must agree
MODEL_DTYPES = ("float32", "bfloat16", "float16")
QUANTIZATIONS = ("none", "int8", "int4", "fp8")  # tandem.quant.weight.WeightScheme's values


class EngineRole(StrEnum):
    """What part of a request's life an engine runs."""

    FULL = "full"  # prefill and decode in one process
    PREFILL = Role.PREFILL.value  # stop after the first token; keep the prompt's blocks pinned
    DECODE = Role.DECODE.value  # start from externally supplied KV blocks


@dataclass(frozen=True, slots=True)
class CacheConfig:
    """Paged KV cache.

    Attributes:
        block_size: tokens per KV block.
        kv_cache_bytes: memory budget for the KV cache; the number of blocks is derived.
        kv_cache_bytes: memory budget for the KV cache on a CPU; the number of blocks is
            derived.
        gpu_memory_utilization: on a GPU, the fraction of the device's memory for weights,
            activations, workspaces and KV cache together; KV gets what the weights and a
            profile step at full batch leave (kv_cache_bytes is not used there).
        num_blocks: explicit number of blocks; overrides both budgets when set.
        enable_prefix_caching: reuse full blocks whose prefix hash matches.
        kv_host_bytes: bytes of host memory behind the prefix cache (tandem.tiers): cached
            blocks the device cache evicts are kept there, verified, until this budget
            evicts them in turn; 0: no host tier.
        kv_disk_dir: directory of the disk tier (a fast local volume; it survives a
            restart, and the restarted worker serves what it verifies there); "": none.
        kv_disk_bytes: bytes the disk tier may hold in kv_disk_dir; 0: no disk tier.
    """

    block_size: int = DEFAULT_BLOCK_SIZE
    kv_cache_bytes: int = 256 << 20
    gpu_memory_utilization: float = 0.9
    num_blocks: int | None = None
    enable_prefix_caching: bool = True
    kv_host_bytes: int = 0
    kv_disk_dir: str = ""
    kv_disk_bytes: int = 0

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a positive power of two, got {self.block_size}")
        if self.kv_cache_bytes <= 0:
            raise ValueError(f"kv_cache_bytes must be positive, got {self.kv_cache_bytes}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.num_blocks is not None and self.num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {self.num_blocks}")
        for name in ("kv_host_bytes", "kv_disk_bytes"):
            if (value := getattr(self, name)) < 0:
                raise ValueError(f"{name} must be >= 0 (0: no such tier), got {value}")
        if bool(self.kv_disk_dir) != (self.kv_disk_bytes > 0):
            raise ValueError(
                "a disk tier needs both kv_disk_dir and kv_disk_bytes "
                f"(got kv_disk_dir={self.kv_disk_dir!r}, kv_disk_bytes={self.kv_disk_bytes})"
            )
        if (self.kv_host_bytes or self.kv_disk_bytes) and not self.enable_prefix_caching:
            raise ValueError("KV tiers keep cached prefixes: they need enable_prefix_caching")


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """Continuous batching.

    Attributes:
        max_num_seqs: most requests in one step.
        max_num_batched_tokens: token budget of one step (decode tokens + prefill chunks).
        max_model_len: longest sequence (prompt + output); None = the model's maximum.
        long_prefill_token_threshold: most tokens one request's prefill chunk may take in a
            step, so a long prompt cannot starve the others; None = no limit beyond the budget.
    """

    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    long_prefill_token_threshold: int | None = None

    @property
    def max_step_rows(self) -> int:
        """The most token rows one step can hold: its token budget, or one decode row per
        request where requests outnumber it."""
        return max(self.max_num_batched_tokens, self.max_num_seqs)

    def __post_init__(self) -> None:
        if self.max_num_seqs <= 0:
            raise ValueError(f"max_num_seqs must be positive, got {self.max_num_seqs}")
        if self.max_num_batched_tokens <= 0:
            raise ValueError(
                f"max_num_batched_tokens must be positive, got {self.max_num_batched_tokens}"
            )
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise ValueError(f"max_model_len must be positive, got {self.max_model_len}")
        if self.long_prefill_token_threshold is not None and self.long_prefill_token_threshold <= 0:
            raise ValueError(
                "long_prefill_token_threshold must be positive, "
                f"got {self.long_prefill_token_threshold}"
            )


SPECULATIVE_METHODS = ("none", "ngram", "suffix", "draft")  # tandem.speculative


@dataclass(frozen=True, slots=True)
class SpeculativeConfig:
    """Speculative decoding (tandem.speculative): a proposer drafts tokens, one target
    forward verifies them (greedy and seeded output unchanged, token for token).

    Attributes:
        method: "none", "ngram" (prompt lookup: the last n tokens matched against the
            prompt and output so far) or "suffix" (a suffix index over the request's tokens
            and, with suffix_share, recent requests of the same tenant) or "draft" (a
            smaller model sharing the target's tokenizer, `draft_model`, run by the same
            worker with its own paged KV cache).
        num_speculative_tokens: most tokens drafted per request and step (k).
        ngram_max, ngram_min: the longest and shortest suffix n-gram lookup tries.
        max_batch: speculation pauses while a step decodes more requests than this. On
            a CPU open chat stops gaining past 2 while text that repeats (code edits, agent
            loops) still gains at 32: raise it for such traffic (BENCHMARKS.md issue 45).
        suffix_share: suffix: also draft from the recent requests of the same tenant
            (requests with the same non-empty cache_salt, the tenant isolation key).
        adaptive: draft the k that pays best for each request's measured acceptance and
            the device's verify cost (tandem.speculative.speculator), none when no k pays;
            false: always num_speculative_tokens (within max_tokens and the context), as
            other engines do -- for measuring a proposer as it is.
        draft_model: draft: the draft model's directory (config.json, safetensors and the
            target's tokenizer); "" otherwise.
    """

    method: str = "none"
    num_speculative_tokens: int = 4
    ngram_max: int = 4
    ngram_min: int = 2
    max_batch: int = 2
    suffix_share: bool = False
    adaptive: bool = True
    draft_model: str = ""

    def __post_init__(self) -> None:
        if self.method not in SPECULATIVE_METHODS:
            raise ValueError(
                f"speculative must be one of {', '.join(SPECULATIVE_METHODS)}, got {self.method!r}"
            )
        if (self.method == "draft") != bool(self.draft_model):
            raise ValueError(
                "speculative draft needs a draft model (--draft-model DIR), and a draft model "
                f"needs --speculative draft; got speculative={self.method!r}, "
                f"draft_model={self.draft_model!r}"
            )
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError(
                f"num_speculative_tokens must be in [1, 16], got {self.num_speculative_tokens}"
            )
        if not 1 <= self.ngram_min <= self.ngram_max <= 16:
            raise ValueError(
                "need 1 <= ngram_min <= ngram_max <= 16, got "
                f"ngram_min={self.ngram_min}, ngram_max={self.ngram_max}"
            )
        if self.max_batch < 1:
            raise ValueError(f"speculative max_batch must be >= 1, got {self.max_batch}")

    @property
    def enabled(self) -> bool:
        return self.method != "none"


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """One engine: a model, its KV cache and its scheduler.

    Attributes:
        model_dir: HuggingFace-style model directory.
        role: full, prefill or decode.
        dtype: "float32", "bfloat16", "float16", or "auto": bfloat16 on CUDA and on a CPU
            that runs it natively (AVX512-BF16 or AMX, with oneDNN's prepacked matmuls:
            1.3-2x faster than float32, within 0.1 nat of it, BENCHMARKS.md issue 24),
            else float32. "float32" for outputs token-identical to transformers in float32.
        speculative: speculative decoding (SpeculativeConfig); off by default.
        device: torch device string ("cpu", "cuda", "cuda:1").
        quantization: the layer matrices' weights: "none" (the model's dtype), "int8" (per
            channel), "int4" (group-wise with zero points) or "fp8" (e4m3 per channel);
            embeddings, norms and lm_head stay in the model's dtype. A checkpoint that stores
            them in that scheme (AWQ, GPTQ, fp8, a GGUF's Q8_0/Q4_x) is kept as stored, else
            they are quantized as they load (tandem.quant.online).
        quantization_group_size: int4's inputs per scale: 32, 64 or 128 (it must divide
            the model's hidden and intermediate sizes).
        kv_cache_dtype: dtype of the KV cache: "auto" = the model's dtype; "fp8" = e4m3 with
            per-layer K and V scales from the checkpoint, else 1.0 (tandem.quant.kv):
            half the bytes per token of bfloat16.
        attention_backend: "auto" (Triton paged kernels on CUDA; on a CPU the native paged
            decode kernel when it builds, else torch ops), "torch" (torch ops only), "native"
            (the CPU decode kernel, built with the system's C compiler: tandem.kernels.cpu_ops)
            or "triton" (on a CPU, Triton runs only under TRITON_INTERPRET=1: tests).
        cuda_graphs: on CUDA with the Triton backend, capture decode-only steps in CUDA
            graphs during warm-up and replay them (see tandem.engine.cuda_graphs).
        seed: seed of the sampler's default generator (requests without their own seed).
        model_id: name that partitions the prefix cache; defaults to the directory name.
        num_threads: torch intra-op threads; None = torch's default (with tensor
            parallelism on a CPU, shared out among the ranks).
        tensor_parallel_size: ranks the model is split over (tandem.parallel.sharding): this
            engine is rank 0 and spawns the others (tandem.engine.ranks); on CUDA rank r
            runs on the r-th device from `device`, on a CPU all share the host (gloo).
        expert_parallel: with tensor_parallel_size N > 1 and a mixture-of-experts model,
            split the experts whole among the N ranks (EP = N; attention stays TP) instead
            of every expert's columns; no effect on a dense model.
        replicate_attention: with tensor_parallel_size > 1, every rank computes every
            attention head (no all-reduce after o; each rank's KV cache holds every head):
            expert parallelism without TP attention.
        tp_exact_sums: with tensor_parallel_size > 1, split o and down by their outputs
            and gather their inputs (`tandem.parallel.sharding.Shard.exact_sums`): outputs
            bit-identical to one rank's, two all-gathers per matrix instead of one
            all-reduce. None: on a CPU yes (gloo over loopback), on CUDA no (Megatron's
            all-reduce over NVLink).
        tp_shared_memory: with tensor_parallel_size > 1 on a CPU, the forward's collectives
            through /dev/shm (tandem.parallel.shm; x86-64 Linux), not gloo's
            loopback TCP.
        cpu_matmul: on a CPU, how weight matrices are multiplied (tandem.model.linear):
            "auto" (oneDNN's prepacked matmuls for bfloat16 where the CPU runs it natively,
            else plain `x @ w`), "plain", or "onednn" (float32 too, on any CPU oneDNN runs).
    """

    model_dir: str
    role: EngineRole = EngineRole.FULL
    dtype: str = "auto"
    device: str = "cpu"
    quantization: str = "none"
    quantization_group_size: int = 64
    kv_cache_dtype: str = "auto"
    attention_backend: str = "auto"
    cuda_graphs: bool = True
    seed: int = 0
    model_id: str | None = None
    num_threads: int | None = None
    tensor_parallel_size: int = 1
    expert_parallel: bool = False
    replicate_attention: bool = False
    tp_exact_sums: bool | None = None
    tp_shared_memory: bool = True
    cpu_matmul: str = "auto"
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)

    def __post_init__(self) -> None:
        if self.dtype not in (*MODEL_DTYPES, "auto"):
            raise ValueError(
                f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}"
            )
        if self.kv_cache_dtype not in ("auto", "fp8", self.resolved_dtype):
            raise ValueError(
                f"kv_cache_dtype must be auto (the model's dtype, {self.resolved_dtype}) or "
                f"fp8, got {self.kv_cache_dtype!r}"
            )
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(
                f"quantization must be one of {', '.join(QUANTIZATIONS)}, got {self.quantization!r}"
            )
        if self.quantization_group_size not in (32, 64, 128):
            raise ValueError(
                f"quantization_group_size must be 32, 64 or 128, got {self.quantization_group_size}"
            )
        if not isinstance(self.role, EngineRole):
            object.__setattr__(self, "role", EngineRole(self.role))
        if self.num_threads is not None and self.num_threads <= 0:
            raise ValueError(f"num_threads must be positive, got {self.num_threads}")
        if self.tensor_parallel_size <= 0:
            raise ValueError(
                f"tensor_parallel_size must be positive, got {self.tensor_parallel_size}"
            )
        if self.cpu_matmul not in ("auto", "plain", "onednn"):
            raise ValueError(f"cpu_matmul must be auto, plain or onednn, got {self.cpu_matmul!r}")
        if self.attention_backend not in ("auto", "torch", "native", "triton"):
            raise ValueError(
                "attention_backend must be auto, torch, native or triton, "
                f"got {self.attention_backend!r}"
            )

    @property
    def resolved_dtype(self) -> str:
        """The dtype the model runs in: `dtype`, with "auto" decided by the device."""
        if self.dtype != "auto":
            return self.dtype
        if self.device.startswith("cuda"):
            return "bfloat16"
        return "bfloat16" if cpu_runs_bf16() else "float32"


@functools.cache
def cpu_runs_bf16() -> bool:
    """This CPU runs bfloat16 natively and oneDNN's prepacked matmuls are available
    (tandem.model.linear): then "auto" is bfloat16 on the CPU too."""
    from tandem.model.linear import onednn_bf16_available  # torch: lazily

    return onednn_bf16_available()
