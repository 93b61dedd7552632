"""A native CPU paged decode attention: reads each row's K/V blocks where they lie in the
cache (no gather into a workspace), one query per row, every query head of a KV head
against the same keys, in float32 with one rounding of the output.

torch's ops cost ~15 small operations per layer for a decode group (gathers, two batched
matmuls, a softmax, casts), which at SmolLM2's size is a quarter of a batch-16 decode step
on two cores. This kernel is plain C (`kernels/cpu_ops.c`), compiled once per machine with
the system's C compiler (`cc -O3 -march=native`, about a second) into
~/.cache/tandem/kernels/ and called through ctypes with the tensors' data pointers. Without
a compiler (a slim image) the caller keeps the torch path: `load()` returns None and says
why once. On a CPU with AVX512-BF16 a bfloat16 cache takes VDPBF16PS products for the scores
(16 keys per tile) and register-held value accumulators, block by block with the K and V of
the blocks ahead prefetched (a row's blocks lie anywhere in a cache far bigger than L3).
Over an engine-shaped cache, 30 layers of 16 rows x ~300 keys: 19 ms against the plain
loops' 25 ms (1 row: 1.2 vs 1.75 ms), the core's read bandwidth at the time (BENCHMARKS.md,
issue 24).

Layout it reads (TorchAttention's cache layer, any strides):
  k, v   [num_blocks, block_size, num_kv_heads, head_dim], head_dim contiguous
  q      [rows, num_q_heads, head_dim], head_dim contiguous
  tables [rows, >= ceil(context_len / block_size)] int64; context_lens [rows] int64
  out    [rows, num_q_heads, head_dim] contiguous, the cache's dtype (float32 or bfloat16)

    key t of row r  at  k + tables[r, t / block_size] * s_block + (t % block_size) * s_tok
                          + kv_head * s_head
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

log = logging.getLogger(__name__)

# The C source (its header says how each kernel walks the cache); read at load.
_SOURCE_PATH = Path(__file__).with_name("cpu_ops.c")

# -O3 with -ffast-math lets the compiler vectorize the dot products and sums (reassociated,
# so not the order torch sums in; the same binary gives the same numbers every call, and each
# row's result depends on that row alone).
_FLAGS = (
    "-O3", "-march=native", "-mprefer-vector-width=512", "-ffast-math", "-fno-finite-math-only",
    "-shared", "-fPIC",
)  # fmt: skip


def _cache_dir() -> Path:
    return Path.home() / ".cache" / "tandem" / "kernels"


def _compile(compiler: str, path: Path) -> None:
    """Build the library into `path`, atomically (processes may race to build it)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        built = Path(tmp) / path.name
        subprocess.run(
            [compiler, *_FLAGS, "-o", str(built), str(_SOURCE_PATH), "-lm"],
            check=True,
            capture_output=True,
            timeout=120,
        )
        os.replace(built, path)


def _cpu_identity() -> str:
    """The CPU's model and feature flags (Linux), what -march=native compiles for."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.machine() + platform.processor()
    wanted = ("model name", "flags", "Features", "CPU part")
    return platform.machine() + "".join(
        sorted({line for line in lines if line.split(":")[0].strip() in wanted})
    )


@functools.cache
def load() -> ctypes.CDLL | None:
    """The compiled kernels (built on first use, once per process), or None when no C
    compiler is here or the build failed (logged; the caller keeps its torch path). Two
    processes building at once are safe: the library lands by an atomic rename."""
    lib: ctypes.CDLL | None = None
    compiler = shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        log.info("CPU decode attention: torch ops (no C compiler found)")
    else:
        # -march=native: a library built on another CPU (a shared home) must not load.
        key = hashlib.sha256(
            (_SOURCE_PATH.read_text() + " ".join(_FLAGS) + compiler + _cpu_identity()).encode()
        ).hexdigest()
        path = _cache_dir() / f"decode_attention-{key[:16]}.so"
        try:
            if not path.exists():
                _compile(compiler, path)
            lib = ctypes.CDLL(str(path))
            fn = lib.tandem_decode_attention
            fn.restype = ctypes.c_int
            fn.argtypes = [
                ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                ctypes.c_void_p, ctypes.c_void_p,
                ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                ctypes.c_int64, ctypes.c_float, ctypes.c_void_p, ctypes.c_int,
                ctypes.c_int, ctypes.c_int64, ctypes.c_void_p,
            ]  # fmt: skip
            lib.tandem_has_bf16_dot.restype = ctypes.c_int
            lib.tandem_has_bf16_dot.argtypes = []
            norm = lib.tandem_add_rms_norm_bf16
            norm.restype = None
            norm.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64, ctypes.c_int64, ctypes.c_float]
            rope = lib.tandem_rope_bf16
            rope.restype = None
            rope.argtypes = [
                ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64,
                ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
            ]  # fmt: skip
            log.info("CPU decode attention: native paged kernel (%s)", path)
        except (OSError, subprocess.SubprocessError) as exc:
            detail = getattr(exc, "stderr", b"") or b""
            log.warning(
                "CPU decode attention: torch ops (building the native kernel failed: %s %s)",
                exc, detail.decode(errors="replace")[:500],
            )  # fmt: skip
            lib = None
    return lib


SUPPORTED_DTYPES = (torch.bfloat16, torch.float32)
MAX_HEAD_DIM = 256


def has_bf16_dot(lib: ctypes.CDLL) -> bool:
    """Does this build take bfloat16 decode attention through AVX512-BF16 products?"""
    return bool(lib.tandem_has_bf16_dot())


def supports(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Can the kernel take these tensors (dtypes, sizes, unit inner strides)?"""
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    return (
        q.device.type == "cpu"
        and k_cache.dtype in SUPPORTED_DTYPES
        and q.dtype == k_cache.dtype
        and head_dim <= MAX_HEAD_DIM
        and q.shape[1] % num_kv_heads == 0
        and q.stride(2) == 1
        and k_cache.stride(3) == 1
    )


def decode_attention(
    lib: ctypes.CDLL,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    *,
    vector: bool = True,
    out: torch.Tensor | None = None,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """One query per row over its paged context. `vector=False` keeps the plain loops even
    where the library has the AVX512-BF16 products (`has_bf16_dot`): tests compare the two.
    `window`: a sliding layer's, only each row's last `window` keys (the blocks before them
    are not read); `sinks`: [num_q_heads] float32 logits joining each head's denominator.

    Args:
        q: [rows, num_q_heads, head_dim]
        k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim], same strides.
        block_tables: [rows, max_blocks] int64; context_lens: [rows] int64, each in
            [1, max_blocks * block_size].
        out: where to write the result (contiguous, q's shape, the cache's dtype), e.g. the
            layer's output rows, saving a copy; a new tensor when None.

    Returns:
        [rows, num_q_heads, head_dim] in the cache's dtype (`out` when given).
    """
    rows, num_q_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    if k_cache.stride() != v_cache.stride():
        raise ValueError("k_cache and v_cache must have the same strides")
    tables = block_tables.contiguous()
    lens = context_lens.contiguous()
    if tables.dtype != torch.int64 or lens.dtype != torch.int64:
        raise ValueError("block_tables and context_lens must be int64")
    sink_rows = None if sinks is None else sinks.to(torch.float32).contiguous()
    if sink_rows is not None and sink_rows.shape != (num_q_heads,):
        raise ValueError(f"sinks must be [{num_q_heads}], got {tuple(sink_rows.shape)}")
    if out is None:
        out = torch.empty((rows, num_q_heads, head_dim), dtype=k_cache.dtype, device="cpu")
    elif out.shape != q.shape or out.dtype != k_cache.dtype or not out.is_contiguous():
        raise ValueError(f"out must be contiguous {tuple(q.shape)} {k_cache.dtype}")
    status = lib.tandem_decode_attention(
        q.data_ptr(), q.stride(0), q.stride(1),
        k_cache.data_ptr(), v_cache.data_ptr(),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        tables.data_ptr(), tables.stride(0), tables.shape[1], lens.data_ptr(),
        rows, num_q_heads, num_kv_heads, head_dim, block_size, scale,
        out.data_ptr(), int(k_cache.dtype == torch.bfloat16), int(vector), window or 0,
        None if sink_rows is None else sink_rows.data_ptr(),
    )  # fmt: skip
    if status == -1:
        raise ValueError(f"native decode attention refused head_dim {head_dim}")
    if status == -2:
        raise ValueError(
            f"context lengths {lens.tolist()} must lie in [1, {tables.shape[1]} blocks of "
            f"{block_size}]"
        )
    if status != 0:
        raise MemoryError("native decode attention could not allocate its scratch")
    return out


def add_rms_norm(
    lib: ctypes.CDLL,
    h: torch.Tensor,
    y: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
) -> torch.Tensor:
    """bfloat16 only: `h += y` in place (when y is given), then RMSNorm of h times `weight`
    in transformers' order. h, y: [rows, dim] contiguous; weight: [dim]. Returns [rows, dim]."""
    if h.dtype != torch.bfloat16 or not h.is_contiguous() or h.dim() != 2:
        raise ValueError(f"h must be a contiguous 2-d bfloat16 tensor, got {h.dtype} {h.shape}")
    if y is not None and (y.shape != h.shape or y.dtype != h.dtype or not y.is_contiguous()):
        raise ValueError(f"y must match h {tuple(h.shape)}, got {y.dtype} {tuple(y.shape)}")
    w = weight.contiguous()
    out = torch.empty_like(h)
    lib.tandem_add_rms_norm_bf16(
        h.data_ptr(), None if y is None else y.data_ptr(), w.data_ptr(), out.data_ptr(),
        h.shape[0], h.shape[1], eps,
    )  # fmt: skip
    return out


def rope(lib: ctypes.CDLL, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """bfloat16 only: `tandem.model.rope.apply_rotary` in one call (the same roundings).
    x: [rows, heads, dim], dim contiguous; cos, sin: [rows, 1, dim] or [rows, dim]."""
    rows, heads, dim = x.shape
    if x.dtype != torch.bfloat16 or x.stride(2) != 1 or dim % 2:
        raise ValueError(f"x must be bfloat16 [rows, heads, even dim], got {x.dtype} {x.shape}")
    c, s = cos.reshape(rows, dim).contiguous(), sin.reshape(rows, dim).contiguous()
    if c.dtype != torch.bfloat16 or s.dtype != torch.bfloat16:
        raise ValueError(f"cos and sin must be bfloat16, got {c.dtype}, {s.dtype}")
    out = torch.empty((rows, heads, dim), dtype=x.dtype, device="cpu")
    lib.tandem_rope_bf16(
        x.data_ptr(), x.stride(0), x.stride(1), c.data_ptr(), s.data_ptr(), out.data_ptr(),
        rows, heads, dim,
    )  # fmt: skip
    return out
