"""Model configuration read from a HuggingFace `config.json`."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tandem.model.layer_groups import (
    KVLayout,
    LayerGroup,
    LayerKind,
    LinearAttention,
    Mla,
    group_layers,
    kv_layout,
    layer_types,
)
from tandem.model.moe import MoeConfig, Routing

DEEPSEEK_V3 = "DeepseekV3ForCausalLM"

# HF architecture name -> (qkv bias default, q/k norm)
SUPPORTED_ARCHITECTURES: dict[str, tuple[bool, bool]] = {
    DEEPSEEK_V3: (False, False),
    "Gemma3ForCausalLM": (False, True),
    "GptOssForCausalLM": (True, False),
    "LlamaForCausalLM": (False, False),
    "MistralForCausalLM": (False, False),
    "Qwen2ForCausalLM": (True, False),
    "Qwen3ForCausalLM": (False, True),
    "Qwen3MoeForCausalLM": (False, True),
    "Qwen3NextForCausalLM": (False, True),
    "MixtralForCausalLM": (False, False),
}


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """RoPE scaling: Llama-3's frequency-dependent one (`llama3`), `linear`, or YaRN
    (`yarn`: gpt-oss; its cos/sin tables scaled by `attention_factor`)."""

    rope_type: str  # "llama3", "linear" or "yarn"
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    truncate: bool = True  # yarn: round the correction range out to whole dimensions
    attention_factor: float = 1.0  # yarn: cos and sin multiplied by it


@dataclass(frozen=True, slots=True)
class Features:
    """What a family adds to the Llama decoder (all off for Llama, Mistral, Qwen, Mixtral).

    Attributes:
        layer_windows: per layer, its sliding window (tokens a query attends to, itself
            included) or None for full attention; empty: every layer full.
        sinks: each attention head has a learned sink logit (gpt-oss): one more term in
            the softmax's denominator, attached to no value.
        o_bias: o_proj has a bias (gpt-oss's attention_bias covers o too).
        offset_norms: Gemma's and Qwen3-Next's RMSNorm: the weight stored as 1 + w, the
            product taken in float32.
        sandwich_norms: Gemma's sandwich: each sublayer's output normed before the residual
            add, a separate norm before the MLP.
        embed_scale: the embedding multiplied by it (Gemma: sqrt(hidden)).
        attn_scale: the softmax scale (None: head_dim ** -0.5).
        activation: the dense MLP's, "silu" or "gelu_tanh".
        local_rope: the sliding layers' own RoPE (theta, scaling); None: the model's.
        final_softcap: logits = cap * tanh(logits / cap).
        linear: Qwen3-Next's Gated DeltaNet layers (`LinearAttention`), whose indices are
            `linear_layers`; None: none.
        attn_gate: each full-attention head's output times sigmoid(its gate), the gate
            projected with the query (Qwen3-Next).
        rotary_dim: RoPE rotates only the first rotary_dim dims of each head (None: all).
        shared_expert_size: a sparse layer's shared expert's width, gated per token
            (Qwen3-Next) or not (DeepSeek-V3: n_shared_experts x moe_intermediate_size);
            0: none.
        mla: multi-head latent attention (DeepSeek-V3, tandem.model.mla) in every layer;
            the cache then holds one KV head of `Mla.cache_head_dim`.
        mtp_layers: multi-token-prediction layers stored after the decoder's (DeepSeek-V3's
            num_nextn_predict_layers): never loaded.
    """

    layer_windows: tuple[int | None, ...] = ()
    sinks: bool = False
    o_bias: bool = False
    offset_norms: bool = False
    sandwich_norms: bool = False
    embed_scale: float | None = None
    attn_scale: float | None = None
    activation: str = "silu"
    local_rope: tuple[float, RopeScaling | None] | None = None
    final_softcap: float | None = None
    linear: LinearAttention | None = None
    linear_layers: tuple[int, ...] = ()
    attn_gate: bool = False
    rotary_dim: int | None = None
    shared_expert_size: int = 0
    mla: Mla | None = None
    mtp_layers: int = 0

    def window(self, layer: int) -> int | None:
        return self.layer_windows[layer] if self.layer_windows else None

    def layer_kinds(self, num_layers: int) -> tuple[LayerKind, ...]:
        """Each layer's kind of per-request state (tandem.model.layer_groups)."""
        linear = set(self.linear_layers)
        return tuple(
            LayerKind.LINEAR if i in linear
            else LayerKind.SLIDING if self.window(i) is not None
            else LayerKind.FULL
            for i in range(num_layers)
        )  # fmt: skip


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """The decoder's shape and numerics. Built by `ModelConfig.from_hf`.

    num_kv_heads and head_dim are the paged cache's: an MLA model (DeepSeek-V3) keeps one
    latent and one rope key per token and layer, so its cache has one KV head of
    (kv_lora_rank + qk_rope_head_dim) / 2 whose K and V halves hold them together
    (tandem.model.mla; DeepSeek-V3: 61 layers x 576 elements, 70,272 bytes a token in
    bfloat16), whatever config.json's num_key_value_heads says.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: RopeScaling | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    moe: MoeConfig | None = None  # mixture-of-experts layers (Qwen3-MoE, Mixtral, gpt-oss)
    features: Features = Features()  # Gemma 3's and gpt-oss's additions

    def __post_init__(self) -> None:
        if self.num_q_heads % self.num_kv_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_q_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")

    @property
    def layer_groups(self) -> tuple[LayerGroup, ...]:
        """The layers grouped by the state they keep, without bytes: what the prefix-hit
        rule across groups (layer_groups.resumable_prefix) reads."""
        kinds = self.features.layer_kinds(self.num_layers)
        # one sliding group: under the widest window (every family here has one)
        windows = [w for w in self.features.layer_windows if w is not None]
        return group_layers(kinds, max(windows, default=None))

    @property
    def kv_layers(self) -> tuple[int, ...]:
        """The layers that keep K and V in the paged cache, in order: every attention layer
        (a linear-attention layer keeps a state instead, tandem.model.linear_attention).
        The cache's layer dimension follows this order."""
        linear = set(self.features.linear_layers)
        return tuple(i for i in range(self.num_layers) if i not in linear)

    @property
    def kv_layout(self) -> KVLayout:
        """How the attention layers share the paged cache: tables of `slots` layers each, a
        request holding one block table per table (tandem.model.layer_groups.KVLayout)."""
        return kv_layout(self.layer_groups)

    @property
    def kv_elements_per_token(self) -> int:
        """Elements of K and V of one token in one block (every slot of the layout; a dense
        model's every layer)."""
        return 2 * self.kv_layout.slots * self.num_kv_heads * self.head_dim

    @classmethod
    def from_hf(cls, raw: dict[str, Any]) -> ModelConfig:
        """Parse a HuggingFace config dict. Raises ValueError for unsupported models."""
        archs = raw.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            raise ValueError(
                f"unsupported architecture {archs or raw.get('model_type')!r}; "
                f"supported: {', '.join(sorted(SUPPORTED_ARCHITECTURES))}"
            )
        default_bias, qk_norm = SUPPORTED_ARCHITECTURES[arch]
        try:
            hidden = int(raw["hidden_size"])
            num_q_heads = int(raw["num_attention_heads"])
            num_kv_heads = int(raw.get("num_key_value_heads") or num_q_heads)
            head_dim = int(raw.get("head_dim") or hidden // num_q_heads)
            features = _parse_features(arch, raw)
            if features.mla is not None:  # the cache's one head: module doc
                num_kv_heads, head_dim = 1, features.mla.cache_head_dim
            eos = raw.get("eos_token_id")
            eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
            # transformers >= 5 writes rope settings under "rope_parameters"
            rope_params = raw.get("rope_parameters") or {}
            if arch == "Gemma3ForCausalLM":  # per layer kind: rope_parameters.full_attention
                rope_params = rope_params.get("full_attention") or {}
            act = raw.get("hidden_act", "silu")
            if act != "silu" and arch != "Gemma3ForCausalLM":
                raise ValueError(f"unsupported hidden_act {act!r}; only 'silu' is supported")
            return cls(
                architecture=arch,
                vocab_size=int(raw["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(raw["intermediate_size"]),
                num_layers=int(raw["num_hidden_layers"]),
                num_q_heads=num_q_heads,
                num_kv_heads=num_kv_heads,
                head_dim=head_dim,
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                rope_theta=float(
                    raw.get("rope_theta")
                    or rope_params.get("rope_theta")
                    or DEFAULT_THETA.get(arch, 1e4)
                ),
                rope_scaling=_parse_rope_scaling(raw.get("rope_scaling") or rope_params, raw),
                max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                qkv_bias=bool(raw.get("attention_bias", default_bias)),
                qk_norm=qk_norm,
                bos_token_id=raw.get("bos_token_id"),
                eos_token_ids=tuple(int(e) for e in eos_ids),
                moe=_parse_moe(arch, raw),
                features=features,
            )
        except KeyError as exc:
            raise ValueError(f"config.json is missing required field {exc.args[0]!r}") from None

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
        if not Path(model_dir).is_dir():
            raise FileNotFoundError(f"model directory {model_dir} does not exist")
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"no config.json in model directory {model_dir}")
        try:
            raw = json.loads(path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ValueError(f"{path} is not valid JSON: {exc}") from None
        if not isinstance(raw, dict):
            raise ValueError(f"{path} must hold a JSON object")
        return cls.from_hf(raw)


# config.json's rope_theta where it names none (transformers' defaults; others 10000)
DEFAULT_THETA: dict[str, float] = {
    "GptOssForCausalLM": 150000.0,
    "Gemma3ForCausalLM": 1_000_000.0,
}


def _parse_moe(arch: str, raw: dict[str, Any]) -> MoeConfig | None:
    """The sparse layers as transformers builds them: Mixtral's and gpt-oss's every layer;
    Qwen3-MoE's and Qwen3-Next's layer i unless i is in `mlp_only_layers`, when (i + 1) %
    `decoder_sparse_step` == 0."""
    num_layers = int(raw["num_hidden_layers"])
    # transformers >= 5 writes Qwen3-MoE's expert count as num_local_experts
    num_experts = int(raw.get("num_experts") or raw.get("num_local_experts") or 0)
    top_k = int(raw.get("num_experts_per_tok") or 0)
    if arch in ("MixtralForCausalLM", "GptOssForCausalLM"):
        # every layer sparse, the top k router logits softmaxed; gpt-oss's router and
        # experts have biases (its gate and up interleaved in the file) and a clamped SwiGLU
        oss = arch == "GptOssForCausalLM"
        return MoeConfig(
            num_experts=num_experts,
            top_k=top_k,
            expert_intermediate_size=int(raw["intermediate_size"]),
            routing=Routing.TOPK_SOFTMAX,
            norm_topk_prob=True,
            sparse_layers=tuple(range(num_layers)),
            biases=oss,
            swiglu_limit=float(raw.get("swiglu_limit", 7.0)) if oss else None,
            swiglu_alpha=float(raw.get("swiglu_alpha", 1.702)),
        )
    if arch == DEEPSEEK_V3:
        return _deepseek_moe(raw)
    if arch not in ("Qwen3MoeForCausalLM", "Qwen3NextForCausalLM") or num_experts == 0:
        return None
    dense = set(raw.get("mlp_only_layers") or ())
    step = int(raw.get("decoder_sparse_step") or 1)
    return MoeConfig(
        num_experts=num_experts,
        top_k=top_k,
        expert_intermediate_size=int(raw["moe_intermediate_size"]),
        routing=Routing.SOFTMAX_TOPK,
        norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
        sparse_layers=tuple(i for i in range(num_layers) if i not in dense and (i + 1) % step == 0),
    )


def _parse_features(arch: str, raw: dict[str, Any]) -> Features:
    """Gemma 3's, gpt-oss's and Qwen3-Next's additions (`Features`); the defaults for every
    other family."""
    if arch == "Qwen3NextForCausalLM":
        return _qwen3_next_features(raw)
    if arch == DEEPSEEK_V3:
        return _deepseek_features(raw)
    if arch not in ("Gemma3ForCausalLM", "GptOssForCausalLM"):
        return Features()
    window = raw.get("sliding_window")
    # transformers' defaults: gpt-oss alternates, Gemma 3 5 local : 1
    period = 2 if arch == "GptOssForCausalLM" else int(raw.get("sliding_window_pattern", 6))
    types = layer_types(raw, LayerKind.SLIDING, period)
    if "sliding_attention" in types and not window:
        raise ValueError("sliding_attention layers need a positive sliding_window")
    size = int(window or 0)
    windows = tuple(size if t == "sliding_attention" else None for t in types)
    if arch == "GptOssForCausalLM":
        o_bias = bool(raw.get("attention_bias", True))
        return Features(layer_windows=windows, sinks=True, o_bias=o_bias)
    for field in ("attn_logit_softcapping",):
        if raw.get(field) is not None:
            raise ValueError(f"unsupported {field} {raw[field]!r}: Gemma 3 configs set none")
    if raw.get("use_bidirectional_attention"):
        raise ValueError("use_bidirectional_attention is not supported (a causal decoder)")
    act = raw.get("hidden_activation") or raw.get("hidden_act") or "gelu_pytorch_tanh"
    if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
        raise ValueError(f"unsupported hidden_activation {act!r}; Gemma 3 uses gelu_pytorch_tanh")
    local = (raw.get("rope_parameters") or {}).get("sliding_attention") or {}
    local_theta = float(local.get("rope_theta") or raw.get("rope_local_base_freq") or 1e4)
    cap = raw.get("final_logit_softcapping")
    return Features(
        layer_windows=windows,
        offset_norms=True,
        sandwich_norms=True,
        embed_scale=float(raw["hidden_size"]) ** 0.5,
        attn_scale=float(raw.get("query_pre_attn_scalar") or 256) ** -0.5,
        activation="gelu_tanh",
        local_rope=(local_theta, _parse_rope_scaling(local, raw)),
        final_softcap=float(cap) if cap else None,
    )


def _qwen3_next_features(raw: dict[str, Any]) -> Features:
    """Qwen3-Next: Gated DeltaNet layers between gated full-attention ones (transformers'
    default: every `full_attention_interval`-th full), partial RoPE, 1 + w norms, a shared
    expert beside the routed ones."""
    # transformers' default: every full_attention_interval-th layer full
    types = layer_types(raw, LayerKind.LINEAR, int(raw.get("full_attention_interval") or 4))
    linear = LinearAttention.from_raw(raw)
    if linear.num_v_heads % linear.num_k_heads:
        raise ValueError("linear_num_value_heads must be a multiple of linear_num_key_heads")
    rope = raw.get("rope_parameters") or {}
    factor = float(rope.get("partial_rotary_factor") or raw.get("partial_rotary_factor") or 1.0)
    head_dim = int(raw.get("head_dim") or 0) or int(raw["hidden_size"]) // int(
        raw["num_attention_heads"]
    )
    return Features(
        offset_norms=True,
        linear=linear,
        linear_layers=tuple(i for i, t in enumerate(types) if t == "linear_attention"),
        attn_gate=True,
        rotary_dim=int(head_dim * factor) if factor < 1.0 else None,
        shared_expert_size=int(raw.get("shared_expert_intermediate_size") or 0),
    )


def _deepseek_moe(raw: dict[str, Any]) -> MoeConfig | None:
    """DeepSeek-V3's sparse layers: every layer from first_k_dense_replace on, routed by
    sigmoid scores with the correction bias, the top k within the best topk_group groups."""
    for field, value in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc")):
        if raw.get(field, value) != value:
            raise ValueError(f"unsupported {field} {raw[field]!r}; DeepSeek-V3's is {value}")
    if int(raw.get("moe_layer_freq") or 1) != 1:
        raise ValueError("moe_layer_freq other than 1 is not supported")
    num_experts = int(raw.get("n_routed_experts") or 0)
    if num_experts == 0:
        return None
    first = int(raw.get("first_k_dense_replace") or 0)
    return MoeConfig(
        num_experts=num_experts,
        top_k=int(raw["num_experts_per_tok"]),
        expert_intermediate_size=int(raw["moe_intermediate_size"]),
        routing=Routing.SIGMOID_GROUPS,
        norm_topk_prob=bool(raw.get("norm_topk_prob", True)),
        sparse_layers=tuple(range(first, int(raw["num_hidden_layers"]))),
        num_groups=int(raw.get("n_group") or 1),
        topk_groups=int(raw.get("topk_group") or 1),
        routed_scaling=float(raw.get("routed_scaling_factor") or 1.0),
    )


def _deepseek_features(raw: dict[str, Any]) -> Features:
    """DeepSeek-V3: MLA in every layer, its softmax scale qk_head_dim ** -0.5 times YaRN's
    mscale(factor, mscale_all_dim) squared where the rope scaling names one (transformers'
    yarn_apply_mscale), ungated shared experts, multi-token-prediction layers skipped."""
    if raw.get("attention_bias"):
        raise ValueError("attention_bias is not supported (DeepSeek-V3's checkpoints have none)")
    mla = Mla.from_raw(raw)
    scale = mla.qk_head_dim**-0.5
    rope = raw.get("rope_scaling") or raw.get("rope_parameters") or {}
    scaled = rope.get("rope_type", rope.get("type", "default")) != "default"
    if scaled and rope.get("mscale_all_dim"):
        original = int(rope["original_max_position_embeddings"])
        factor = rope.get("factor") or int(raw["max_position_embeddings"]) / original
        scale *= _yarn_mscale(float(factor), float(rope["mscale_all_dim"])) ** 2
    shared = int(raw.get("n_shared_experts") or 0) * int(raw.get("moe_intermediate_size") or 0)
    return Features(
        attn_scale=scale,
        shared_expert_size=shared,
        mla=mla,
        mtp_layers=int(raw.get("num_nextn_predict_layers") or 0),
    )


def _parse_rope_scaling(raw: dict[str, Any] | None, config: dict[str, Any]) -> RopeScaling | None:
    if not raw:
        return None
    rope_type = raw.get("rope_type", raw.get("type", "default"))
    if rope_type == "default":
        return None
    if rope_type == "llama3":
        return RopeScaling(
            rope_type="llama3",
            factor=float(raw["factor"]),
            low_freq_factor=float(raw["low_freq_factor"]),
            high_freq_factor=float(raw["high_freq_factor"]),
            original_max_position_embeddings=int(raw["original_max_position_embeddings"]),
        )
    if rope_type == "linear":
        return RopeScaling(rope_type="linear", factor=float(raw["factor"]))
    if rope_type == "yarn":
        original = int(raw["original_max_position_embeddings"])
        factor = raw.get("factor") or int(config["max_position_embeddings"]) / original
        attention = raw.get("attention_factor")
        if attention is None:  # YaRN's mscale; mscale / mscale_all_dim where both are set
            mscale, mscale_all = raw.get("mscale"), raw.get("mscale_all_dim")
            attention = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all) \
                if mscale and mscale_all else _yarn_mscale(factor)  # fmt: skip
        return RopeScaling(
            rope_type="yarn",
            factor=float(factor),
            original_max_position_embeddings=original,
            beta_fast=float(raw.get("beta_fast") or 32),
            beta_slow=float(raw.get("beta_slow") or 1),
            truncate=bool(raw.get("truncate", True)),
            attention_factor=float(attention),
        )
    raise ValueError(
        f"unsupported rope_scaling type {rope_type!r}; supported: llama3, linear, yarn"
    )


def _yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0
