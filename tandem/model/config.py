"""Model configuration read from a HuggingFace `config.json`."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tandem.model.moe import MoeConfig, Routing

# HF architecture name -> (qkv bias default, q/k norm)
SUPPORTED_ARCHITECTURES: dict[str, tuple[bool, bool]] = {
    "LlamaForCausalLM": (False, False),
    "MistralForCausalLM": (False, False),
    "Qwen2ForCausalLM": (True, False),
    "Qwen3ForCausalLM": (False, True),
    "Qwen3MoeForCausalLM": (False, True),
    "MixtralForCausalLM": (False, False),
}


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """Llama-3 style frequency-dependent RoPE scaling (`rope_type: llama3`) or linear."""

    rope_type: str  # "llama3" or "linear"
    factor: float
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """The decoder's shape and numerics. Built by `ModelConfig.from_hf`."""

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
    moe: MoeConfig | None = None  # mixture-of-experts layers (Qwen3-MoE, Mixtral)

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
    def kv_elements_per_token(self) -> int:
        """Elements of K and V for one token across all layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim

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
            eos = raw.get("eos_token_id")
            eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
            # transformers >= 5 writes rope settings under "rope_parameters"
            rope_params = raw.get("rope_parameters") or {}
            act = raw.get("hidden_act", "silu")
            if act != "silu":
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
                rope_theta=float(raw.get("rope_theta") or rope_params.get("rope_theta") or 1e4),
                rope_scaling=_parse_rope_scaling(raw.get("rope_scaling") or rope_params),
                max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                qkv_bias=bool(raw.get("attention_bias", default_bias)),
                qk_norm=qk_norm,
                bos_token_id=raw.get("bos_token_id"),
                eos_token_ids=tuple(int(e) for e in eos_ids),
                moe=_parse_moe(arch, raw),
            )
        except KeyError as exc:
            raise ValueError(f"config.json is missing required field {exc.args[0]!r}") from None

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelConfig:
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


def _parse_moe(arch: str, raw: dict[str, Any]) -> MoeConfig | None:
    """The sparse layers as transformers builds them: Mixtral's every layer; Qwen3-MoE's
    layer i unless i is in `mlp_only_layers`, when (i + 1) % `decoder_sparse_step` == 0."""
    num_layers = int(raw["num_hidden_layers"])
    # transformers >= 5 writes Qwen3-MoE's expert count as num_local_experts
    num_experts = int(raw.get("num_experts") or raw.get("num_local_experts") or 0)
    top_k = int(raw.get("num_experts_per_tok") or 0)
    if arch == "MixtralForCausalLM":
        return MoeConfig(
            num_experts=num_experts,
            top_k=top_k,
            expert_intermediate_size=int(raw["intermediate_size"]),
            routing=Routing.TOPK_SOFTMAX,
            norm_topk_prob=True,
            sparse_layers=tuple(range(num_layers)),
        )
    if arch != "Qwen3MoeForCausalLM" or num_experts == 0:
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


def _parse_rope_scaling(raw: dict[str, Any] | None) -> RopeScaling | None:
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
    raise ValueError(f"unsupported rope_scaling type {rope_type!r}; supported: llama3, linear")
