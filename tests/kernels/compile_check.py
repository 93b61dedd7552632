"""Compile a kernel for a real GPU target without a GPU: the interpreter runs programs the
GPU compiler rejects (tl.dot below 16 rows, a dtype mismatch in a loop-carried value)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]


def assert_lowers(script: str, num_ok: int) -> None:
    """Run `script` (which compiles kernel variants, prints "<variant> ok" for each and exits
    3 when this Triton cannot target CUDA) outside the interpreter."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, "-c", script],
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
