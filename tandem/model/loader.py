"""Load a HuggingFace model directory (config.json + safetensors) into `LlamaModel`."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open

from tandem.model.attention import AttentionBackend, TorchAttention
from tandem.model.config import ModelConfig
from tandem.model.llama import LayerWeights, LlamaModel, ModelWeights

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# Called as progress(tensors_loaded, tensors_total).
ProgressFn = Callable[[int, int], None]


def safetensors_files(model_dir: Path) -> list[Path]:
    """The weight files of a model dir: the sharded index's files, or model.safetensors."""
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise ValueError(f"{index} is not a valid safetensors index: {exc}") from None
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
    else:
        files = [model_dir / "model.safetensors"]
    for f in files:
        if not f.is_file():
            raise FileNotFoundError(f"missing weight file {f}")
    return files


def read_tensors(
    model_dir: Path, dtype: torch.dtype, device: torch.device, progress: ProgressFn | None
) -> dict[str, torch.Tensor]:
    files = safetensors_files(model_dir)
    handles = []
    for f in files:
        try:
            handles.append((f, safe_open(str(f), framework="pt", device="cpu")))
        except Exception as exc:  # safetensors raises its own error types for bad headers
            raise ValueError(f"{f} is not a valid safetensors file: {exc}") from None
    total = sum(len(list(h.keys())) for _, h in handles)
    tensors: dict[str, torch.Tensor] = {}
    for f, handle in handles:
        for name in handle.keys():
            try:
                t = handle.get_tensor(name)
            except Exception as exc:
                raise ValueError(f"{f}: cannot read tensor {name!r}: {exc}") from None
            tensors[name] = t.to(device=device, dtype=dtype)
            if progress is not None:
                progress(len(tensors), total)
    return tensors


def build_weights(config: ModelConfig, tensors: dict[str, torch.Tensor]) -> ModelWeights:
    """Map HF tensor names to our layout (fused, matrices transposed), checking every shape."""

    def take(name: str, shape: tuple[int, ...]) -> torch.Tensor:
        if name not in tensors:
            raise ValueError(f"weights are missing tensor {name!r}")
        t = tensors[name]
        if tuple(t.shape) != shape:
            raise ValueError(f"tensor {name!r} has shape {tuple(t.shape)}, expected {shape}")
        return t

    hid, inter, d = config.hidden_size, config.intermediate_size, config.head_dim
    q_out, kv_out = config.num_q_heads * d, config.num_kv_heads * d
    layers = []
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        qkv = (
            torch.cat(
                [
                    take(p + "self_attn.q_proj.weight", (q_out, hid)),
                    take(p + "self_attn.k_proj.weight", (kv_out, hid)),
                    take(p + "self_attn.v_proj.weight", (kv_out, hid)),
                ]
            )
            .t()
            .contiguous()
        )
        bias = None
        if config.qkv_bias:
            bias = torch.cat(
                [
                    take(p + "self_attn.q_proj.bias", (q_out,)),
                    take(p + "self_attn.k_proj.bias", (kv_out,)),
                    take(p + "self_attn.v_proj.bias", (kv_out,)),
                ]
            )
        layers.append(
            LayerWeights(
                input_norm=take(p + "input_layernorm.weight", (hid,)),
                qkv=qkv,
                qkv_bias=bias,
                q_norm=take(p + "self_attn.q_norm.weight", (d,)) if config.qk_norm else None,
                k_norm=take(p + "self_attn.k_norm.weight", (d,)) if config.qk_norm else None,
                o=take(p + "self_attn.o_proj.weight", (hid, q_out)).t().contiguous(),
                post_norm=take(p + "post_attention_layernorm.weight", (hid,)),
                gate_up=torch.cat(
                    [
                        take(p + "mlp.gate_proj.weight", (inter, hid)),
                        take(p + "mlp.up_proj.weight", (inter, hid)),
                    ]
                )
                .t()
                .contiguous(),
                down=take(p + "mlp.down_proj.weight", (hid, inter)).t().contiguous(),
            )
        )
    embed = take("model.embed_tokens.weight", (config.vocab_size, hid))
    if config.tie_word_embeddings or "lm_head.weight" not in tensors:
        if not config.tie_word_embeddings:
            raise ValueError("weights are missing tensor 'lm_head.weight'")
        lm_head = embed.t()  # shares storage with the embedding
    else:
        lm_head = take("lm_head.weight", (config.vocab_size, hid)).t().contiguous()
    return ModelWeights(
        embed=embed, layers=layers, final_norm=take("model.norm.weight", (hid,)), lm_head=lm_head
    )


def load_model(
    model_dir: str | Path,
    dtype: str = "float32",
    device: str = "cpu",
    max_positions: int | None = None,
    attention: AttentionBackend | None = None,
    progress: ProgressFn | None = None,
) -> LlamaModel:
    """Load config and weights from a HuggingFace directory.

    Raises:
        FileNotFoundError: config.json or a weight file is missing.
        ValueError: unsupported architecture, corrupt file, missing or misshapen tensor.
    """
    path = Path(model_dir)
    if not path.is_dir():
        raise FileNotFoundError(f"model directory {model_dir} does not exist")
    config = ModelConfig.from_dir(path)
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    dev = torch.device(device)
    weights = build_weights(config, read_tensors(path, DTYPES[dtype], dev, progress))
    return LlamaModel(
        config,
        weights,
        attention or TorchAttention(),
        max_positions or config.max_position_embeddings,
    )
