"""Compile a kernel for a real GPU target without a GPU: the interpreter runs programs the
GPU compiler rejects (tl.dot below 16 rows, a dtype mismatch in a loop-carried value)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]


def assert_lowers(script: str, num_ok: int, *args: str) -> None:
    """Run `script` with `args` (it compiles kernel variants, prints "<variant> ok" for each
    and exits 3 when this Triton cannot target CUDA) outside the interpreter."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, "-c", script, *args],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    if result.returncode == 3:
        pytest.skip(f"this Triton cannot compile for CUDA: {result.stdout.strip()}")
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count(" ok") == num_ok


def aligned_attrs(kernel: object, names: list[str]) -> dict[tuple[int, ...], list[list[object]]]:
    """ASTSource attributes saying that arguments `names` are multiples of 16 (pointers: 16
    byte aligned), as a launch with such values specialises them: without them the compiler
    cannot vectorise loads, and so cannot turn them into async copies."""
    arg_names = kernel.arg_names  # type: ignore[attr-defined]
    return {(arg_names.index(n),): [["tt.divisibility", 16]] for n in names}


def ptxas_usage(ptx: str, arch: int = 90) -> tuple[int, int]:
    """(registers per thread, spill store bytes) that Triton's ptxas reports for `ptx`."""
    import re
    import tempfile

    from triton.backends.nvidia.compiler import get_ptxas

    try:
        ptxas = get_ptxas(arch).path  # type: ignore[call-arg]
    except TypeError:  # older Triton: no arch argument
        ptxas = get_ptxas().path  # type: ignore[call-arg]
    with tempfile.NamedTemporaryFile("w", suffix=".ptx") as f:
        f.write(ptx)
        f.flush()
        report = subprocess.run(
            [ptxas, "-v", f"--gpu-name=sm_{arch}a", f.name, "-o", os.devnull],
            capture_output=True,
            text=True,
            check=True,
        ).stderr
    registers = re.search(r"Used (\d+) registers", report)
    spills = re.search(r"(\d+) bytes spill stores", report)
    assert registers and spills, report
    return int(registers.group(1)), int(spills.group(1))


def compile_sm90(
    kernel: object,
    signature: dict[str, str],
    constants: dict[str, object],
    attrs: dict[tuple[int, ...], list[list[object]]] | None = None,
    **options: object,
) -> object:
    """`kernel` compiled for sm_90 (an H100/H200) by Triton's own LLVM and ptxas, no GPU
    needed. For the LOWER scripts `assert_lowers` runs: exits 3 (skip) when this Triton
    cannot target CUDA."""
    try:
        from triton.backends.compiler import GPUTarget
        from triton.compiler import ASTSource, compile
    except ImportError as exc:
        print(exc)
        sys.exit(3)
    try:
        return compile(
            ASTSource(kernel, signature, constants, attrs or {}),
            target=GPUTarget("cuda", 90, 32),
            options=options,
        )
    except RuntimeError as exc:
        if "ptxas" in str(exc).lower():
            print(exc)
            sys.exit(3)
        raise
