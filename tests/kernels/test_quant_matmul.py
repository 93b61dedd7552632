"""The dequant-GEMM kernels against `tandem.kernels.reference`'s int4/scaled matmul references, and
those references against the in-memory format's own `QuantizedWeight.dequantize`.

On a machine without a GPU the kernels run under Triton's interpreter (tests/conftest.py), so
shapes stay small: rows 1, 3, 17 (decode and prefill tiles), in/out features that are not
multiples of the tiles. The reference rounds dequantized weights to x's dtype as the kernel
does and sums in float64; the kernel sums in fp32 and rounds its output once.
"""

from __future__ import annotations

import pytest
import torch

from tandem.kernels.quant_matmul import int4_matmul, quantized_linear, scaled_matmul
from tandem.kernels.reference import (
    int4_dequantize_reference,
    int4_matmul_reference,
    scaled_matmul_reference,
)
from tandem.quant.weight import (
    QuantizedWeight,
    WeightScheme,
    fp8_reference_matmul,
    quantize_fp8,
    quantize_int8,
)
from tests.kernels.compile_check import assert_lowers

TOLERANCES = {  # (atol, rtol): output rounding plus fp32 summation order
    torch.float32: (1e-4, 1e-4),
    torch.float16: (2e-3, 2e-3),
    # Triton's interpreter rounds fp32 -> bf16 toward zero (a GPU to nearest): int4 weights
    # may then sit one bf16 ulp from the reference's.
    torch.bfloat16: (4e-2, 2e-2),
}
ROWS = (1, 3, 17)


def random_int4(
    gen: torch.Generator,
    out: int,
    inp: int,
    group: int,
    zeros: str,
    act_order: bool,
) -> QuantizedWeight:
    groups = inp // group
    q = torch.randint(0, 256, (out, inp // 2), generator=gen, dtype=torch.uint8)
    scales = torch.rand(out, groups, generator=gen) * 0.1 + 0.01
    z: torch.Tensor | None = None
    if zeros == "uint8":
        z = torch.randint(0, 16, (out, groups), generator=gen, dtype=torch.uint8)
    elif zeros == "float":
        z = torch.rand(out, groups, generator=gen) * 15
    g_idx = None
    if act_order:
        g_idx = (torch.randperm(inp, generator=gen) // group).to(torch.int32)
    return QuantizedWeight(WeightScheme.INT4, q, scales, z, group, g_idx)


def check_int4(qw: QuantizedWeight, rows: int, dtype: torch.dtype, seed: int = 0) -> None:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, qw.in_features, generator=gen).to(dtype)
    y = int4_matmul(x, qw.qweight, qw.scales, qw.zeros, qw.group_size, qw.g_idx)
    ref = int4_matmul_reference(x, qw.qweight, qw.scales, qw.zeros, qw.group_size, qw.g_idx)
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(y, ref, atol=atol, rtol=rtol)


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("group", [32, 64, 128])
def test_int4_groups_and_ragged_rows(rows: int, group: int) -> None:
    # in = 3 groups (not a multiple of 64/128 for group 32), out = 40: a masked output tile.
    gen = torch.Generator().manual_seed(group + rows)
    qw = random_int4(gen, 40, 3 * group, group, "uint8", act_order=False)
    check_int4(qw, rows, torch.float16, seed=rows)


@pytest.mark.parametrize(
    "zeros, act_order, dtype",
    [
        ("none", False, torch.bfloat16),
        ("float", False, torch.float16),
        ("uint8", True, torch.bfloat16),
        ("none", True, torch.float16),
        ("float", True, torch.float32),
        ("uint8", False, torch.float32),
    ],
)
@pytest.mark.parametrize("rows", [1, 17])
def test_int4_zeros_g_idx_and_dtypes(
    zeros: str, act_order: bool, dtype: torch.dtype, rows: int
) -> None:
    # in = 96: with g_idx, K steps of 64 leave a half-masked last step.
    gen = torch.Generator().manual_seed(rows)
    qw = random_int4(gen, 24, 96, 32, zeros, act_order)
    check_int4(qw, rows, dtype, seed=rows + 1)


def test_int4_reference_is_the_format_reference() -> None:
    gen = torch.Generator().manual_seed(3)
    for zeros, act_order in (("uint8", False), ("float", True), ("none", True)):
        qw = random_int4(gen, 8, 128, 64, zeros, act_order)
        ref = int4_dequantize_reference(qw.qweight, qw.scales, qw.zeros, qw.group_size, qw.g_idx)
        torch.testing.assert_close(ref, qw.dequantize(), atol=0, rtol=0)


def scaled_weight(gen: torch.Generator, scheme: str, out: int, inp: int) -> QuantizedWeight:
    w = torch.randn(out, inp, generator=gen)
    if scheme == "int8":
        return quantize_int8(w)
    return quantize_fp8(w, per_tensor=scheme == "fp8-tensor")


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("scheme", ["int8", "fp8", "fp8-tensor"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_scaled_schemes(scheme: str, dtype: torch.dtype, rows: int) -> None:
    # in = 200, out = 40: neither is a multiple of the tiles.
    gen = torch.Generator().manual_seed(rows)
    qw = scaled_weight(gen, scheme, 40, 200)
    x = torch.randn(rows, 200, generator=gen).to(dtype)
    y = scaled_matmul(x, qw.qweight, qw.scales)
    ref = scaled_matmul_reference(x, qw.qweight, qw.scales)
    atol, rtol = TOLERANCES[dtype]
    torch.testing.assert_close(y, ref, atol=atol, rtol=rtol)
    # The reference is x @ dequantize().T (float64 sums of exact products, then one rounding).
    exact = (x.double() @ qw.dequantize(torch.float64).t()).to(dtype)
    torch.testing.assert_close(ref, exact, atol=atol, rtol=rtol)


@pytest.mark.parametrize("rows", ROWS)
@pytest.mark.parametrize("per_tensor", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_fp8_w8a8_quantizes_x_in_the_kernel(
    dtype: torch.dtype, per_tensor: bool, rows: int
) -> None:
    """quantize_x: the W8A8 product of fp8_reference_matmul (x quantized per row to e4m3,
    exact products summed in fp32), each row against its own size. Rows a thousandfold
    apart: one scale for the whole batch, or none, misses the small row by far more; and the
    unquantized product is at least twice as far off as the kernel, so a kernel that skipped
    the quantization fails too."""
    gen = torch.Generator().manual_seed(rows)
    qw = quantize_fp8(torch.randn(40, 200, generator=gen) * 0.05, per_tensor=per_tensor)
    sizes = torch.tensor([1.0, 1e-3, 30.0, 0.2] * 5)[:rows, None]
    x = (torch.randn(rows, 200, generator=gen) * sizes).to(dtype)
    y = scaled_matmul(x, qw.qweight, qw.scales, quantize_x=True)
    assert y.dtype == dtype and y.shape == (rows, 40)
    ref = fp8_reference_matmul(x.float(), qw)
    unquantized = x.float() @ qw.dequantize().t()
    tol = 1e-5 if dtype == torch.float32 else 2**-7 if dtype == torch.bfloat16 else 2**-10
    for row in range(rows):
        size = ref[row].abs().max().item()
        error = (y[row].float() - ref[row]).abs().max().item()
        assert error <= tol * size
        assert (unquantized[row] - ref[row]).abs().max().item() > 2 * error
    via_weight = quantized_linear(x, qw, quantize_x=True)
    torch.testing.assert_close(via_weight, y, atol=0, rtol=0)


def test_quantize_x_needs_fp8_weights() -> None:
    qw = quantize_int8(torch.randn(8, 32))
    with pytest.raises(ValueError, match="quantize_x is fp8's W8A8"):
        scaled_matmul(torch.randn(2, 32), qw.qweight, qw.scales, quantize_x=True)


def test_quantized_linear_dispatches_and_writes_into_out() -> None:
    gen = torch.Generator().manual_seed(4)
    x = torch.randn(3, 64, generator=gen).half()
    int4 = random_int4(gen, 16, 64, 32, "uint8", act_order=False)
    int8 = scaled_weight(gen, "int8", 16, 64)
    full = torch.full((3, 20), 7.0, dtype=torch.float16)
    y = quantized_linear(x, int4, out=full[:, :16])
    assert y.data_ptr() == full.data_ptr() and bool((full[:, 16:] == 7.0).all())
    torch.testing.assert_close(
        y, int4_matmul_reference(x, int4.qweight, int4.scales, int4.zeros, 32), atol=2e-3, rtol=2e-3
    )
    torch.testing.assert_close(
        quantized_linear(x, int8),
        scaled_matmul_reference(x, int8.qweight, int8.scales),
        atol=2e-3,
        rtol=2e-3,
    )


def test_no_rows() -> None:
    qw = quantize_int8(torch.randn(8, 32))
    assert scaled_matmul(torch.zeros(0, 32), qw.qweight, qw.scales).shape == (0, 8)


def _int4_args() -> dict[str, object]:
    return dict(
        x=torch.zeros(2, 64, dtype=torch.float16),
        qweight=torch.zeros(8, 32, dtype=torch.uint8),
        scales=torch.zeros(8, 2),
        zeros=None,
        group_size=32,
    )


BAD_INT4 = {
    "x-width": (dict(x=torch.zeros(2, 32, dtype=torch.float16)), r"x must be \[num_rows, 64\]"),
    "x-dtype": (dict(x=torch.zeros(2, 64, dtype=torch.float64)), r"float64"),
    "x-strided": (dict(x=torch.zeros(2, 128, dtype=torch.float16)[:, ::2]), r"stride 2"),
    "qweight-dtype": (dict(qweight=torch.zeros(8, 32, dtype=torch.int8)), r"qweight must be uint8"),
    "group": (dict(group_size=48), r"group_size must be one of"),
    "scales-shape": (dict(scales=torch.zeros(8, 4)), r"scales must be float32 \(8, 2\)"),
    "scales-dtype": (dict(scales=torch.zeros(8, 2).half()), r"scales must be float32"),
    "zeros-dtype": (dict(zeros=torch.zeros(8, 2, dtype=torch.int32)), r"zeros must be uint8"),
    "g_idx-dtype": (dict(g_idx=torch.zeros(64, dtype=torch.int64)), r"g_idx must be contiguous"),
    "device": (dict(scales=torch.zeros(8, 2, device="meta")), r"x's device"),
    "out": (dict(out=torch.zeros(2, 8)), r"out must be \(2, 8\) torch.float16"),
}


@pytest.mark.parametrize("override, match", BAD_INT4.values(), ids=list(BAD_INT4))
def test_int4_rejects_bad_arguments(override: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        int4_matmul(**{**_int4_args(), **override})  # type: ignore[arg-type]


BAD_SCALED = {
    "qweight-dtype": (dict(qweight=torch.zeros(8, 64, dtype=torch.uint8)), r"int8 or float8"),
    "scales-shape": (dict(scales=torch.zeros(4)), r"scales must be float32 \[8\] or \[1\]"),
    "x-width": (dict(x=torch.zeros(2, 32)), r"x must be \[num_rows, 64\]"),
}


@pytest.mark.parametrize("override, match", BAD_SCALED.values(), ids=list(BAD_SCALED))
def test_scaled_rejects_bad_arguments(override: dict[str, object], match: str) -> None:
    args = dict(x=torch.zeros(2, 64), qweight=torch.zeros(8, 64, dtype=torch.int8))
    args["scales"] = torch.ones(8)
    with pytest.raises(ValueError, match=match):
        scaled_matmul(**{**args, **override})  # type: ignore[arg-type]


# Compiles every kernel variant for sm_90 (Triton's own LLVM and ptxas, no GPU needed) with
# the wrapper's tiles, in a fresh interpreter without TRITON_INTERPRET. Exit code 3: this
# Triton cannot target CUDA.
LOWER_SCRIPT = r"""
from tandem.kernels.quant_matmul import (
    G_IDX_BLOCK_K, _int4_matmul_kernel, _scaled_matmul_kernel, tiles_for,
)
from tests.kernels.compile_check import aligned_attrs, compile_sm90, ptxas_usage


def build(kernel, constants, types, num_warps, name):
    signature = {}
    for arg in kernel.arg_names:
        if arg in constants:
            signature[arg] = "constexpr"
        else:
            signature[arg] = types.get(arg, "i32")
    # Pointers and row strides are multiples of 16 for a model's shapes (a launch specialises
    # on that): without it, every pointer of a tile is computed in 64 bits, twice the registers.
    names = [n for n in kernel.arg_names if n.endswith("_ptr") or n.startswith("stride_")]
    aligned = aligned_attrs(kernel, [n for n in names if n != "stride_s"])
    compiled = compile_sm90(
        kernel, signature, constants, aligned, num_warps=num_warps, enable_fp_fusion=True
    )
    registers, spills = ptxas_usage(compiled.asm["ptx"])
    assert spills == 0, (name, registers, spills)
    print(name, registers, "registers ok")


for rows in (1, 64):  # a decode tile and a prefill tile
    for x in ("fp16", "bf16"):
        tiles = tiles_for(rows, int4=False)
        shape = dict(BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n)
        for w, quant_x in (("i8", False), ("u8", False), ("u8", True)):  # int8; e4m3; W8A8
            types = dict(x_ptr="*" + x, w_ptr="*" + w, scales_ptr="*fp32", out_ptr="*" + x)
            constants = dict(
                shape,
                BLOCK_K=128 if rows <= 16 else 64,
                W_FP8=w == "u8",
                QUANT_X=quant_x,
                EPS=1e-12,
                FP8_MAX=448.0,
                DOT_PRECISION="tf32",
                DOT_FP32=False,
            )
            name = f"{rows} {x} {w}{' quantize_x' if quant_x else ''}"
            build(_scaled_matmul_kernel, constants, types, tiles.num_warps, name)
        tiles = tiles_for(rows, int4=True)
        shape = dict(BLOCK_M=tiles.block_m, BLOCK_N=tiles.block_n)
        for group, zeros, g_idx in ((32, "u8", False), (128, "u8", False), (128, "fp32", True)):
            types = dict(
                x_ptr="*" + x,
                qweight_ptr="*u8",
                scales_ptr="*fp32",
                zeros_ptr="*" + zeros,
                g_idx_ptr="*i32",
                out_ptr="*" + x,
            )
            constants = dict(
                shape,
                GROUP_SIZE=group,
                BLOCK_K=G_IDX_BLOCK_K if g_idx else group,
                HAS_ZEROS=True,
                HAS_G_IDX=g_idx,
                DOT_PRECISION="tf32",
                DOT_FP32=False,
            )
            name = f"{rows} {x} int4 g{group} {zeros} g_idx={g_idx}"
            build(_int4_matmul_kernel, constants, types, tiles.num_warps, name)
"""


def test_lowers_for_sm90() -> None:
    """The interpreter runs programs the GPU compiler rejects (tl.dot below 16 rows, fp8
    conversions): compile every variant for a real target, without register spills."""
    assert_lowers(LOWER_SCRIPT, 24)
