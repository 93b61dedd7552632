"""GGUF (llama.cpp) models: dequantize tensors, map names and metadata, write a HF directory.

`convert_gguf` turns a GGUF file into the plain model directory (config.json, model.safetensors,
tokenizer.json, tokenizer_config.json, generation_config.json) that `ModelConfig.from_dir`, the
loader and `Tokenizer.from_dir` already read, so a GGUF model runs wherever a HF one does.

Supported: the `llama` architecture; tensor types F32, F16, BF16, Q8_0, Q4_0, Q4_1; the `gpt2`
(byte-level BPE) tokenizer model with the gpt-2, llama-bpe, smollm and qwen2 pre-tokenizers, and
the `llama` (SentencePiece BPE with byte fallback) tokenizer model.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import torch
from gguf import GGMLQuantizationType, GGUFReader, ReaderTensor
from safetensors.torch import save_file

from tandem.tokenizer.gguf import build_tokenizer
from tandem.tokenizer.gguf import metadata as _field

QK = 32  # elements per block of Q8_0, Q4_0 and Q4_1

# Block layouts (ggml-common.h), little-endian, 32 elements per block:
#   Q8_0: f16 d | 32 x int8 q                    x = d * q
#   Q4_0: f16 d | 16 bytes, nibbles              x = d * (q - 8)
#   Q4_1: f16 d | f16 m | 16 bytes, nibbles      x = d * q + m
# Nibbles: byte j holds element j in its low 4 bits and element j + 16 in its high 4 bits.
_BLOCK_BYTES = {
    GGMLQuantizationType.Q8_0: 2 + QK,
    GGMLQuantizationType.Q4_0: 2 + QK // 2,
    GGMLQuantizationType.Q4_1: 4 + QK // 2,
}
_ELEMENT_BYTES = {
    GGMLQuantizationType.F32: 4,
    GGMLQuantizationType.F16: 2,
    GGMLQuantizationType.BF16: 2,
}
SUPPORTED_TYPES = tuple(_ELEMENT_BYTES) + tuple(_BLOCK_BYTES)

# llama.cpp per-layer tensor name -> HF name inside `model.layers.N.`
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}

# -- dequantization ----------------------------------------------------------------------------


def dequantize(
    raw: npt.NDArray[Any],
    qtype: GGMLQuantizationType,
    shape: tuple[int, ...],
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Decode one tensor's stored bytes into a torch tensor of `shape` (torch order) and `dtype`.

    Raises:
        ValueError: unsupported type, or a byte count that does not match `shape`.
    """
    num_elements = int(np.prod(shape, dtype=np.int64))
    buf = np.ascontiguousarray(raw).reshape(-1).view(np.uint8)
    if qtype in _ELEMENT_BYTES:
        expected = num_elements * _ELEMENT_BYTES[qtype]
    elif qtype in _BLOCK_BYTES:
        if num_elements % QK:
            raise ValueError(f"{qtype.name} tensor of {num_elements} elements is not whole blocks")
        expected = num_elements // QK * _BLOCK_BYTES[qtype]
    else:
        supported = ", ".join(t.name for t in SUPPORTED_TYPES)
        raise ValueError(f"unsupported GGUF tensor type {qtype.name}; supported: {supported}")
    if buf.size != expected:
        raise ValueError(
            f"{qtype.name} tensor of shape {shape} needs {expected} bytes, got {buf.size}"
        )
    out = _decode(buf, qtype)
    return torch.from_numpy(out.reshape(shape)).to(dtype)


def _decode(buf: npt.NDArray[np.uint8], qtype: GGMLQuantizationType) -> npt.NDArray[np.float32]:
    if qtype == GGMLQuantizationType.F32:
        return buf.view("<f4").copy()
    if qtype == GGMLQuantizationType.F16:
        return buf.view("<f2").astype(np.float32)
    if qtype == GGMLQuantizationType.BF16:
        # bf16 is the top half of an f32
        return (buf.view("<u2").astype(np.uint32) << np.uint32(16)).view(np.float32)
    blocks = buf.reshape(-1, _BLOCK_BYTES[qtype])  # [num_blocks, block_bytes]
    scale = _f16_column(blocks, 0)  # [num_blocks, 1]
    if qtype == GGMLQuantizationType.Q8_0:
        q8 = np.ascontiguousarray(blocks[:, 2:]).view(np.int8)  # [num_blocks, 32]
        return scale * q8.astype(np.float32)
    if qtype == GGMLQuantizationType.Q4_0:
        return scale * (_nibbles(blocks[:, 2:]) - np.float32(8))
    assert qtype == GGMLQuantizationType.Q4_1
    minimum = _f16_column(blocks, 2)
    return scale * _nibbles(blocks[:, 4:]) + minimum


def _f16_column(blocks: npt.NDArray[np.uint8], start: int) -> npt.NDArray[np.float32]:
    """The f16 stored at bytes [start, start + 2) of every block, as [num_blocks, 1] float32."""
    return np.ascontiguousarray(blocks[:, start : start + 2]).view("<f2").astype(np.float32)


def _nibbles(packed: npt.NDArray[np.uint8]) -> npt.NDArray[np.float32]:
    """[num_blocks, 16] packed bytes -> [num_blocks, 32]: low nibbles first, then high."""
    low = packed & np.uint8(0x0F)
    high = packed >> np.uint8(4)
    return np.concatenate([low, high], axis=1).astype(np.float32)


def tensor_shape(tensor: ReaderTensor) -> tuple[int, ...]:
    """A GGUF tensor's shape in torch order (GGUF stores ggml's ne[], innermost first)."""
    return tuple(int(d) for d in reversed(tensor.shape.tolist()))


# -- names and metadata ------------------------------------------------------------------------


def hf_tensor_name(gguf_name: str) -> str:
    """Map a llama.cpp tensor name (`blk.3.attn_q.weight`) to its HF Llama name.

    Raises:
        ValueError: a tensor with no HF counterpart here (e.g. `rope_freqs`).
    """
    stem, dot, suffix = gguf_name.rpartition(".")
    if not dot or suffix not in ("weight", "bias"):
        raise ValueError(f"unexpected GGUF tensor name {gguf_name!r}")
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in _LAYER_NAMES:
        return f"model.layers.{int(parts[1])}.{_LAYER_NAMES[parts[2]]}.{suffix}"
    if stem in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[stem]}.{suffix}"
    raise ValueError(f"unsupported GGUF tensor {gguf_name!r}")


def unpermute_rotary(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation for Llama-style rotary embeddings.

    convert_hf_to_gguf.py reorders each head's rows from HF's "rotate half" layout to
    interleaved pairs: head rows [x0..x(d/2-1), y0..y(d/2-1)] become [x0, y0, x1, y1, ...],
    i.e. it views rows as [heads, 2, d/2] and swaps the last two axes. We view them as
    [heads, d/2, 2] and swap back.
    """
    # weight: [num_heads * head_dim, ...]
    rows = weight.shape[0]
    if rows % (2 * num_heads):
        raise ValueError(f"{rows} rows do not split into {num_heads} heads of even size")
    rest = weight.shape[1:]
    split = weight.reshape(num_heads, rows // num_heads // 2, 2, *rest)
    return split.transpose(1, 2).reshape(weight.shape).contiguous()


def _f32(value: Any) -> float:
    """A GGUF f32 as the shortest decimal that round-trips (1e-05, not 9.99999974e-06)."""
    return float(str(np.float32(value)))


def config_dict(reader: GGUFReader) -> dict[str, Any]:
    """A HF `config.json` dict (what `ModelConfig.from_hf` reads) from GGUF metadata.

    Raises:
        ValueError: unsupported architecture or RoPE scaling, or missing metadata.
    """
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"unsupported GGUF architecture {arch!r}; supported: llama")

    def need(key: str) -> Any:
        value = _field(reader, f"{arch}.{key}")
        if value is None:
            raise ValueError(f"GGUF metadata is missing {arch}.{key}")
        return value

    names = {t.name for t in reader.tensors}
    if "rope_freqs.weight" in names:
        raise ValueError("GGUF rope_freqs (Llama 3.1 RoPE scaling) is not supported")
    hidden = int(need("embedding_length"))
    num_heads = int(need("attention.head_count"))
    head_dim = int(_field(reader, f"{arch}.attention.key_length", hidden // num_heads))
    vocab_size = _field(reader, f"{arch}.vocab_size")
    if vocab_size is None:
        tokens = reader.get_field("tokenizer.ggml.tokens")
        if tokens is None:
            raise ValueError("GGUF metadata has neither a vocab size nor a token list")
        vocab_size = len(tokens.data)
    rope_scaling = None
    scaling_type = _field(reader, f"{arch}.rope.scaling.type", "none")
    if scaling_type == "linear":
        rope_scaling = {"rope_type": "linear", "factor": _f32(need("rope.scaling.factor"))}
    elif scaling_type != "none":
        raise ValueError(f"unsupported GGUF rope scaling {scaling_type!r}; supported: linear")
    bos_id = _field(reader, "tokenizer.ggml.bos_token_id")
    eos_id = _field(reader, "tokenizer.ggml.eos_token_id")
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "torch_dtype": "float32",
        "vocab_size": int(vocab_size),
        "hidden_size": hidden,
        "intermediate_size": int(need("feed_forward_length")),
        "num_hidden_layers": int(need("block_count")),
        "num_attention_heads": num_heads,
        "num_key_value_heads": int(_field(reader, f"{arch}.attention.head_count_kv", num_heads)),
        "head_dim": head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": int(need("context_length")),
        "rms_norm_eps": _f32(need("attention.layer_norm_rms_epsilon")),
        "rope_theta": _f32(_field(reader, f"{arch}.rope.freq_base", 10000.0)),
        "rope_scaling": rope_scaling,
        "attention_bias": "blk.0.attn_q.bias" in names,
        "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": None if bos_id is None else int(bos_id),
        "eos_token_id": None if eos_id is None else int(eos_id),
    }


def load_tensors(
    reader: GGUFReader, config: dict[str, Any], dtype: torch.dtype = torch.float32
) -> dict[str, torch.Tensor]:
    """All tensors, dequantized to `dtype`, under HF names with Q/K rows in HF order."""
    out: dict[str, torch.Tensor] = {}
    for tensor in reader.tensors:
        name = hf_tensor_name(tensor.name)
        value = dequantize(tensor.data, tensor.tensor_type, tensor_shape(tensor), torch.float32)
        if ".self_attn.q_proj." in name:
            value = unpermute_rotary(value, config["num_attention_heads"])
        elif ".self_attn.k_proj." in name:
            value = unpermute_rotary(value, config["num_key_value_heads"])
        out[name] = value.to(dtype)
    return out


# -- tokenizer ---------------------------------------------------------------------------------


def convert_gguf(path: str | Path, out_dir: str | Path, dtype: torch.dtype = torch.float32) -> Path:
    """Write the GGUF model at `path` as a HF model directory in `out_dir`; return its path.

    Weights are dequantized to `dtype`. Raises ValueError for unsupported models.
    """
    reader = GGUFReader(str(path))
    config = config_dict(reader)
    config["torch_dtype"] = str(dtype).removeprefix("torch.")
    tok, tok_config = build_tokenizer(reader)
    tok_config["model_max_length"] = config["max_position_embeddings"]
    eos_ids = [
        int(i)
        for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")
        if (i := _field(reader, key)) is not None
    ]
    generation = {"bos_token_id": config["bos_token_id"], "eos_token_id": sorted(set(eos_ids))}
    tensors = load_tensors(reader, config, dtype)

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    _write_text(out / "tokenizer.json", tok.to_str())
    _write_text(out / "tokenizer_config.json", json.dumps(tok_config, indent=2) + "\n")
    _write_text(out / "generation_config.json", json.dumps(generation, indent=2) + "\n")
    tmp = out / "model.safetensors.tmp"
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, out / "model.safetensors")
    # config.json last: its presence marks a complete directory.
    _write_text(out / "config.json", json.dumps(config, indent=2) + "\n")
    return out


def _write_text(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(text.encode("utf-8"))
    os.replace(tmp, path)
