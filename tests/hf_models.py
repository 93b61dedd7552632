"""Tiny random transformers models per family, built and saved with seeded weights: the
references of the parity tests (tests/conftest.py's `hf_model`) and of the GPU check's
hybrid engines (benchmarks/gpu_check). No side effects on import."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

# Tiny decoder shapes per family; each exercises a different code path of the model.
ARCH_CONFIGS: dict[str, dict[str, Any]] = {
    "llama": dict(cls="LlamaConfig"),
    "llama3-rope-tied": dict(
        cls="LlamaConfig",
        tie_word_embeddings=True,
        rope_theta=500000.0,
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
    "mistral": dict(cls="MistralConfig", sliding_window=None),
    "qwen2": dict(cls="Qwen2Config"),
    "qwen3": dict(cls="Qwen3Config", head_dim=24),
    # Mixture of experts: 8 experts, top 2; Qwen3-MoE renormalises the top k, its second
    # layer is dense (mlp_only_layers) and its expert width differs from the dense MLP's.
    "qwen3-moe": dict(
        cls="Qwen3MoeConfig",
        head_dim=24,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[1],
    ),
    "mixtral": dict(
        cls="MixtralConfig", num_local_experts=8, num_experts_per_tok=2, sliding_window=None
    ),
    # Hybrid attention (issue 42): windows shorter than the tests' prompts, so pages fall
    # out of them. gpt-oss: sliding / full alternating, sinks, biases, YaRN, 4 experts top 2
    # with the clamped SwiGLU (a low limit, so the clamp bites).
    "gpt-oss": dict(
        cls="GptOssConfig",
        head_dim=16,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=6,
        swiglu_limit=1.0,
        num_hidden_layers=3,
        rope_parameters={
            "rope_type": "yarn",
            "factor": 4.0,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "truncate": False,
            "rope_theta": 150000.0,
            "original_max_position_embeddings": 128,
        },
    ),  # fmt: skip
    # Gemma 3: two local layers (window 5, their own rope base) per global one (linear
    # rope scaling), QK-norm, the sandwich norms, scaled embeddings, a final soft cap.
    "gemma3": dict(
        cls="Gemma3TextConfig",
        head_dim=16,
        sliding_window=5,
        query_pre_attn_scalar=24,
        num_hidden_layers=3,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        final_logit_softcapping=30.0,
        rope_parameters={
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 100000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 1000.0},
        },
    ),  # fmt: skip
    # Qwen3-Next: Gated DeltaNet layers (2 key heads shared by 4 value heads) around a
    # gated full-attention layer with partial RoPE; MoE with a shared expert, one dense layer.
    "qwen3-next": dict(
        cls="Qwen3NextConfig",
        head_dim=16,
        num_hidden_layers=4,
        layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"],
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=8,
        linear_value_head_dim=8,
        linear_conv_kernel_dim=4,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[2],
    ),  # fmt: skip
    # DeepSeek-V3 (issue 43): multi-head latent attention (q low-rank, the latent cache, the
    # decoupled rope key, interleaved rope), YaRN with mscale / mscale_all_dim (the softmax
    # scale's too), one dense layer then MoE with sigmoid routing, the correction bias and
    # group-limited top k (2 groups of 4, the best one's experts only), a shared expert.
    "deepseek-v3": dict(
        cls="DeepseekV3Config",
        num_hidden_layers=3,
        num_key_value_heads=4,
        q_lora_rank=32,
        kv_lora_rank=32,
        qk_rope_head_dim=8,
        qk_nope_head_dim=16,
        v_head_dim=16,
        n_routed_experts=8,
        num_experts_per_tok=3,
        n_group=2,
        topk_group=1,
        first_k_dense_replace=1,
        moe_intermediate_size=32,
        n_shared_experts=1,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
        rope_interleave=True,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": 10000.0,
            "factor": 4.0,
            "original_max_position_embeddings": 128,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
            "mscale": 0.707,
            "mscale_all_dim": 1.0,
        },
    ),  # fmt: skip
    # One q_proj (no q_lora_rank), one group, top 2 not renormalised, two shared experts'
    # width, rotate-half rope without scaling.
    "deepseek-v3-noqlora": dict(
        cls="DeepseekV3Config",
        num_hidden_layers=3,
        num_key_value_heads=4,
        q_lora_rank=None,
        kv_lora_rank=32,
        qk_rope_head_dim=8,
        qk_nope_head_dim=16,
        v_head_dim=16,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=1,
        moe_intermediate_size=32,
        n_shared_experts=2,
        norm_topk_prob=False,
        routed_scaling_factor=1.5,
        rope_interleave=False,
    ),  # fmt: skip
}

BASE_SHAPE = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    initializer_range=0.1,  # wide logits: greedy decoding never sits on a near-tie
    eos_token_id=None,
    bos_token_id=None,
    pad_token_id=0,
)


def build_hf_model(arch: str, out_dir: Path, seed: int = 0, **shape: Any) -> Any:
    """A random transformers model of `arch` saved to `out_dir`; `shape` overrides
    BASE_SHAPE's fields (a vocabulary that fits a tokenizer)."""
    import transformers

    spec = dict(ARCH_CONFIGS[arch])
    cls = getattr(transformers, spec.pop("cls"))
    config = cls(**{**BASE_SHAPE, **spec, **shape})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    if arch == "qwen2":
        # HF initializes biases to zero; give them values so the bias path is exercised.
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (
                    layer.self_attn.q_proj,
                    layer.self_attn.k_proj,
                    layer.self_attn.v_proj,
                ):
                    proj.bias.normal_(0.0, 0.1)
    if arch in ("qwen3", "qwen3-moe", "gemma3"):
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.q_norm.weight.normal_(1.0, 0.2)
                layer.self_attn.k_norm.weight.normal_(1.0, 0.2)
    if arch in ("gpt-oss", "gemma3", "qwen3-next"):
        # transformers zeroes biases and Gemma's norms (applied as 1 + w): give them values
        # so each path is exercised
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("bias") or "norm" in name:
                    p.normal_(0.0, 0.2)
                if name.endswith("sinks"):
                    p.normal_(0.0, 1.0)
    if arch.startswith("deepseek-v3"):
        # transformers sets the latent norms to ones and the correction bias to zeros
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("layernorm.weight") and "self_attn" in name:
                    p.normal_(1.0, 0.2)
            for layer in model.model.layers:
                gate = getattr(layer.mlp, "gate", None)
                if gate is not None and hasattr(gate, "e_score_correction_bias"):
                    gate.e_score_correction_bias.normal_(0.0, 0.1)
    if arch in ("qwen3-moe", "mixtral", "qwen3-next", "deepseek-v3", "deepseek-v3-noqlora"):
        # transformers initializes routers to zero (every expert tied): spread them so each
        # token's top k is decided and the experts differ in use.
        with torch.no_grad():
            for layer in model.model.layers:
                block = getattr(layer, "block_sparse_moe", None) or layer.mlp
                gate = getattr(block, "gate", None)
                if gate is not None:
                    gate.weight.normal_(0.0, 0.5)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    model.save_pretrained(out_dir)
    return model
