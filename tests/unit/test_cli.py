"""The `tandem` command line, run as a user would: a separate process."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tandem.model.tokenizer import Tokenizer


def tandem(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "services.cli", *args], capture_output=True, text=True, timeout=300
    )


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("cli") / "tiny"
    res = tandem("make-tiny-model", str(out), "--preset", "tiny")
    assert res.returncode == 0, res.stderr
    assert "wrote tiny model (0.1M params)" in res.stdout
    return out


def test_make_tiny_model_writes_a_loadable_directory(model_dir) -> None:
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (model_dir / name).is_file()


def test_generate_prints_text_and_stats(model_dir) -> None:
    res = tandem("generate", "--model", str(model_dir), "--max-tokens", "6", "--ignore-eos", "hi")
    assert res.returncode == 0, res.stderr
    assert "loading weights" in res.stderr  # the progress bar
    assert "[6 tokens in" in res.stderr
    ids = tandem(
        "generate",
        "--model",
        str(model_dir),
        "--max-tokens",
        "6",
        "--ignore-eos",
        "--token-ids",
        "hi",
    )
    token_ids = [int(t) for t in ids.stdout.split()]
    assert len(token_ids) == 6
    assert res.stdout.rstrip("\n") == Tokenizer.from_dir(model_dir).decode(token_ids)


def test_generate_rejects_bad_parameters_with_the_field_name(model_dir) -> None:
    res = tandem("generate", "--model", str(model_dir), "--top-p", "1.5", "hi")
    assert res.returncode == 2
    assert "top_p" in res.stderr


def test_generate_reports_a_missing_model(tmp_path) -> None:
    res = tandem("generate", "--model", str(tmp_path / "missing"), "hi")
    assert res.returncode == 2
    assert "does not exist" in res.stderr


def test_up_sizes_the_kv_cache_for_the_full_context(tiny_model_dir: Path) -> None:
    from services.cli.model import up_kv_cache
    from tandem.config import CacheConfig

    # The tiny model: 2 layers x K,V x 2 KV heads x 16 dims x 4 bytes = 512 bytes per token,
    # context 2048: 1 MiB holds it all, so the engine's default (256 MiB) stands.
    size, line = up_kv_cache(tiny_model_dir, None, "cpu", "auto")
    assert size == CacheConfig().kv_cache_bytes
    assert line == (
        "KV cache: 256 MiB per worker (float32) = 524288 tokens: the model's full context of 2048"
    )
    # Asked for less than a context: the cap is stated, with what would hold it all.
    size, line = up_kv_cache(tiny_model_dir, 512 * 1024, "cpu", "bfloat16")
    assert size == 512 * 1024
    assert line == (
        "KV cache: 512 KiB per worker (bfloat16) = 2048 tokens: the model's full context of 2048"
    )
    size, line = up_kv_cache(tiny_model_dir, 256 * 1024, "cpu", "float32")
    assert line.endswith(
        "= 512 tokens: contexts capped at 512 of the model's 2048 (--kv-cache-bytes 1048576 "
        "holds it all)"
    )
    assert up_kv_cache(tiny_model_dir, None, "cuda", "auto")[1] == (
        "KV cache: sized from the GPU's memory"
    )


def test_up_sizes_a_large_context_above_the_default(tmp_path: Path) -> None:
    """SmolLM2-135M's shape (30 layers, 3 KV heads of 64, context 8192) in fp32: 360 MiB."""
    import json

    from services.cli.model import up_kv_cache

    config = {
        "architectures": ["LlamaForCausalLM"], "vocab_size": 49152, "hidden_size": 576,
        "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
        "num_key_value_heads": 3, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5,
    }  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    size, line = up_kv_cache(tmp_path, None, "cpu", "auto")
    assert size == 8192 * 30 * 2 * 3 * 64 * 4
    assert line.startswith("KV cache: 360 MiB per worker (float32) = 8192 tokens")
