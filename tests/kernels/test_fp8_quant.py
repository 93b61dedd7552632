"""The fused fp8 activation quantization (tandem.kernels.fp8_quant) against the reference
`quantize_fp8_activations`: the same e4m3 bytes and the same scales, exactly."""

from __future__ import annotations

import pytest
import torch

from tandem.kernels.fp8_quant import quantize_fp8_rows
from tandem.quant.weight import quantize_fp8_activations
from tests.kernels.compile_check import assert_lowers


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1, 64), (3, 1500), (5, 2048)])
def test_matches_the_reference_bit_for_bit(dtype: torch.dtype, shape: tuple[int, int]) -> None:
    torch.manual_seed(0)
    x = (torch.randn(shape, device="cpu") * 3).to(dtype)
    x[0, : shape[1] // 2] = 0.0  # long runs of zeros and a row of mixed magnitudes
    if shape[0] > 2:
        x[1] = 0.0  # an all-zero row: the scale floor
        x[2, 7] = 1e4  # one outlier sets the row's scale: small values round to +-0
        x[2, 8] = -0.0
    q, scales = quantize_fp8_rows(x)
    q_ref, scales_ref = quantize_fp8_activations(x)
    assert scales.shape == scales_ref.shape and q.dtype == torch.float8_e4m3fn
    assert torch.equal(scales, scales_ref)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))


def test_reference_scales_are_the_ieee_quotient() -> None:
    # A division correctly rounded to float32 equals the float64 quotient rounded to float32
    # (53 >= 2 x 24 + 2 bits). torch on CUDA multiplies by the reciprocal of a Python-scalar
    # divisor instead, one bit off at times: the reference divides by a tensor.
    x = torch.randn(64, 512) * torch.logspace(-3, 3, 64).unsqueeze(1)
    _, scales = quantize_fp8_activations(x)
    absmax = x.abs().amax(dim=-1, keepdim=True)
    assert torch.equal(scales, (absmax.double() / 448.0).float())
    # the case the reciprocal gets wrong exists among these rows (else this checks nothing)
    assert not torch.equal(scales, absmax * torch.tensor(1 / 448.0))


def test_strided_rows_and_empty_batch() -> None:
    x = torch.randn(4, 96).to(torch.bfloat16)
    view = x[:, :80]  # rows of a wider buffer
    q, scales = quantize_fp8_rows(view)
    q_ref, scales_ref = quantize_fp8_activations(view)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    assert torch.equal(scales, scales_ref)
    q, scales = quantize_fp8_rows(x[:0])
    assert q.shape == (0, 96) and scales.shape == (0, 1)
    with pytest.raises(ValueError, match="contiguous rows"):
        quantize_fp8_rows(x.t())


LOWER_SCRIPT = """
from tandem.kernels.fp8_quant import _fp8_rows_kernel
from tests.kernels.compile_check import aligned_attrs, compile_sm90, ptxas_usage

for x in ("fp16", "bf16", "fp32"):
    for block, warps in ((1024, 4), (64, 1)):
        types = dict(x_ptr="*" + x, q_ptr="*fp8e4nv", scales_ptr="*fp32")
        constants = dict(EPS=1e-12, FP8_MAX=448.0, BLOCK=block)
        signature = {
            a: "constexpr" if a in constants else types.get(a, "i32")
            for a in _fp8_rows_kernel.arg_names
        }
        names = ["x_ptr", "q_ptr", "stride_x", "stride_q"]
        attrs = aligned_attrs(_fp8_rows_kernel, names)
        compiled = compile_sm90(_fp8_rows_kernel, signature, constants, attrs, num_warps=warps)
        registers, spills = ptxas_usage(compiled.asm["ptx"])
        assert spills == 0, (x, block, registers, spills)
        assert "div.rn.f32" in compiled.asm["ptx"], "an IEEE division"
        print(x, block, registers, "registers ok")
"""


def test_lowers_for_sm90() -> None:
    """Compiles for an H100/H200 without spills and with an IEEE division (the interpreter
    checks neither)."""
    assert_lowers(LOWER_SCRIPT, 6)
