"""Every tensor a model reads from its checkpoint, with its shape, checked before anything is
read (`tandem.weights.loader`)."""

from __future__ import annotations

from tandem.model.config import ModelConfig
from tandem.model.moe import expert_names, router_name
from tandem.weights import families
from tandem.weights.safetensors_io import TensorEntry


def expected_shapes(
    config: ModelConfig, mxfp4: bool = False, fused_experts: bool = False
) -> dict[str, tuple[int, ...]]:
    """HF name -> shape of every tensor the model reads, in the order they are loaded
    (`mxfp4`: a gpt-oss checkpoint's experts as OpenAI ships them; `fused_experts`: a
    DeepSeek-V3 checkpoint's experts stacked; tandem.weights.families)."""
    hid, inter, d = config.hidden_size, config.intermediate_size, config.head_dim
    q_out, kv_out = config.num_q_heads * d, config.num_kv_heads * d
    shapes: dict[str, tuple[int, ...]] = {}
    # Qwen3-Next: each head's query, then its output gate
    q_rows = 2 * q_out if config.features.attn_gate else q_out
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        # else linear_attn's own (Qwen3-Next) or MLA's (DeepSeek-V3, families.mla_shapes)
        attention = i not in config.features.linear_layers and config.features.mla is None
        if attention:  # in the order the builder reads them
            shapes[p + "self_attn.q_proj.weight"] = (q_rows, hid)
            shapes[p + "self_attn.k_proj.weight"] = (kv_out, hid)
            shapes[p + "self_attn.v_proj.weight"] = (kv_out, hid)
            if config.qkv_bias:
                shapes[p + "self_attn.q_proj.bias"] = (q_out,)
                shapes[p + "self_attn.k_proj.bias"] = (kv_out,)
                shapes[p + "self_attn.v_proj.bias"] = (kv_out,)
        shapes[p + "input_layernorm.weight"] = (hid,)
        if attention:
            if config.qk_norm:
                shapes[p + "self_attn.q_norm.weight"] = (d,)
                shapes[p + "self_attn.k_norm.weight"] = (d,)
            shapes[p + "self_attn.o_proj.weight"] = (hid, q_out)
        shapes[p + "post_attention_layernorm.weight"] = (hid,)
        # Gemma 3's, gpt-oss's, Qwen3-Next's and DeepSeek-V3's own tensors
        shapes.update(families.layer_shapes(config, i, mxfp4, fused_experts))
        sparse = config.moe is not None and i in config.moe.sparse_layers
        if config.architecture == families.GPT_OSS or (
            sparse and config.architecture == families.DEEPSEEK_V3
        ):
            continue  # the experts are in families.layer_shapes
        if config.moe is not None and sparse:
            e_inter = config.moe.expert_intermediate_size
            shapes[router_name(config.architecture, i)] = (config.moe.num_experts, hid)
            for e in range(config.moe.num_experts):
                gate, up, down = expert_names(config.architecture, i, e)
                shapes[gate] = (e_inter, hid)
                shapes[up] = (e_inter, hid)
                shapes[down] = (hid, e_inter)
            continue
        shapes[p + "mlp.gate_proj.weight"] = (inter, hid)
        shapes[p + "mlp.up_proj.weight"] = (inter, hid)
        shapes[p + "mlp.down_proj.weight"] = (hid, inter)
    shapes["model.embed_tokens.weight"] = (config.vocab_size, hid)
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, hid)
    shapes["model.norm.weight"] = (hid,)
    return shapes


def check_entries(entries: dict[str, TensorEntry], shapes: dict[str, tuple[int, ...]]) -> None:
    """Raise ValueError for the first expected tensor that is missing or misshapen."""
    for name, shape in shapes.items():
        if name not in entries:
            raise ValueError(f"weights are missing tensor {name!r}")
        if entries[name].shape != shape:
            raise ValueError(f"tensor {name!r} has shape {entries[name].shape}, expected {shape}")
