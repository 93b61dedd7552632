"""Tests for the deterministic tiny-model generator."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tandem.weights.tiny import (
    BOS_ID,
    EOS_ID,
    EOT_ID,
    PRESETS,
    SPECIAL_TOKENS,
    build_tokenizer_json,
    make_tiny_model,
    num_params,
    weight_shapes,
)

FILES = (
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
)


def _hashes(model_dir: Path) -> dict[str, str]:
    return {
        name: hashlib.sha256((model_dir / name).read_bytes()).hexdigest()
        for name in sorted(os.listdir(model_dir))
    }


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny"), "tiny", seed=0)


def test_writes_expected_files_and_reports_progress(tmp_path: Path) -> None:
    messages: list[str] = []
    out = make_tiny_model(tmp_path / "nested" / "model", progress=messages.append)
    assert out == tmp_path / "nested" / "model"
    assert sorted(os.listdir(out)) == sorted(FILES)  # no leftover .tmp files
    assert any("weights" in m for m in messages)
    assert any("tokenizer" in m for m in messages)


def test_same_seed_is_byte_identical(tiny_dir: Path, tmp_path: Path) -> None:
    again = make_tiny_model(tmp_path, "tiny", seed=0)
    assert _hashes(again) == _hashes(tiny_dir)
    assert set(_hashes(again)) == set(FILES)


def test_different_seed_changes_only_weights(tiny_dir: Path, tmp_path: Path) -> None:
    other = _hashes(make_tiny_model(tmp_path, "tiny", seed=1))
    base = _hashes(tiny_dir)
    assert other["model.safetensors"] != base["model.safetensors"]
    for name in FILES:
        if name != "model.safetensors":
            assert other[name] == base[name], name


def test_identical_across_processes(tiny_dir: Path, tmp_path: Path) -> None:
    # A fresh interpreter with another hash seed must produce the same bytes (tokenizer
    # training and weight init must not depend on dict/set order or process state).
    code = (
        "import sys; from tandem.weights.tiny import make_tiny_model; make_tiny_model(sys.argv[1])"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    subprocess.run([sys.executable, "-c", code, str(tmp_path)], check=True, env=env)
    assert _hashes(tmp_path) == _hashes(tiny_dir)


def test_config_matches_preset(tiny_dir: Path) -> None:
    preset = PRESETS["tiny"]
    cfg = json.loads((tiny_dir / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert cfg["model_type"] == "llama"
    assert cfg["torch_dtype"] == "float32"
    assert cfg["vocab_size"] == preset.vocab_size == 512
    assert cfg["hidden_size"] == 64
    assert cfg["intermediate_size"] == 128
    assert cfg["num_hidden_layers"] == 2
    assert cfg["num_attention_heads"] == 4
    assert cfg["num_key_value_heads"] == 2
    assert cfg["head_dim"] == 16
    assert cfg["max_position_embeddings"] == 2048
    assert cfg["tie_word_embeddings"] is False
    assert (cfg["bos_token_id"], cfg["eos_token_id"]) == (BOS_ID, EOS_ID)
    gen = json.loads((tiny_dir / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [EOS_ID, EOT_ID]


def test_weights_have_hf_names_shapes_and_spread(tiny_dir: Path) -> None:
    tensors = load_file(str(tiny_dir / "model.safetensors"))
    expected = weight_shapes("tiny")
    assert {k: tuple(v.shape) for k, v in tensors.items()} == expected
    assert "lm_head.weight" in tensors
    assert "model.layers.1.self_attn.k_proj.weight" in tensors
    assert all(t.dtype == torch.float32 for t in tensors.values())
    assert sum(t.numel() for t in tensors.values()) == num_params("tiny")
    norm = tensors["model.layers.0.input_layernorm.weight"]
    assert 0.9 < norm.mean().item() < 1.1
    assert norm.std().item() > 0.01  # not all exactly one
    assert tensors["model.embed_tokens.weight"].std().item() > 0.5


def test_transformers_loads_model(tiny_dir: Path) -> None:
    transformers = pytest.importorskip("transformers")
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_dir)
    assert type(model).__name__ == "LlamaForCausalLM"
    assert model.dtype == torch.float32
    assert sum(p.numel() for p in model.parameters()) == num_params("tiny")
    tensors = load_file(str(tiny_dir / "model.safetensors"))
    state = model.state_dict()
    for name, tensor in tensors.items():
        assert torch.equal(state[name], tensor), name
    ids = torch.tensor([[BOS_ID, 40, 41, 300, 301, 302, 17]])
    with torch.no_grad():
        logits = model(ids).logits[0]
    assert logits.shape == (7, 512)
    assert torch.isfinite(logits).all()
    # Clear margins between tokens: greedy comparisons with other implementations are stable.
    assert logits.std(dim=-1).min().item() > 2.0
    # Attention matters: changing an early token changes the last position's logits.
    other = ids.clone()
    other[0, 1] = 200
    with torch.no_grad():
        changed = model(other).logits[0, -1]
    assert (changed - logits[-1]).abs().max().item() > 0.1


def test_tokenizer_vocab_fills_preset_exactly() -> None:
    from tokenizers import Tokenizer as HFTokenizer

    for vocab_size in (512, 8192):
        tok = HFTokenizer.from_str(build_tokenizer_json(vocab_size))
        assert tok.get_vocab_size(with_added_tokens=True) == vocab_size
        for idx, token in enumerate(SPECIAL_TOKENS):
            assert tok.token_to_id(token) == idx
    # The 8k vocabulary is all trained merges, not filler tokens.
    small = build_tokenizer_json(8192)
    assert "reserved_special_token" not in small
    encoding = HFTokenizer.from_str(small).encode("the people said", add_special_tokens=False)
    assert len(encoding.ids) == 3


def test_num_params() -> None:
    assert num_params("tiny") == 139_584
    small = PRESETS["small"]
    h, kv = small.hidden_size, small.num_key_value_heads * small.head_dim
    per_layer = 2 * h * h + 2 * kv * h + 3 * h * small.intermediate_size + 2 * h
    expected = small.num_hidden_layers * per_layer + 2 * small.vocab_size * h + h
    assert num_params("small") == expected == 46_150_144
    assert 45_000_000 <= num_params("small") <= 60_000_000
    tied = replace(PRESETS["tiny"], tie_word_embeddings=True)
    assert num_params(tied) == num_params("tiny") - 512 * 64
    assert "lm_head.weight" not in weight_shapes(tied)


def test_tied_preset_loads_in_transformers(tmp_path: Path) -> None:
    transformers = pytest.importorskip("transformers")
    tied = replace(PRESETS["tiny"], tie_word_embeddings=True)
    make_tiny_model(tmp_path, tied)
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path)
    assert torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)


def test_bad_presets_raise() -> None:
    with pytest.raises(ValueError, match="unknown tiny-model preset 'huge'"):
        num_params("huge")
    base = PRESETS["tiny"]
    with pytest.raises(ValueError, match="num_key_value_heads"):
        replace(base, num_key_value_heads=3)
    with pytest.raises(ValueError, match="hidden_size"):
        replace(base, hidden_size=66)
    with pytest.raises(ValueError, match="vocab_size"):
        replace(base, vocab_size=100)
    with pytest.raises(ValueError, match="num_hidden_layers"):
        replace(base, num_hidden_layers=0)
