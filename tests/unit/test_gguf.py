"""GGUF models: dequantization against gguf's own, and a gguf-written tiny model end to end."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as QT
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer as HFTokenizer

from tandem.engine.sampling import SamplingParams
from tandem.model.config import ModelConfig
from tandem.tokenizer.tokenizer import Tokenizer
from tandem.weights.gguf import (
    convert_gguf,
    dequantize,
    hf_tensor_name,
    tensor_shape,
    unpermute_rotary,
)
from tandem.weights.tiny import CHAT_TEMPLATE

GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
TEXTS = (
    "Hello, world! The quick brown fox jumps over the lazy dog.",
    "  leading spaces\tand tabs\n\nnew lines   ",
    "Numbers 1234567 and 3.14159, dates 2025-01-31.",
    "Accents: café, naïve, façade, Ångström, São Paulo, Müller, crème brûlée.",
    "Emoji: 🙂🚀👩‍💻 and flags 🇫🇷 mixed with text 🤖!",
    "def f(x):\n    return {'a': [x ** 2 for x in range(10)]}  # code\n",
    "日本語のテキスト と 中文 and Ελληνικά",
    "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>",
    "don't won't it's I'm we'll they've",
)


# -- dequantization --------------------------------------------------------------------------


@pytest.mark.parametrize("qtype", [QT.F32, QT.F16, QT.BF16, QT.Q8_0, QT.Q4_0, QT.Q4_1])
def test_dequantize_matches_gguf(qtype: QT) -> None:
    rng = np.random.default_rng(int(qtype))
    data = (rng.standard_normal((6, 128)) * rng.uniform(0.01, 10, (6, 1))).astype(np.float32)
    data[0, :32] = 0.0  # an all-zero block (scale 0)
    if qtype == QT.F32:
        packed = data
    elif qtype == QT.F16:
        packed = data.astype(np.float16)
    else:
        packed = gguf.quants.quantize(data, qtype)
    expected = gguf.quants.dequantize(packed, qtype)
    ours = dequantize(packed, qtype, data.shape)
    assert ours.dtype == torch.float32 and ours.shape == data.shape
    assert torch.equal(ours, torch.from_numpy(np.ascontiguousarray(expected, dtype=np.float32)))
    if qtype in (QT.Q8_0, QT.Q4_0, QT.Q4_1):
        # and the quantization is lossy but close, so the test data is not degenerate
        err = (ours - torch.from_numpy(data)).abs().max() / np.abs(data).max()
        assert 0 < err < 0.2
    assert dequantize(packed, qtype, data.shape, torch.bfloat16).dtype == torch.bfloat16


def test_hand_made_blocks() -> None:
    """Layouts pinned by hand, independent of gguf: scale first, low nibbles are elements 0..15."""
    scale = np.array([0.5], dtype="<f2").view(np.uint8)
    q8 = np.arange(-16, 16, dtype=np.int8).view(np.uint8)
    got = dequantize(np.concatenate([scale, q8]), QT.Q8_0, (32,))
    assert got.tolist() == [0.5 * v for v in range(-16, 16)]

    nibbles = np.array([(j % 16) | ((15 - j % 16) << 4) for j in range(16)], dtype=np.uint8)
    got = dequantize(np.concatenate([scale, nibbles]), QT.Q4_0, (32,))
    assert got.tolist() == [0.5 * (v - 8) for v in list(range(16)) + list(range(15, -1, -1))]

    minimum = np.array([-1.0], dtype="<f2").view(np.uint8)
    got = dequantize(np.concatenate([scale, minimum, nibbles]), QT.Q4_1, (32,))
    assert got.tolist() == [0.5 * v - 1 for v in list(range(16)) + list(range(15, -1, -1))]


def test_dequantize_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="needs 34 bytes"):
        dequantize(np.zeros(33, np.uint8), QT.Q8_0, (32,))
    with pytest.raises(ValueError, match="not whole blocks"):
        dequantize(np.zeros(34, np.uint8), QT.Q8_0, (16,))
    with pytest.raises(ValueError, match="unsupported GGUF tensor type Q4_K"):
        dequantize(np.zeros(144, np.uint8), QT.Q4_K, (256,))


def test_quantized_tensor_through_a_file(tmp_path: Path) -> None:
    """Reader shapes (ggml ne[] reversed, rows of bytes) come back in torch order."""
    data = np.random.default_rng(0).standard_normal((3, 64)).astype(np.float32)
    packed = gguf.quants.quantize(data, QT.Q4_1)
    path = tmp_path / "q.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor("t.weight", packed, raw_shape=packed.shape, raw_dtype=QT.Q4_1)
    _finish(writer)
    [tensor] = gguf.GGUFReader(str(path)).tensors
    assert tensor_shape(tensor) == (3, 64)
    got = dequantize(tensor.data, tensor.tensor_type, tensor_shape(tensor))
    assert torch.equal(got, torch.from_numpy(gguf.quants.dequantize(packed, QT.Q4_1)))


# -- names and Q/K permutation ---------------------------------------------------------------


def _llama_cpp_permute(w: torch.Tensor, num_heads: int) -> torch.Tensor:
    """convert_hf_to_gguf.py's `permute`: HF rotate-half rows -> interleaved pairs."""
    return (
        w.reshape(num_heads, 2, w.shape[0] // num_heads // 2, *w.shape[1:])
        .swapaxes(1, 2)
        .reshape(w.shape)
    )


@pytest.mark.parametrize("num_heads", [1, 2, 4])
def test_unpermute_inverts_llama_cpp_permute(num_heads: int) -> None:
    w = torch.arange(8 * 4 * 3, dtype=torch.float32).reshape(8 * 4, 3)
    permuted = _llama_cpp_permute(w, num_heads)
    assert not torch.equal(permuted, w)
    assert torch.equal(unpermute_rotary(permuted, num_heads), w)


def test_tensor_names() -> None:
    assert hf_tensor_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_tensor_name("blk.11.attn_q.weight") == "model.layers.11.self_attn.q_proj.weight"
    assert (
        hf_tensor_name("blk.0.ffn_norm.weight") == "model.layers.0.post_attention_layernorm.weight"
    )
    assert hf_tensor_name("output.weight") == "lm_head.weight"
    with pytest.raises(ValueError, match="rope_freqs"):
        hf_tensor_name("rope_freqs.weight")


# -- a tiny model written with gguf's writer -------------------------------------------------

_GGUF_NAMES = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}


def _gguf_name(hf: str) -> str:
    if hf == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf == "model.norm.weight":
        return "output_norm.weight"
    if hf == "lm_head.weight":
        return "output.weight"
    _, _, layer, rest = hf.split(".", 3)
    module = rest.removesuffix(".weight")
    return f"blk.{layer}.{_GGUF_NAMES[module]}.weight"


def _finish(writer: gguf.GGUFWriter) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _write_gguf(model_dir: Path, path: Path, matrix_type: QT = QT.F16) -> dict[str, torch.Tensor]:
    """Write `model_dir` as llama.cpp would (norms F32, matrices `matrix_type`: F16, or
    Q8_0/Q4_0/Q4_1 for the layer matrices, embeddings F16; Q/K permuted).

    Returns the weights as stored (matrices rounded to f16, or dequantized), in HF layout.
    """
    cfg = json.loads((model_dir / "config.json").read_text())
    tok = json.loads((model_dir / "tokenizer.json").read_text())
    weights = load_file(str(model_dir / "model.safetensors"))
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(cfg["max_position_embeddings"])
    writer.add_embedding_length(cfg["hidden_size"])
    writer.add_block_count(cfg["num_hidden_layers"])
    writer.add_feed_forward_length(cfg["intermediate_size"])
    writer.add_head_count(cfg["num_attention_heads"])
    writer.add_head_count_kv(cfg["num_key_value_heads"])
    writer.add_rope_freq_base(cfg["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    writer.add_vocab_size(cfg["vocab_size"])

    vocab = tok["model"]["vocab"]
    tokens = [""] * cfg["vocab_size"]
    for text, i in vocab.items():
        tokens[i] = text
    types = [1] * len(tokens)
    for added in tok["added_tokens"]:
        tokens[added["id"]] = added["content"]
        types[added["id"]] = 3 if added["special"] else 4
    merges = [m if isinstance(m, str) else " ".join(m) for m in tok["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(cfg["bos_token_id"])
    writer.add_eos_token_id(cfg["eos_token_id"])
    writer.add_add_bos_token(True)
    writer.add_chat_template(CHAT_TEMPLATE)

    stored: dict[str, torch.Tensor] = {}
    for name, w in weights.items():
        if w.ndim == 1:
            stored[name] = w
            array = w.numpy()
        else:
            stored[name] = w.to(torch.float16).to(torch.float32)
            if ".q_proj." in name:
                w = _llama_cpp_permute(w, cfg["num_attention_heads"])
            elif ".k_proj." in name:
                w = _llama_cpp_permute(w, cfg["num_key_value_heads"])
            if matrix_type != QT.F16 and name.startswith("model.layers."):
                packed = gguf.quants.quantize(w.float().numpy(), matrix_type)
                writer.add_tensor(
                    _gguf_name(name), packed, raw_shape=packed.shape, raw_dtype=matrix_type
                )
                back = torch.from_numpy(gguf.quants.dequantize(packed, matrix_type).copy())
                if ".q_proj." in name:
                    back = unpermute_rotary(back, cfg["num_attention_heads"])
                elif ".k_proj." in name:
                    back = unpermute_rotary(back, cfg["num_key_value_heads"])
                stored[name] = back.float()
                continue
            array = w.to(torch.float16).numpy()
        writer.add_tensor(_gguf_name(name), array)
    _finish(writer)
    return stored


@pytest.fixture(scope="module")
def gguf_dirs(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(the tiny model with f16-rounded matrices as safetensors, the same converted from GGUF)."""
    root = tmp_path_factory.mktemp("gguf")
    ref = root / "reference"
    shutil.copytree(tiny_model_dir, ref)
    stored = _write_gguf(tiny_model_dir, root / "tiny.gguf")
    save_file(stored, str(ref / "model.safetensors"), metadata={"format": "pt"})
    converted = convert_gguf(root / "tiny.gguf", root / "converted", torch.float32)
    return ref, converted


def test_converted_weights_and_config_match(gguf_dirs: tuple[Path, Path]) -> None:
    ref, converted = gguf_dirs
    assert ModelConfig.from_dir(converted) == ModelConfig.from_dir(ref)
    want = load_file(str(ref / "model.safetensors"))
    got = load_file(str(converted / "model.safetensors"))
    assert sorted(got) == sorted(want)
    for name in want:
        assert torch.equal(got[name], want[name]), name


def test_greedy_output_identical_to_safetensors(
    gguf_dirs: tuple[Path, Path], engine_factory
) -> None:
    ref, converted = gguf_dirs
    prompts = ["The quick brown fox", "Once upon a time", [5, 6, 7, 8, 9]]
    want = [o.token_ids for o in engine_factory(ref).generate(prompts, GREEDY)]
    got = [o.token_ids for o in engine_factory(converted).generate(prompts, GREEDY)]
    assert got == want
    assert all(len(ids) == GREEDY.max_tokens for ids in got)


def test_tokenizer_from_metadata_matches_hf(gguf_dirs: tuple[Path, Path]) -> None:
    ref, converted = gguf_dirs
    hf_ref = HFTokenizer.from_file(str(ref / "tokenizer.json"))
    hf_got = HFTokenizer.from_file(str(converted / "tokenizer.json"))
    ours_ref, ours_got = Tokenizer.from_dir(ref), Tokenizer.from_dir(converted)
    for text in TEXTS:
        for special in (True, False):
            want = hf_ref.encode(text, add_special_tokens=special).ids
            assert hf_got.encode(text, add_special_tokens=special).ids == want, text
            assert ours_got.encode(text, special) == ours_ref.encode(text, special), text
        ids = hf_ref.encode(text).ids
        assert hf_got.decode(ids, skip_special_tokens=False) == hf_ref.decode(
            ids, skip_special_tokens=False
        )
    assert ours_got.bos_token_id == ours_ref.bos_token_id
    assert ours_got.chat_template == CHAT_TEMPLATE
    messages = [{"role": "user", "content": "Hi there, café 🙂"}]
    assert ours_got.apply_chat_template(messages) == ours_ref.apply_chat_template(messages)


def test_tokenizer_matches_transformers_gguf_loader(gguf_dirs: tuple[Path, Path]) -> None:
    transformers = pytest.importorskip("transformers")
    ref, converted = gguf_dirs
    gguf_path = converted.parent / "tiny.gguf"
    try:
        hf = transformers.AutoTokenizer.from_pretrained(
            str(gguf_path.parent), gguf_file=gguf_path.name
        )
    except Exception as exc:  # noqa: BLE001 - any loader failure means "not comparable"
        pytest.skip(f"transformers cannot load this GGUF tokenizer: {exc}")
    ours = HFTokenizer.from_file(str(converted / "tokenizer.json"))
    for text in TEXTS:
        assert (
            hf(text, add_special_tokens=False)["input_ids"]
            == ours.encode(text, add_special_tokens=False).ids
        ), text
