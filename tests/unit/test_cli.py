"""The `tandem` command line, run as a user would: a separate process."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tandem.model.tokenizer import Tokenizer


def tandem(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "tandem.cli", *args], capture_output=True, text=True, timeout=300
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
