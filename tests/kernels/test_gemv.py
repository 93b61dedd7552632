"""The split-K decode matmul (tandem.kernels.gemv) against x @ w summed in float64, under
Triton's interpreter: ragged sizes (no dimension a multiple of its tile), every split of the
inputs, 1-16 rows; the split choice; the inputs it refuses."""

from __future__ import annotations

import pytest
import torch

from tandem.kernels.gemv import BLOCK_K, MAX_ROWS, choose_split_k, splitk_matmul
from tests.kernels.compile_check import assert_lowers

TOLERANCE = {  # (atol, rtol): the output's rounding and fp32 summation order
    torch.float32: (1e-4, 1e-4),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (2e-2, 2e-2),
}


@pytest.mark.parametrize("dtype", list(TOLERANCE))
@pytest.mark.parametrize("rows", [1, 3, 16])
@pytest.mark.parametrize("split_k", [1, 2, 3, None])
def test_matches_the_float64_product(dtype: torch.dtype, rows: int, split_k: int | None) -> None:
    g = torch.Generator().manual_seed(rows)
    k, n = 300, 70  # 5 K steps of 64 (the last partial), 2 column tiles of 64 (one partial)
    x = torch.randn(rows, k, generator=g).to(dtype)
    w = (torch.randn(k, n, generator=g) * 0.05).to(dtype)
    y = splitk_matmul(x, w, split_k)
    assert y.dtype == dtype and y.shape == (rows, n)
    want = (x.double() @ w.double()).to(dtype)
    atol, rtol = TOLERANCE[dtype]
    torch.testing.assert_close(y, want, atol=atol, rtol=rtol)


def test_a_view_of_a_wider_matrix_and_empty_shapes() -> None:
    """w as a column slice of a wider [in, out] buffer (its row stride is the buffer's)."""
    g = torch.Generator().manual_seed(7)
    wide = torch.randn(256, 96, generator=g)
    x = torch.randn(2, 256, generator=g)
    torch.testing.assert_close(splitk_matmul(x, wide[:, 16:80], 2), x @ wide[:, 16:80])
    assert splitk_matmul(torch.zeros(0, 8), torch.zeros(8, 4)).shape == (0, 4)
    assert torch.equal(splitk_matmul(torch.zeros(2, 0), torch.zeros(0, 4)), torch.zeros(2, 4))


def test_the_split_fills_the_sms_in_powers_of_two() -> None:
    # qkv 4096 -> 6144 on 132 SMs: 96 column tiles, 528 programs wanted -> 4 runs
    assert choose_split_k(6144, 4096, 132) == 4
    # down 14336 -> 4096: 64 tiles -> 8 runs (of 224 K steps)
    assert choose_split_k(4096, 14336, 132) == 8
    # gate_up 4096 -> 28672: 448 tiles fill the SMs alone
    assert choose_split_k(28672, 4096, 132) == 1
    assert choose_split_k(64, BLOCK_K, 132) == 1  # one K step: one run


def test_inputs_it_refuses() -> None:
    with pytest.raises(ValueError, match="at most 16 rows"):
        splitk_matmul(torch.zeros(MAX_ROWS + 1, 8), torch.zeros(8, 4))
    with pytest.raises(ValueError, match="w must be"):
        splitk_matmul(torch.zeros(2, 8), torch.zeros(4, 8).t())  # outputs not contiguous
    with pytest.raises(ValueError, match="w must be"):
        splitk_matmul(torch.zeros(2, 8), torch.zeros(8, 4, dtype=torch.float16))


LOWER_SCRIPT = """
from tandem.kernels.gemv import BLOCK_K, BLOCK_M, BLOCK_N, _splitk_kernel
from tests.kernels.compile_check import aligned_attrs, compile_sm90, ptxas_usage

for x in ("bf16", "fp16"):
    types = dict(x_ptr="*" + x, w_ptr="*" + x, part_ptr="*fp32")
    constants = dict(BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, DOT_FP32=False)
    signature = {
        a: "constexpr" if a in constants else types.get(a, "i32") for a in _splitk_kernel.arg_names
    }
    names = ["x_ptr", "w_ptr", "part_ptr", "stride_xm", "stride_wk", "stride_pk", "stride_pm"]
    attrs = aligned_attrs(_splitk_kernel, names)
    compiled = compile_sm90(_splitk_kernel, signature, constants, attrs, num_warps=4)
    registers, spills = ptxas_usage(compiled.asm["ptx"])
    assert spills == 0, (x, registers, spills)
    print(x, registers, "registers ok")
"""


def test_lowers_for_sm90() -> None:
    assert_lowers(LOWER_SCRIPT, 2)
