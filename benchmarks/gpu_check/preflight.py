"""Part 0, preflight: what the Triton backend needs before anything else runs, recorded in
the JSON: a C compiler and `Python.h` (Triton compiles a small C launcher at the first kernel
launch), the NVIDIA driver and torch's CUDA version, and one tiny Triton kernel launched on
the device. If that launch fails, the later parts run with the torch attention backend
(`Context.attention_backend`), so a session still yields figures; this part then fails.
On `--cpu` the kernel runs under Triton's interpreter, which compiles no launcher: the
compiler and header checks are still recorded."""

from __future__ import annotations

import os
import shutil
import sysconfig
from pathlib import Path

import torch

from .common import Context, Figures, PartFailed, _run


def _launch_one_kernel(device: str) -> None:
    """x + 1 over 16 elements by a @triton.jit kernel, checked against torch."""
    import triton
    import triton.language as tl

    @triton.jit
    def add_one(x_ptr, out_ptr, n, BLOCK: tl.constexpr):  # type: ignore[no-untyped-def]
        # x_ptr, out_ptr: [n] float32; one program of BLOCK lanes
        offs = tl.arange(0, BLOCK)
        mask = offs < n
        tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=mask) + 1.0, mask=mask)

    x = torch.arange(16, dtype=torch.float32, device=device)
    out = torch.empty_like(x)
    add_one[(1,)](x, out, x.numel(), BLOCK=16)
    torch.testing.assert_close(out, x + 1)


def check_preflight(ctx: Context) -> Figures:
    from tandem.gpus import driver_version

    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    version = _run([compiler, "--version"]) if compiler else None
    python_h = Path(sysconfig.get_paths()["include"]) / "Python.h"
    figures: Figures = {
        "c_compiler": compiler,
        "c_compiler_version": version.splitlines()[0] if version else None,
        "python_h": str(python_h) if python_h.exists() else None,
        "nvidia_driver": driver_version(),
        "torch_cuda": torch.version.cuda,
        "triton_interpreter": os.environ.get("TRITON_INTERPRET") == "1",
    }
    try:
        _launch_one_kernel(ctx.device)
        figures["triton_launch"] = "ok"
    except Exception as exc:  # a missing compiler or header, no driver, a compile error
        figures["triton_launch"] = f"{type(exc).__name__}: {str(exc)[:2000]}"
    figures["attention_backend_for_later_parts"] = ctx.attention_backend
    if figures["triton_launch"] != "ok":
        ctx.attention_backend = "torch"
        figures["attention_backend_for_later_parts"] = "torch"
        missing = [
            what for what, found in (("a C compiler", compiler), ("Python.h", figures["python_h"]))
            if not found
        ]  # fmt: skip
        hint = f" (missing: {', '.join(missing)})" if missing else ""
        raise PartFailed(
            f"Triton cannot launch a kernel{hint}; later parts use the torch attention backend",
            figures,
        )
    return figures
