"""Mixture-of-experts layers (Qwen3-MoE, Mixtral, gpt-oss, Qwen3-Next, DeepSeek-V3): routing
and the grouped expert computation.

A sparse layer's MLP is a router ([hidden, num_experts]) and `num_experts` SwiGLU experts.
Each token goes to `top_k` experts with a weight each; the layer's output is the weighted
sum of those experts' outputs. Routing is each model's own:

  Qwen3-MoE  softmax over all experts (float32), the top k of it, renormalised to sum to 1
             when `norm_topk_prob`, cast to the activations' dtype (transformers'
             Qwen3MoeTopKRouter)
  Mixtral    the top k router logits, softmax over those k (float32): the same numbers as
             transformers' softmax-top-k-renormalise, without normalising over all experts
  gpt-oss    as Mixtral, the router with a bias; its experts have biases too, and a clamped
             SwiGLU: gate clamped above and up on both sides at `swiglu_limit`,
             act = (up + 1) * gate * sigmoid(alpha * gate)
  DeepSeek-V3  sigmoid of the float32 router logits; the choice adds a correction bias:
             the groups (num_groups of experts) ranked by their two best biased scores,
             the top k over the best topk_groups groups only; the weights are the chosen
             experts' unbiased scores, renormalised when `norm_topk_prob`, times
             `routed_scaling` (transformers' DeepseekV3TopkRouter)

The experts run as one grouped operation, never a Python loop over experts: the
(token, slot) pairs are sorted by expert, the tokens gathered in that order, and each
expert's contiguous rows multiplied by its own matrices in one grouped GEMM per projection
(gate and up fused); the outputs, scaled by their routing weights, are added back to their
tokens with one index_add:

    pairs (token t, slot j) -> expert e      sorted by e           offsets (cumulative)
    t0: e2 e0                                 [t0 t1 | t1 | t0]    [2, 3, 4]  (e0 | e1 | e2)
    t1: e0 e1                                  e0 e0   e1   e2

On CUDA the Triton kernel (kernels/fused_moe.py) does the same over block-padded segments,
with fixed shapes (CUDA graphs capture it); elsewhere `torch.nn.functional.grouped_mm`.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import NamedTuple

import torch
import torch.nn.functional as F


class Routing(StrEnum):
    SOFTMAX_TOPK = "softmax_topk"  # Qwen3-MoE: softmax over all, then top k (renormalised?)
    TOPK_SOFTMAX = "topk_softmax"  # Mixtral: top k logits, then softmax over those
    SIGMOID_GROUPS = "sigmoid_groups"  # DeepSeek-V3: sigmoid, biased group-limited top k


@dataclass(frozen=True, slots=True)
class MoeConfig:
    """The sparse layers of a model and how they route."""

    num_experts: int
    top_k: int
    expert_intermediate_size: int
    routing: Routing
    norm_topk_prob: bool  # SOFTMAX_TOPK: renormalise the top k (TOPK_SOFTMAX always sums to 1)
    sparse_layers: tuple[int, ...]  # the layers whose MLP is the experts; the rest are dense
    biases: bool = False  # gpt-oss: the router, gate_up and down have biases
    swiglu_limit: float | None = None  # gpt-oss's clamped SwiGLU (None: plain SiLU * up)
    swiglu_alpha: float = 1.702
    num_groups: int = 1  # SIGMOID_GROUPS: the experts in this many groups (n_group)
    topk_groups: int = 1  # SIGMOID_GROUPS: the top k from this many best groups (topk_group)
    routed_scaling: float = 1.0  # SIGMOID_GROUPS: the weights times it (routed_scaling_factor)

    def __post_init__(self) -> None:
        if self.num_experts <= 0 or self.expert_intermediate_size <= 0:
            raise ValueError(
                f"num_experts ({self.num_experts}) and moe_intermediate_size "
                f"({self.expert_intermediate_size}) must be positive"
            )
        if not 0 < self.top_k <= self.num_experts:
            raise ValueError(
                f"num_experts_per_tok ({self.top_k}) must be in [1, {self.num_experts}]"
            )
        if self.routing is Routing.SIGMOID_GROUPS:
            g, e = self.num_groups, self.num_experts
            if g <= 0 or e % g or e // g < 2 or not 0 < self.topk_groups <= g:
                raise ValueError(
                    f"n_group ({g}) must divide n_routed_experts ({e}) into groups of at "
                    f"least 2, and topk_group ({self.topk_groups}) be in [1, {g}]"
                )
            if self.top_k > self.topk_groups * (e // g):
                raise ValueError(
                    f"num_experts_per_tok ({self.top_k}) exceeds the experts of topk_group "
                    f"({self.topk_groups}) groups of {e // g}"
                )


@dataclass(slots=True)
class MoeWeights:
    """One sparse layer's router and experts, each expert's matrices transposed like every
    other matrix ([in, out]) and stacked along dim 0. With expert parallelism a rank holds
    experts [first_expert, first_expert + gate_up.shape[0]) only."""

    router: torch.Tensor  # [hidden, num_experts] (DeepSeek-V3: float32)
    gate_up: torch.Tensor  # [num_local_experts, hidden, 2 * expert_intermediate]
    down: torch.Tensor  # [num_local_experts, expert_intermediate, hidden]
    first_expert: int = 0
    router_bias: torch.Tensor | None = None  # [num_experts] (gpt-oss)
    gate_up_bias: torch.Tensor | None = None  # [num_local_experts, 2 * expert_intermediate]
    down_bias: torch.Tensor | None = None  # [num_local_experts, hidden]
    # The shared expert: (gate | up [hidden, 2S], down [S, hidden], its per-token gate
    # [hidden, 1] or None): every token also gets down(silu(gate) * up), times
    # sigmoid(x @ gate) where gated (Qwen3-Next; DeepSeek-V3's is not)
    shared: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None = None
    # DeepSeek-V3's e_score_correction_bias [num_experts] float32: biases the choice only
    correction_bias: torch.Tensor | None = None
    # MXFP4 experts kept in 4 bits (gpt-oss on CUDA, tandem.kernels.fused_moe): gate_up and
    # down are then uint8 [E, in / 2, out] and these their scales [E, in / 32, out]
    gate_up_scales: torch.Tensor | None = None
    down_scales: torch.Tensor | None = None

    def tensors(self) -> tuple[torch.Tensor, ...]:
        extra = (self.router_bias, self.gate_up_bias, self.down_bias, self.gate_up_scales,
                 self.down_scales, self.correction_bias, *(self.shared or ()))  # fmt: skip
        return (self.router, self.gate_up, self.down, *(b for b in extra if b is not None))


def router_name(architecture: str, layer: int) -> str:
    """A sparse layer's router in the checkpoint (Mixtral: block_sparse_moe.gate, Qwen3-MoE:
    mlp.gate, gpt-oss: mlp.router)."""
    if architecture == "GptOssForCausalLM":
        return f"model.layers.{layer}.mlp.router.weight"
    block = "block_sparse_moe" if architecture == "MixtralForCausalLM" else "mlp"
    return f"model.layers.{layer}.{block}.gate.weight"


def expert_names(architecture: str, layer: int, expert: int) -> tuple[str, str, str]:
    """An expert's (gate, up, down) in the checkpoint (Mixtral's w1, w3, w2)."""
    if architecture == "MixtralForCausalLM":
        p = f"model.layers.{layer}.block_sparse_moe.experts.{expert}."
        return p + "w1.weight", p + "w3.weight", p + "w2.weight"
    p = f"model.layers.{layer}.mlp.experts.{expert}."
    return p + "gate_proj.weight", p + "up_proj.weight", p + "down_proj.weight"


class Routed(NamedTuple):
    expert_ids: torch.Tensor  # [num_tokens, top_k] int64
    weights: torch.Tensor  # [num_tokens, top_k]


def route(
    x: torch.Tensor, router: torch.Tensor, cfg: MoeConfig, bias: torch.Tensor | None = None
) -> Routed:
    """x: [num_tokens, hidden] -> each token's top-k experts and their weights. `bias`:
    gpt-oss's router bias, added to the logits; DeepSeek-V3's correction bias (its own
    rule: `group_limited_topk`)."""
    if cfg.routing is Routing.SIGMOID_GROUPS:
        return group_limited_topk(x, router, cfg, bias)
    logits = x @ router  # [num_tokens, num_experts]
    if bias is not None:
        logits = logits + bias
    if cfg.routing is Routing.TOPK_SOFTMAX:
        top, ids = torch.topk(logits, cfg.top_k, dim=-1)
        return Routed(ids, torch.softmax(top.float(), dim=-1))
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    top, ids = torch.topk(probs, cfg.top_k, dim=-1)
    if cfg.norm_topk_prob:
        top = top / top.sum(dim=-1, keepdim=True)
    return Routed(ids, top.to(x.dtype))


def group_limited_topk(
    x: torch.Tensor, router: torch.Tensor, cfg: MoeConfig, correction: torch.Tensor | None
) -> Routed:
    """DeepSeek-V3's routing (module doc): x [num_tokens, hidden], router [hidden, E]
    (float32), correction [E] -> experts and float32 weights.

        scores  = sigmoid(x @ router)                  [tokens, E]
        choice  = scores + correction                  grouped: [tokens, G, E / G]
        groups  = top topk_groups of (sum of each group's two best choices)
        experts = top k of choice within those groups; weights = scores there
    """
    num, g = cfg.num_experts, cfg.num_groups
    scores = torch.sigmoid(x.float() @ router.float())  # [tokens, E]
    choice = scores if correction is None else scores + correction
    group_scores = choice.view(-1, g, num // g).topk(2, dim=-1)[0].sum(dim=-1)  # [tokens, G]
    best = group_scores.topk(cfg.topk_groups, dim=-1, sorted=False)[1]
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
    choice = choice.masked_fill(~keep.repeat_interleave(num // g, dim=1), float("-inf"))
    ids = choice.topk(cfg.top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)
    if cfg.norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return Routed(ids, weights * cfg.routed_scaling)


class SortedPairs(NamedTuple):
    pairs: torch.Tensor  # [num_local_pairs] flat pair ids in expert order (token = p // top_k)
    experts: torch.Tensor  # [num_local_pairs] each one's local expert
    offsets: torch.Tensor  # [num_local_experts] int32, cumulative counts (grouped_mm's offs)


def sort_by_expert(
    expert_ids: torch.Tensor, num_local: int, first_expert: int = 0, num_experts: int = 0
) -> SortedPairs:
    """The (token, slot) pairs routed to experts [first_expert, first_expert + num_local) of
    `num_experts`, stably sorted by expert (expert parallelism: the other pairs are another
    rank's).

    Args:
        expert_ids: [num_tokens, top_k]
    """
    flat = expert_ids.flatten() - first_expert
    pairs = torch.arange(flat.numel(), device=flat.device)
    if num_local < num_experts:  # expert parallel
        keep = (flat >= 0) & (flat < num_local)
        pairs, flat = pairs[keep], flat[keep]
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(num_local, dtype=torch.int32, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
    return SortedPairs(pairs[order], flat[order], torch.cumsum(counts, 0, dtype=torch.int32))


def _aligned(t: torch.Tensor) -> bool:
    # grouped_mm wants 16-byte aligned strides
    return all((s * t.element_size()) % 16 == 0 for s in t.stride()[:-1] if s != 1)


def grouped_mm(x: torch.Tensor, w: torch.Tensor, sorted_pairs: SortedPairs) -> torch.Tensor:
    """x: [num_pairs, in] sorted by expert; w: [num_experts, in, out] -> [num_pairs, out],
    row i times its expert's matrix. Shapes grouped_mm cannot take (strides not 16-byte
    aligned) fall back to one batched matmul over each row's gathered matrix."""
    if _aligned(x) and _aligned(w) and x.shape[0] > 0:
        return F.grouped_mm(x, w, offs=sorted_pairs.offsets)
    return torch.bmm(x.unsqueeze(1), w[sorted_pairs.experts]).squeeze(1)


def activation(gate_up: torch.Tensor, cfg: MoeConfig) -> torch.Tensor:
    """[rows, 2 * inter] (gate | up) -> [rows, inter]: SiLU(gate) * up, or gpt-oss's
    clamped SwiGLU."""
    gate, up = gate_up.chunk(2, -1)
    if cfg.swiglu_limit is None:
        return F.silu(gate) * up
    limit = cfg.swiglu_limit
    gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    return (up + 1) * (gate * torch.sigmoid(gate * cfg.swiglu_alpha))


def grouped_experts(
    x: torch.Tensor, routed: Routed, weights: MoeWeights, cfg: MoeConfig
) -> torch.Tensor:
    """The experts' weighted sum per token, as grouped GEMMs over expert-sorted pairs; with
    expert parallelism, over the pairs routed to this rank's experts only.

    Args:
        x: [num_tokens, hidden]
    Returns:
        [num_tokens, hidden] in x's dtype; in float32 when the down matrices are float32
        (a tensor-parallel rank's partial sum, summed over the ranks before it is rounded:
        `tandem.model.llama.LlamaModel`).
    """
    top_k = routed.expert_ids.shape[1]
    num_local = weights.gate_up.shape[0]
    num_experts = weights.router.shape[1]
    s = sort_by_expert(routed.expert_ids, num_local, weights.first_expert, num_experts)
    tokens = s.pairs // top_k  # [num_pairs] the token of each sorted pair
    xs = x.index_select(0, tokens)  # [num_pairs, hidden]
    gate_up = grouped_mm(xs, weights.gate_up, s)
    if weights.gate_up_bias is not None:
        gate_up = gate_up + weights.gate_up_bias[s.experts]
    act = activation(gate_up, cfg).contiguous()  # [num_pairs, expert_intermediate]
    out_dtype = torch.float32 if weights.down.dtype == torch.float32 else x.dtype
    ys = grouped_mm(act.to(out_dtype), weights.down, s)  # [num_pairs, hidden]
    if weights.down_bias is not None:
        ys = ys + weights.down_bias[s.experts]
    ys = (ys * routed.weights.flatten()[s.pairs].unsqueeze(1)).to(out_dtype)
    return torch.zeros_like(x, dtype=out_dtype).index_add_(0, tokens, ys)


def looped_experts(
    x: torch.Tensor, routed: Routed, weights: MoeWeights, cfg: MoeConfig
) -> torch.Tensor:
    """The same sum, one expert at a time (transformers' way): the benchmark's baseline and
    a reference for tests. Not for the hot path."""
    out = torch.zeros_like(x)
    for e in range(weights.gate_up.shape[0]):
        token_idx, slot = torch.where(routed.expert_ids == e + weights.first_expert)
        if token_idx.numel() == 0:
            continue
        gate_up = x[token_idx] @ weights.gate_up[e]
        if weights.gate_up_bias is not None:
            gate_up = gate_up + weights.gate_up_bias[e]
        y = activation(gate_up, cfg) @ weights.down[e]
        if weights.down_bias is not None:
            y = y + weights.down_bias[e]
        out.index_add_(0, token_idx, (y * routed.weights[token_idx, slot, None]).to(x.dtype))
    return out


def moe_forward(
    x: torch.Tensor, weights: MoeWeights, cfg: MoeConfig, counts: torch.Tensor | None = None
) -> torch.Tensor:
    """A sparse layer's MLP: x [num_tokens, hidden] -> [num_tokens, hidden]. `counts`
    ([num_experts] int64): the tokens routed to each expert are added to it (no host sync)."""
    out = _routed(x, weights, cfg, counts)
    if weights.shared is not None:
        gate_up, down, gate = weights.shared
        g, u = (x @ gate_up).chunk(2, dim=-1)
        y = (F.silu(g) * u) @ down
        out = out + (y if gate is None else torch.sigmoid(x @ gate) * y)
    return out


def _routed(
    x: torch.Tensor, weights: MoeWeights, cfg: MoeConfig, counts: torch.Tensor | None
) -> torch.Tensor:
    bias = weights.router_bias if weights.correction_bias is None else weights.correction_bias
    routed = route(x, weights.router, cfg, bias)
    if counts is not None:
        flat = routed.expert_ids.flatten()
        counts.scatter_add_(0, flat, torch.ones_like(flat))
    if x.is_cuda:  # fixed shapes whatever the routing: CUDA graphs capture it
        from tandem.kernels.fused_moe import fused_moe

        return fused_moe(
            x, weights.gate_up, weights.down, routed.expert_ids, routed.weights,
            first_expert=weights.first_expert, gate_up_bias=weights.gate_up_bias,
            down_bias=weights.down_bias, swiglu_limit=cfg.swiglu_limit,
            swiglu_alpha=cfg.swiglu_alpha, gate_up_scales=weights.gate_up_scales,
            down_scales=weights.down_scales,
        )  # fmt: skip
    if weights.gate_up_scales is not None:
        raise ValueError("MXFP4 experts are kept in 4 bits on CUDA only")
    return grouped_experts(x, routed, weights, cfg)


def active_params(num_params: int, cfg: MoeConfig, hidden: int) -> int:
    """Parameters a token runs through: all but the experts it is not routed to."""
    per_expert = 3 * hidden * cfg.expert_intermediate_size
    idle = (cfg.num_experts - cfg.top_k) * per_expert * len(cfg.sparse_layers)
    return num_params - idle
