"""The quantized-weight format and its reference quantizers (tandem/quant/weight.py)."""

from __future__ import annotations

import pytest
import torch

from tandem.quant.weight import (
    QuantizedWeight,
    WeightScheme,
    pack_int4,
    quantize,
    quantize_fp8,
    quantize_int4,
    quantize_int8,
    unpack_int4,
)


def test_int4_packing_puts_even_inputs_in_the_low_nibble():
    q = torch.tensor([[1, 2, 15, 0], [7, 8, 9, 10]])
    packed = pack_int4(q)
    assert packed.dtype == torch.uint8
    assert packed.tolist() == [[0x21, 0x0F], [0x87, 0xA9]]
    assert torch.equal(unpack_int4(packed), q.to(torch.uint8))


def test_int8_is_per_channel_symmetric_and_exact_on_its_grid():
    w = torch.tensor([[1.0, -0.5, 0.25], [-4.0, 2.0, 0.0]])
    qw = quantize_int8(w)
    assert qw.scales.tolist() == pytest.approx([1 / 127, 4 / 127])
    assert qw.qweight.tolist() == [[127, -64, 32], [-127, 64, 0]]
    # each value within half a step of its channel's scale
    err = (qw.dequantize() - w).abs()
    assert bool((err <= qw.scales[:, None] / 2 + 1e-7).all())


def test_int4_error_within_half_a_step_and_group_extremes_kept():
    """Float zero points: each group's min and max are its grid's ends (exact to float32
    rounding), every value within half a step; an all-zero or constant group is exact."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(8, 256, generator=g)
    w[0, :32] = 0.0  # an all-zero group
    w[1, 32:64] = 0.75  # a constant group
    w[2, 64:96] = w[2, 64:96].abs() + 1.0  # a group that does not hold 0
    qw = quantize_int4(w, group_size=32)
    assert tuple(qw.qweight.shape) == (8, 128) and tuple(qw.scales.shape) == (8, 8)
    assert qw.zeros is not None and qw.zeros.dtype == torch.float32
    deq = qw.dequantize()
    assert torch.equal(deq[0, :32], torch.zeros(32))
    torch.testing.assert_close(deq[1, 32:64], torch.full((32,), 0.75), atol=1e-6, rtol=0)
    steps = qw.scales.repeat_interleave(32, dim=1)
    assert bool(((deq - w).abs() <= steps / 2 + 1e-6).all())
    wg, dg = w.view(8, 8, 32), deq.view(8, 8, 32)
    torch.testing.assert_close(dg.amin(2), wg.amin(2), atol=1e-5, rtol=0)
    torch.testing.assert_close(dg.amax(2), wg.amax(2), atol=1e-5, rtol=0)


@pytest.mark.parametrize("per_tensor", [False, True])
def test_fp8_relative_error_is_e4m3s(per_tensor):
    g = torch.Generator().manual_seed(1)
    w = torch.randn(16, 64, generator=g)
    qw = quantize_fp8(w, per_tensor=per_tensor)
    assert qw.qweight.dtype == torch.float8_e4m3fn
    assert tuple(qw.scales.shape) == ((1,) if per_tensor else (16,))
    # e4m3 keeps 3 mantissa bits: relative rounding error <= 2**-4 for normal values
    deq = qw.dequantize()
    big = w.abs() > qw.scales.view(-1, 1) * 2**-6 * 8
    assert bool(((deq - w).abs()[big] <= w.abs()[big] * 2**-4 + 1e-7).all())


def test_num_bytes_counts_values_scales_and_zeros():
    w = torch.randn(4, 64)
    assert quantize(w, WeightScheme.INT8).num_bytes() == 4 * 64 + 4 * 4
    # int4: packed values, a float32 scale and a float32 zero point per group
    assert quantize(w, WeightScheme.INT4, 32).num_bytes() == 4 * 32 + 4 * 2 * 4 + 4 * 2 * 4


def test_dequantize_in_a_dtype_and_shape():
    qw = quantize(torch.randn(6, 64), WeightScheme.INT4, 64)
    assert qw.out_features == 6 and qw.in_features == 64
    assert qw.dequantize(torch.bfloat16).dtype == torch.bfloat16
    assert tuple(qw.dequantize().shape) == (6, 64)


def test_malformed_weights_are_refused_naming_the_field():
    q8 = torch.zeros(4, 8, dtype=torch.int8)
    with pytest.raises(ValueError, match="scales must be \\[4\\]"):
        QuantizedWeight(WeightScheme.INT8, q8, torch.ones(3), None, 8)
    with pytest.raises(ValueError, match="qweight must be torch.int8"):
        QuantizedWeight(WeightScheme.INT8, q8.float(), torch.ones(4), None, 8)
    with pytest.raises(ValueError, match="group_size must be one of"):
        QuantizedWeight(WeightScheme.INT4, torch.zeros(4, 24, dtype=torch.uint8),
                        torch.ones(4, 1), None, 48)  # fmt: skip
    with pytest.raises(ValueError, match="has no zero points or g_idx"):
        QuantizedWeight(WeightScheme.INT8, q8, torch.ones(4), torch.zeros(4, 1), 8)
    with pytest.raises(ValueError, match="scheme must be"):
        quantize(torch.ones(2, 64), WeightScheme.NONE)


def test_int4_fractional_zeros_and_act_order_groups():
    """GGUF Q4_1's fractional offsets, and GPTQ's g_idx (input i in group g_idx[i])."""
    q = torch.tensor([[0, 1, 2, 3] * 16])  # [1, 64]
    scales = torch.tensor([[0.5, 2.0]])
    zeros = torch.tensor([[0.25, 1.0]])
    plain = QuantizedWeight(WeightScheme.INT4, pack_int4(q), scales, zeros, 32)
    assert plain.dequantize()[0, :4].tolist() == [-0.125, 0.375, 0.875, 1.375]
    assert plain.dequantize()[0, 32:36].tolist() == [-2.0, 0.0, 2.0, 4.0]
    g_idx = (torch.arange(64) % 2).to(torch.int32)  # even inputs group 0, odd inputs group 1
    ordered = QuantizedWeight(WeightScheme.INT4, pack_int4(q), scales, zeros, 32, g_idx)
    assert ordered.dequantize()[0, :4].tolist() == [-0.125, 0.0, 0.875, 4.0]
