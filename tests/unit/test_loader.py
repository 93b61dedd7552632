"""Loading HF directories: sharded weights, and a clear error for every bad directory."""

from __future__ import annotations

import json
import logging
import shutil
import weakref
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from tandem.model.config import ModelConfig
from tandem.model.llama import ModelWeights
from tandem.weights import loader
from tandem.weights.loader import DTYPES, expected_shapes, load_model


def copy_dir(src: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "model"
    shutil.copytree(src, dst)
    return dst


def test_sharded_checkpoint_loads_the_same_weights(hf_model, tmp_path):
    _, hf = hf_model("llama")
    hf.save_pretrained(tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("model-*.safetensors"))) > 1
    model = load_model(tmp_path)
    ref = hf.model.layers[1].mlp.down_proj.weight
    torch.testing.assert_close(model.weights.layers[1].down, ref.t(), atol=0, rtol=0)


def test_unsupported_architecture(hf_model, tmp_path):
    d = copy_dir(hf_model("llama")[0], tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="unsupported architecture.*GPT2LMHeadModel"):
        load_model(d)


def test_unsupported_rope_scaling(hf_model, tmp_path):
    d = copy_dir(hf_model("llama")[0], tmp_path)
    cfg = json.loads((d / "config.json").read_text())
    cfg["rope_scaling"] = {"rope_type": "longrope", "factor": 4.0}
    cfg.pop("rope_parameters", None)
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="rope_scaling type 'longrope'"):
        load_model(d)
    # YaRN is supported (gpt-oss), with the field it cannot do without
    cfg["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0}
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="original_max_position_embeddings"):
        load_model(d)


def test_missing_directory_and_files(hf_model, tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_model(tmp_path / "nope")
    d = copy_dir(hf_model("llama")[0], tmp_path)
    (d / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_model(d)
    (d / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_model(d)


def test_corrupt_files(hf_model, tmp_path):
    d = copy_dir(hf_model("llama")[0], tmp_path)
    (d / "model.safetensors").write_bytes(b"\x00garbage" * 10)
    with pytest.raises(ValueError, match="not a valid safetensors file"):
        load_model(d)
    (d / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_model(d)


def test_truncated_file(hf_model, tmp_path):
    d = copy_dir(hf_model("llama")[0], tmp_path)
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes(data[:-100])
    with pytest.raises(ValueError, match="not a valid safetensors file.*data_offsets"):
        load_model(d)


@pytest.mark.parametrize("arch", ["llama", "llama3-rope-tied", "qwen2"])
def test_tensors_stream_one_at_a_time(hf_model, monkeypatch, arch):
    """Each tensor is read once, and is garbage before the next one is read: a loader that
    reads every tensor first and fuses afterwards (2x the weights at peak) fails here."""
    model_dir, _ = hf_model(arch)
    reads: list[str] = []
    sources: list[weakref.ref[torch.Tensor]] = []
    real_read = loader.TensorReader.read

    def read(self: loader.TensorReader, name: str) -> torch.Tensor:
        alive = [reads[i] for i, ref in enumerate(sources) if ref() is not None]
        assert not alive, f"reading {name!r} while {alive} are still referenced"
        tensor = real_read(self, name)
        reads.append(name)
        sources.append(weakref.ref(tensor))
        return tensor

    monkeypatch.setattr(loader.TensorReader, "read", read)
    model = load_model(model_dir)
    config = model.config
    assert reads == list(expected_shapes(config))  # once each, in order; tied lm_head never
    assert all(ref() is None for ref in sources)
    w = model.weights
    if config.tie_word_embeddings:
        assert w.lm_head.data_ptr() == w.embed.data_ptr()
    # Every weight owns its storage (the tied lm_head shares the embedding's): none is a view
    # of the reader's buffer, which the next read would overwrite.
    tensors = [w.embed, w.final_norm] + [w.lm_head] * (not config.tie_word_embeddings)
    for lw in w.layers:
        tensors += [lw.input_norm, lw.qkv, lw.qkv_bias, lw.o, lw.post_norm, lw.gate_up, lw.down]
    owned = [t for t in tensors if t is not None]
    assert len({t.untyped_storage().data_ptr() for t in owned}) == len(owned)


def test_progress_and_log_lines(hf_model, caplog):
    model_dir, _ = hf_model("llama")
    calls: list[tuple[int, int]] = []
    with caplog.at_level(logging.INFO, logger="tandem.weights.loader"):
        model = load_model(model_dir, progress=lambda done, total: calls.append((done, total)))
    n = len(expected_shapes(model.config))
    assert calls == [(i, n) for i in range(1, n + 1)]
    start, end, matmuls = [
        r.getMessage() for r in caplog.records if r.name == "tandem.weights.loader"
    ]
    assert matmuls == "matmuls: plain (float32 on cpu)"
    assert start.startswith(f"loading {model_dir}: {n} tensors") and "float32 on cpu" in start
    assert end.startswith(f"loaded {model_dir}: {n} tensors") and end.endswith(" s")


def test_missing_and_misshapen_tensors(hf_model, tmp_path):
    d = copy_dir(hf_model("llama")[0], tmp_path)
    tensors = load_file(d / "model.safetensors")
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, d / "model.safetensors")
    with pytest.raises(ValueError, match="missing tensor 'model.layers.1.mlp.up_proj.weight'"):
        load_model(d)
    tensors["model.layers.1.mlp.up_proj.weight"] = torch.zeros(3, 3)
    save_file(tensors, d / "model.safetensors")
    with pytest.raises(ValueError, match=r"up_proj.weight' has shape \(3, 3\)"):
        load_model(d)


def test_config_parsing_details(hf_model):
    cfg = ModelConfig.from_dir(hf_model("qwen2")[0])
    assert cfg.qkv_bias and not cfg.qk_norm and cfg.architecture == "Qwen2ForCausalLM"
    cfg = ModelConfig.from_dir(hf_model("qwen3")[0])
    assert cfg.qk_norm and cfg.head_dim == 24
    cfg = ModelConfig.from_dir(hf_model("llama3-rope-tied")[0])
    assert cfg.tie_word_embeddings and cfg.rope_scaling is not None
    assert cfg.rope_scaling.rope_type == "llama3" and cfg.rope_theta == 500000.0
    with pytest.raises(ValueError, match="missing required field 'hidden_size'"):
        ModelConfig.from_hf({"architectures": ["LlamaForCausalLM"]})
    with pytest.raises(ValueError, match="hidden_act"):
        ModelConfig.from_hf(
            {
                "architectures": ["LlamaForCausalLM"],
                "hidden_size": 8,
                "num_attention_heads": 2,
                "vocab_size": 4,
                "intermediate_size": 8,
                "num_hidden_layers": 1,
                "hidden_act": "gelu",
            }
        )


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_transposing_on_the_device_loads_the_same_weights(hf_model, monkeypatch, dtype):
    """The GPU's path (copy each matrix to the device in the file's layout, transpose it
    there), forced on the CPU, builds exactly the weights the host transposes build: fused
    column slices, biases, and casts."""
    model_dir, _ = hf_model("qwen2")
    config = ModelConfig.from_dir(Path(model_dir))

    def load() -> ModelWeights:  # as loaded, before the model packs them for its matmul
        return loader.load_weights(Path(model_dir), config, DTYPES[dtype], torch.device("cpu"))

    want = load()
    real_init = loader.WeightBuilder.__init__

    def init(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        real_init(self, *args, **kwargs)
        self.transpose_on_device = True

    monkeypatch.setattr(loader.WeightBuilder, "__init__", init)
    got = load()
    pairs = [(got.embed, want.embed), (got.lm_head, want.lm_head)]
    for g, w in zip(got.layers, want.layers, strict=True):
        pairs += [(g.qkv, w.qkv), (g.qkv_bias, w.qkv_bias), (g.o, w.o)]
        pairs += [(g.gate_up, w.gate_up), (g.down, w.down)]
    for g, w in pairs:
        assert g.dtype == w.dtype and torch.equal(g, w)
