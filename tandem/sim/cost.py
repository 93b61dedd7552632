"""Cost models: how long a worker's step takes, and what its KV cache holds. Pure.

A cost model answers, per role:
  prefill_step_s(num_tokens)          one prefill step computing that many prompt tokens
  decode_step_s(batch, context)       one decode step: `batch` sequences, one token each,
                                      attending over `context` tokens in total
  kv_bytes_per_token, block_size, num_kv_blocks   KV geometry of one worker
  transfer_s(num_tokens)              moving a prompt's KV from prefill to decode worker

Two implementations:
  RooflineCost   a GPU (GpuSpec: H100, H200) serving a model (ModelSpec: LLAMA_8B):
                 prefill compute-bound, decode memory-bound, each the max of its compute and
                 memory time plus a fixed per-step overhead.
  CpuFittedCost  this repository's CPU engine on the `small` model, fitted from the figures
                 in BENCHMARKS.md (each constant says where it comes from).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


class CostModel(Protocol):
    """What the simulator asks of a cost model (read-only attributes and two step times)."""

    @property
    def name(self) -> str: ...
    @property
    def kv_bytes_per_token(self) -> int: ...
    @property
    def block_size(self) -> int: ...
    @property
    def num_kv_blocks(self) -> int: ...
    @property
    def link_bytes_per_s(self) -> float: ...
    @property
    def link_latency_s(self) -> float: ...
    @property
    def prefill_token_budget(self) -> int: ...
    @property
    def max_num_seqs(self) -> int: ...

    def prefill_step_s(self, num_tokens: int) -> float: ...
    def decode_step_s(self, batch: int, context_tokens: int) -> float: ...


def transfer_s(cost: CostModel, num_tokens: int) -> float:
    """Seconds to move `num_tokens` tokens of KV from a prefill to a decode worker."""
    return num_tokens * cost.kv_bytes_per_token / cost.link_bytes_per_s + cost.link_latency_s


@dataclass(frozen=True, slots=True)
class GpuSpec:
    """Datasheet figures of one GPU (SXM parts, dense BF16, no sparsity)."""

    name: str
    bf16_flops: float  # FLOP/s
    hbm_bytes_per_s: float
    memory_bytes: float


# NVIDIA H100 SXM5 datasheet: 989 TFLOP/s dense BF16 (1,979 with sparsity), 3.35 TB/s HBM3,
# 80 GB. H200 SXM: the same Hopper compute, 4.8 TB/s HBM3e, 141 GB.
H100 = GpuSpec("H100-SXM", 989e12, 3.35e12, 80e9)
H200 = GpuSpec("H200-SXM", 989e12, 4.8e12, 141e9)


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """The shape of a decoder-only model, as far as cost goes. A mixture of experts gives
    `num_active_params` (what one token runs through: FLOPs follow it), `num_experts` and
    `top_k`: a step reads the experts its tokens were routed to, for a batch of b tokens
    routed uniformly the expected share 1 - (1 - top_k / num_experts)^b of each layer's."""

    name: str
    num_params: float
    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    dtype_bytes: int = 2
    num_active_params: float | None = None
    num_experts: int = 0
    top_k: int = 0

    def __post_init__(self) -> None:
        if self.num_active_params is not None and not (
            0 < self.num_active_params <= self.num_params and 0 < self.top_k < self.num_experts
        ):
            raise ValueError(
                f"{self.name}: active parameters ({self.num_active_params}) must be in "
                f"(0, {self.num_params}] with 0 < top_k ({self.top_k}) < num_experts "
                f"({self.num_experts})"
            )

    @property
    def weight_bytes(self) -> float:
        return self.num_params * self.dtype_bytes

    @property
    def active_params(self) -> float:
        """Parameters one token runs through (all of them for a dense model)."""
        return self.num_params if self.num_active_params is None else self.num_active_params

    def weight_bytes_read(self, num_tokens: int) -> float:
        """Expected weight bytes a step of `num_tokens` tokens reads: all of a dense model;
        of a mixture of experts, the dense part and the experts some token is routed to."""
        if self.num_active_params is None:
            return self.weight_bytes
        idle = 1 - self.top_k / self.num_experts  # one token leaves this share of experts
        expert_params = (self.num_params - self.num_active_params) / idle
        untouched = expert_params * idle ** max(num_tokens, 1)
        return (self.num_params - untouched) * self.dtype_bytes

    @property
    def kv_bytes_per_token(self) -> int:
        # K and V, every layer, every KV head.
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype_bytes


# Llama-3.1-8B (config.json): 8.03B parameters, 32 layers, 32 query heads, 8 KV heads,
# head_dim 128, bf16: 128 KiB of KV per token.
LLAMA_8B = ModelSpec("llama-8b", 8.03e9, 32, 32, 8, 128)
# Qwen3-30B-A3B (model card and config.json): 30.5B parameters, 3.3B active, 48 layers, 32
# query heads, 4 KV heads, head_dim 128, 128 experts, top 8; bf16: 48 KiB of KV per token.
QWEN3_30B_A3B = ModelSpec(
    "qwen3-30b-a3b", 30.5e9, 48, 32, 4, 128, num_active_params=3.3e9, num_experts=128, top_k=8
)


@dataclass(frozen=True, slots=True)
class RooflineCost:
    """A roofline of one GPU per worker serving `model`.

    prefill step: max(2 * active params * n / (flops * mfu), weights read(n)
                  / (hbm * bw_efficiency)) + step_overhead_s
    decode step:  max(FLOPs / (flops * mfu), (weights read(batch) + kv_bytes_per_token
                  * context) / (hbm * bw_efficiency)) + step_overhead_s,
                  FLOPs = 2 * active params * batch + 4 * layers * q_heads * head_dim * context
    (a dense model's active params and weights read are all of them; a mixture of experts'
    are ModelSpec's `active_params` and `weight_bytes_read`)
    KV blocks:    (memory * memory_utilization - weights - activation_reserve_bytes)
                  / (kv_bytes_per_token * block_size)
    The link is one 400 Gb/s NDR InfiniBand port per GPU (50 GB/s) at `link_efficiency`,
    plus `link_latency_s` for the hand-off's RPCs.

    Attention FLOPs of prefill (quadratic in the prompt) are left out: below ~8k tokens
    they add under 10% to an 8B model's 2 * params FLOPs per token.
    """

    gpu: GpuSpec
    model: ModelSpec = LLAMA_8B
    mfu: float = 0.5
    bw_efficiency: float = 0.8
    step_overhead_s: float = 1e-3
    memory_utilization: float = 0.9
    activation_reserve_bytes: float = 2e9
    block_size: int = 16
    link_bytes_per_s: float = 50e9 * 0.8
    link_latency_s: float = 2e-3
    prefill_token_budget: int = 8192
    max_num_seqs: int = 1024

    def __post_init__(self) -> None:
        if not 0 < self.mfu <= 1 or not 0 < self.bw_efficiency <= 1:
            raise ValueError(f"mfu and bw_efficiency must be in (0, 1], got {self.mfu}, "
                             f"{self.bw_efficiency}")  # fmt: skip
        if self.num_kv_blocks <= 0:
            raise ValueError(f"{self.model.name} leaves no KV memory on {self.gpu.name}")

    @property
    def name(self) -> str:
        return f"{self.gpu.name}/{self.model.name}"

    @property
    def kv_bytes_per_token(self) -> int:
        return self.model.kv_bytes_per_token

    @property
    def num_kv_blocks(self) -> int:
        free = (
            self.gpu.memory_bytes * self.memory_utilization
            - self.model.weight_bytes
            - self.activation_reserve_bytes
        )
        return int(free // (self.kv_bytes_per_token * self.block_size))

    def prefill_step_s(self, num_tokens: int) -> float:
        flops = 2 * self.model.active_params * num_tokens
        compute = flops / (self.gpu.bf16_flops * self.mfu)
        read = self.model.weight_bytes_read(num_tokens)
        memory = read / (self.gpu.hbm_bytes_per_s * self.bw_efficiency)
        return max(compute, memory) + self.step_overhead_s

    def decode_step_s(self, batch: int, context_tokens: int) -> float:
        m = self.model
        flops = 2 * m.active_params * batch + 4 * m.num_layers * m.num_q_heads * m.head_dim * (
            context_tokens
        )
        compute = flops / (self.gpu.bf16_flops * self.mfu)
        read = m.weight_bytes_read(batch) + self.kv_bytes_per_token * context_tokens
        memory = read / (self.gpu.hbm_bytes_per_s * self.bw_efficiency)
        return max(compute, memory) + self.step_overhead_s


@dataclass(frozen=True, slots=True)
class CpuFittedCost:
    """Tandem's CPU engine, 1 torch thread per worker, `small` model (46.2M parameters,
    float32), fitted from BENCHMARKS.md and benchmarks/results/*-t1.json (2026-11-30).

    prefill_s_per_token = 3.166 ms: TTFT of an uncached 1024-token prompt, 3242 ms (median of
        3, `--threads 1`, prefix-t1.json ttft_a_s_median). Measured before the fused prefill
        SDPA change; the later throughput re-run (107.5 tokens/s, 21073 prompt tokens in
        77.3 s) implies ~1.1 ms/token under this decode model, so prefill here is pessimistic.
    decode step = decode_fixed_s + decode_per_seq_s * batch + context * kv_bytes / bandwidth:
      bandwidth 10.46 GB/s: roofline-t1.json bandwidth_bytes_per_s (512 MiB copies).
      kv 24576 B/token: 12 layers * 4 KV heads * head_dim 64 * K,V * 4 bytes (the KV transfer
        section: 384 KiB per 16-token block).
      fixed + per_seq = 16.35 ms: the batch-1 step median 16.93 ms (roofline-t1.json,
        contexts 148-348 tokens, ~0.58 ms of which is KV reads).
      fixed + 6 * per_seq = 42.0 ms: ITL p50 44.94 ms with 6 requests in flight straight to
        a 1-thread decode worker (serving, router overhead, "direct"; prompts 64-256, outputs
        64-128: ~1250 context tokens, 2.9 ms of KV reads).
      => per_seq 5.13 ms, fixed 11.22 ms.
    num_kv_blocks 1365: the default CacheConfig.kv_cache_bytes 512 MiB / 384 KiB per block.
    link 10.9 GB/s: NIXL read of a 2048-token prompt's blocks (KV transfer table, contiguous).
    link_latency_s 37 ms: the token 1 -> 2 gap of long prompts, 101 ms disaggregated vs 64 ms
        colocated (serving, p50): the hand-off's RPCs and engine-loop round trips.
    prefill_token_budget 2048, max_num_seqs 64: SchedulerConfig defaults.
    """

    name: str = "cpu/small"
    prefill_s_per_token: float = 3.242 / 1024
    decode_fixed_s: float = 11.22e-3
    decode_per_seq_s: float = 5.13e-3
    memory_bytes_per_s: float = 10.46e9
    kv_bytes_per_token: int = 24576
    block_size: int = 16
    num_kv_blocks: int = 1365
    link_bytes_per_s: float = 10.9e9
    link_latency_s: float = 37e-3
    prefill_token_budget: int = 2048
    max_num_seqs: int = 64

    def prefill_step_s(self, num_tokens: int) -> float:
        return num_tokens * self.prefill_s_per_token

    def decode_step_s(self, batch: int, context_tokens: int) -> float:
        kv_read = context_tokens * self.kv_bytes_per_token / self.memory_bytes_per_s
        return self.decode_fixed_s + self.decode_per_seq_s * batch + kv_read


COST_MODELS = ("h100", "h200", "h200-moe", "cpu")


def cost_model(name: str) -> CostModel:
    """A named cost model: "h100", "h200" (Llama-8B roofline), "h200-moe" (Qwen3-30B-A3B
    roofline: FLOPs of its active parameters) or "cpu" (fitted)."""
    if name == "h100":
        return RooflineCost(H100)
    if name == "h200":
        return RooflineCost(H200)
    if name == "h200-moe":
        return RooflineCost(H200, QWEN3_30B_A3B)
    if name == "cpu":
        return CpuFittedCost()
    raise ValueError(f"cost model must be one of {COST_MODELS}, got {name!r}")
