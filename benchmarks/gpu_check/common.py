"""What every part uses: the run's `Context` and `Log`, the part outcomes `PartSkipped` and
`PartFailed`, the `environment()` record, timing (`median_time_s`, `copy_bandwidth`), and
small engine, device and directory helpers."""

from __future__ import annotations

import contextlib
import functools
import gc
import hashlib
import importlib.metadata
import json
import logging
import math
import os
import platform
import shutil
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import torch

from .sizes import Sizes

REPO_ROOT = Path(__file__).resolve().parents[2]

Figures = dict[str, Any]


class PartSkipped(Exception):
    """The part cannot run here (a missing optional package); not a failure."""


class PartFailed(Exception):
    """The part ran and a check failed; `figures` holds what it measured."""

    def __init__(self, reason: str, figures: Figures) -> None:
        super().__init__(reason)
        self.figures = figures


class Log:
    """Timestamped progress lines on stdout (flushed) and in the log file."""

    def __init__(self, path: Path) -> None:
        self.t0 = time.perf_counter()
        self.file = path.open("a", encoding="utf-8")

    def __call__(self, msg: str) -> None:
        stamp = f"{datetime.now().strftime('%H:%M:%S')} +{time.perf_counter() - self.t0:6.1f}s"
        for line in msg.splitlines() or [""]:
            text = f"[{stamp}] {line}"
            print(text, flush=True)
            self.file.write(text + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()


class LogHandler(logging.Handler):
    """Forwards the library's log records (weight loading, KV cache size) into `Log`."""

    def __init__(self, log: Log) -> None:
        super().__init__(logging.INFO)
        self.log = log

    def emit(self, record: logging.LogRecord) -> None:
        self.log(f"  [{record.name}] {record.getMessage()}")


@dataclass(slots=True)
class Context:
    sizes: Sizes
    log: Log
    tmp_dir: Path
    deadline: float = math.inf  # of the running part (time.monotonic)
    parts: tuple[str, ...] = ()  # the parts selected for this run
    # The engines' attention backend: "auto" (Triton on CUDA), or "torch" once the preflight
    # found that Triton cannot launch a kernel here.
    attention_backend: str = "auto"
    # The records of the parts run so far (status, figures), by name: a later part may cite
    # an earlier one's figures (e2e reports throughput's ratio).
    results: dict[str, Figures] = field(default_factory=dict)
    # What a part leaves for a later one instead of rebuilding it (the Llama-3-8B-shaped
    # weights directory); the taker removes it.
    shared: dict[str, Any] = field(default_factory=dict)

    @property
    def device(self) -> str:
        return self.sizes.device

    @property
    def cuda(self) -> bool:
        return self.sizes.device.startswith("cuda")

    def left_s(self) -> float:
        return self.deadline - time.monotonic()


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _run(cmd: Sequence[str], timeout_s: float = 10) -> str | None:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip()


def environment(device: str) -> Figures:
    """Versions, device, driver and clocks (where readable), git commit."""
    env: Figures = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "torch_threads": torch.get_num_threads(),
        "cuda_available": torch.cuda.is_available(),
    }
    for dist in ("transformers", "safetensors", "numpy", "nixl", "nixl-cu13", "grpcio", "protobuf"):
        env[dist] = _version(dist)
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    if device.startswith("cuda") and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env["device_name"] = props.name
        env["device_memory_gib"] = round(props.total_memory / 2**30, 1)
        env["compute_capability"] = f"{props.major}.{props.minor}"
        fields = "driver_version,clocks.sm,clocks.max.sm,clocks.mem,power.limit,temperature.gpu"
        smi = _run(["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader"])
        if smi:
            values = [v.strip() for v in smi.splitlines()[0].split(",")]
            env["nvidia_smi"] = dict(zip(fields.split(","), values, strict=False))
    else:
        env["device_name"] = "cpu"
    env["tree"] = tree_record()
    return env


# The tree's identity where it runs without its .git (the device machine gets a copy of the
# working tree only): `scripts/gpu-check --stamp` writes it beside the tree before the copy.
STAMP = REPO_ROOT / ".gpu-check-tree.json"


def tree_files() -> list[str] | None:
    """The tree's files as the device copy takes them: tracked, and untracked not ignored
    (None without git)."""
    out = _run(["git", "-C", str(REPO_ROOT), "ls-files", "-co", "--exclude-standard"])
    if out is None:
        return None
    return sorted(f for f in out.splitlines() if f and f != STAMP.name)


def tree_digest(files: Sequence[str]) -> str:
    """sha256 over each file's path and bytes, in order (a missing file counts as such)."""
    h = hashlib.sha256()
    for name in files:
        path = REPO_ROOT / name
        h.update(name.encode() + b"\0")
        h.update(path.read_bytes() if path.is_file() else b"<missing>")
        h.update(b"\0")
    return h.hexdigest()


def tree_stamp(files: list[str] | None = None) -> Figures:
    """The commit, a hash of the uncommitted changes (`git diff HEAD` plus the untracked
    files' contents) and the tree digest with its file list (`files`: `tree_files()`, listed
    here when not given): what `--stamp` writes."""
    files = tree_files() if files is None else files
    if files is None:
        raise RuntimeError("git cannot list the tree: --stamp runs in a checkout")
    commit = _run(["git", "-C", str(REPO_ROOT), "rev-parse", "HEAD"])
    diff = _run(["git", "-C", str(REPO_ROOT), "diff", "HEAD", "--binary"]) or ""
    untracked = _run(["git", "-C", str(REPO_ROOT), "ls-files", "-o", "--exclude-standard"]) or ""
    untracked_files = sorted(f for f in untracked.splitlines() if f and f != STAMP.name)
    changes = hashlib.sha256(diff.encode())
    changes.update(tree_digest(untracked_files).encode())
    dirty = bool(diff) or bool(untracked_files)
    return {
        "git_commit": commit,
        "git_dirty": dirty,
        "uncommitted_sha256": changes.hexdigest() if dirty else None,
        "tree_sha256": tree_digest(files),
        "files": files,
    }


def tree_record() -> Figures:
    """Which tree this run measured: from git where the checkout has it, else from the
    stamp, with the digest recomputed over the stamp's files (`matches_stamp`: the copy
    is the stamped tree, unchanged)."""
    files = tree_files()
    if files is not None:
        stamp = tree_stamp(files)
        stamp.pop("files")
        return {**stamp, "source": "git"}
    if not STAMP.is_file():
        return {"source": None, "note": "no git and no stamp (scripts/gpu-check --stamp)"}
    stamp = json.loads(STAMP.read_text())
    files = stamp.pop("files")
    return {**stamp, "source": "stamp", "matches_stamp": tree_digest(files) == stamp["tree_sha256"]}


def make_engine(model_dir: Path, device: str, dtype: str, **overrides: Any) -> Any:
    """An engine with an explicit block count (no memory profiling), prefix caching on.

    overrides: block_size, num_blocks; attention_backend, cuda_graphs, quantization,
    kv_cache_dtype (EngineConfig); the rest go to SchedulerConfig (max_num_batched_tokens,
    max_num_seqs, max_model_len).
    """
    from tandem.config import CacheConfig, EngineConfig, SchedulerConfig
    from tandem.engine.engine import LLMEngine

    cache = CacheConfig(
        block_size=overrides.pop("block_size"), num_blocks=overrides.pop("num_blocks", 512)
    )
    engine_keys = ("attention_backend", "cuda_graphs", "quantization", "kv_cache_dtype")
    engine_fields = {key: overrides.pop(key) for key in engine_keys if key in overrides}
    scheduler = SchedulerConfig(**overrides)
    return LLMEngine(
        EngineConfig(
            model_dir=str(model_dir),
            dtype=dtype,
            device=device,
            cache=cache,
            scheduler=scheduler,
            **engine_fields,
        )
    )


def sampling_params(**kwargs: Any) -> Any:
    from tandem.engine.sampling import SamplingParams

    return SamplingParams(**kwargs)


def median_time_s(
    fn: Callable[[], object],
    device: str,
    *,
    reps: int,
    warmup: int = 2,
    flush: torch.Tensor | None = None,
) -> float:
    """Median seconds of one call of `fn`, after `warmup` untimed calls.

    On CUDA each call sits between two CUDA events (device time, not launch time). With
    `flush` (a buffer larger than the L2 cache), zeroing it before each call evicts what
    the previous call left in L2, so a small working set is read from memory as in a real
    step; the zeroing also queues enough device work to hide the call's launch overhead.
    On a CPU: wall clock per call.
    """
    for _ in range(warmup):
        fn()
    sync(device)
    if not device.startswith("cuda"):
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)
    events = [
        (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        for _ in range(reps)
    ]
    for start, end in events:
        if flush is not None:
            flush.zero_()
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) / 1e3 for start, end in events)


def copy_bandwidth(device: str, num_bytes: int, reps: int) -> Figures:
    """Device-to-device copy bandwidth: bytes read + written by `dst.copy_(src)` of
    `num_bytes` each, over the median time (the roofline of bandwidth-bound kernels). The
    buffers are freed on return (`free_memory` returns them to the device)."""
    src = torch.empty(num_bytes // 2, dtype=torch.bfloat16, device=device).normal_()
    seconds = median_time_s(functools.partial(torch.empty_like(src).copy_, src), device, reps=reps)
    moved = 2 * num_bytes
    return {
        "bytes_read_plus_written": moved,
        "median_s": seconds,
        "gb_s": round(moved / seconds / 1e9, 1),
    }


def free_memory(device: str) -> None:
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


@contextlib.contextmanager
def make_tmp_dir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="gpu-check-"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
