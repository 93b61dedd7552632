"""Kernel arguments whose values follow the batch are not specialised on: Triton compiles a
variant per value class of an integer argument (1, a multiple of 16, other), so a block
table width or split count that warm-up did not hit would compile (1-3 s) mid-serving."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.kernels.compile_check import REPO_ROOT

# Outside the interpreter, which replaces triton.jit and keeps no parameters.
SCRIPT = r"""
from tandem.kernels.decode_attention import _decode_reduce_kernel, _decode_split_kernel
from tandem.kernels.prefill_attention import _prefill_kernel
from tandem.kernels.quant_matmul import _int4_matmul_kernel, _scaled_matmul_kernel

kernels = (_decode_split_kernel, _decode_reduce_kernel, _prefill_kernel)
for kernel in (*kernels, _scaled_matmul_kernel, _int4_matmul_kernel):
    flags = [p.name for p in kernel.params if p.do_not_specialize]
    print(kernel.fn.__name__, *flags)
"""


def test_batch_dependent_arguments_are_not_specialised() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        "_decode_split_kernel stride_bt_req",
        "_decode_reduce_kernel num_splits",
        "_prefill_kernel stride_t_req",
        "_scaled_matmul_kernel num_rows",
        "_int4_matmul_kernel num_rows",
    ]
