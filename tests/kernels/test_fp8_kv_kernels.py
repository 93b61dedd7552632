"""The Triton kernels over an fp8 (e4m3) KV cache against the references (issue 28).

KV write: quantization is a division and a round to nearest, as `quantize_kv_reference`
does, so the stored bytes must be equal, bit for bit. Decode and prefill: against the
reference attention over the cache's dequantized values (float32(stored) * scale), within
the tolerances of the 16-bit or fp32 kernels (the dequantized values are exact in fp32 and
in bf16 for power-of-two scales). Small shapes: these run under Triton's interpreter on a
machine without a GPU; the sm_90 lowering of the fp8 variants is in each kernel's own
lowering test.
"""

from __future__ import annotations

import pytest
import torch

from tandem.kernels.decode_attention import paged_decode_attention
from tandem.kernels.kv_write import write_kv
from tandem.kernels.prefill_attention import paged_prefill_attention
from tandem.kernels.reference import dequantize_kv_reference, quantize_kv_reference
from tests.kernels import test_decode_attention as decode_tests
from tests.kernels import test_prefill_attention as prefill_tests

FP8 = torch.float8_e4m3fn
K_SCALE, V_SCALE = 0.5, 0.25


def to_fp8_layer(kv_layer: torch.Tensor) -> torch.Tensor:
    """`kv_layer` (layer 1 of a 2-layer cache) quantized into layer 1 of a new fp8 cache:
    the same strided view the engine hands the kernels. NaN slots stay NaN."""
    num_blocks, _, block_size, heads, dim = kv_layer.shape
    cache = torch.zeros((num_blocks, 2, 2, block_size, heads, dim), dtype=FP8)
    cache[:, 1, 0] = quantize_kv_reference(kv_layer[:, 0].cpu(), K_SCALE)
    cache[:, 1, 1] = quantize_kv_reference(kv_layer[:, 1].cpu(), V_SCALE)
    return cache.to(kv_layer.device)[:, 1]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [1, 13])
def test_kv_write_quantizes_like_the_reference(dtype: torch.dtype, num_tokens: int) -> None:
    gen = torch.Generator().manual_seed(num_tokens)
    heads, dim, block_size, num_blocks = 2, 64, 16, 8
    cache = torch.zeros((num_blocks, 2, 2, block_size, heads, dim), dtype=FP8)
    expected = cache.clone()
    # Wide values: some beyond 448 * scale saturate, some are e4m3 subnormals.
    k = (torch.randn(num_tokens, heads, dim, generator=gen) * 100).to(dtype)
    v = (torch.randn(num_tokens, heads, dim, generator=gen) * 1e-2).to(dtype)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    block_ids, offsets = slots // block_size, slots % block_size
    write_kv(k, v, cache[:, 1], block_ids, offsets, K_SCALE, V_SCALE)
    expected[block_ids, 1, 0, offsets] = quantize_kv_reference(k, K_SCALE)
    expected[block_ids, 1, 1, offsets] = quantize_kv_reference(v, V_SCALE)
    assert torch.equal(cache.view(torch.uint8), expected.view(torch.uint8))
    assert cache[:, 1, 0].float().abs().max() == 448.0  # saturated, never NaN


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 4])
def test_decode_over_an_fp8_cache_matches_the_dequantized_reference(
    dtype: torch.dtype, group: int
) -> None:
    lens = [1, 15, 17, 40]
    q, kv, tables, ctx = decode_tests.make_case(
        lens, block_size=16, group=group, dtype=torch.float32
    )
    kv8 = to_fp8_layer(kv)
    q = q.to(dtype)
    out = paged_decode_attention(
        q, kv8, tables, ctx, 0.125, num_splits=2, k_scale=K_SCALE, v_scale=V_SCALE
    )
    values = dequantize_kv_reference(kv8.cpu(), K_SCALE, V_SCALE)
    expected = decode_tests.reference(q.float(), values, tables, ctx, 0.125)
    atol, rtol = decode_tests.TOLERANCES[dtype]
    torch.testing.assert_close(out.float(), expected, atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [1, 4])
def test_prefill_over_an_fp8_cache_matches_the_dequantized_reference(
    dtype: torch.dtype, group: int
) -> None:
    case = prefill_tests.make_case([(0, 17), (21, 6)], group=group, block_size=16)
    kv8 = to_fp8_layer(case.kv_layer)
    max_blocks = max(len(t) for t in case.tables)
    padded = [t + [0] * (max_blocks - len(t)) for t in case.tables]
    out = paged_prefill_attention(
        case.q.to(dtype),
        kv8,
        torch.tensor(padded, dtype=torch.int32),
        torch.tensor(case.query_starts, dtype=torch.int32),
        torch.tensor(case.context_lens, dtype=torch.int32),
        17,
        case.scale,
        k_scale=K_SCALE,
        v_scale=V_SCALE,
    )
    case.kv_layer = dequantize_kv_reference(kv8, K_SCALE, V_SCALE)
    atol, rtol = prefill_tests.TOLERANCES[dtype]
    for i in range(len(case.tables)):
        start, end = case.query_starts[i], case.query_starts[i + 1]
        torch.testing.assert_close(out[start:end].float(), case.reference(i), atol=atol, rtol=rtol)


def test_fp8_cache_needs_16_or_32_bit_k_and_v() -> None:
    cache = torch.zeros((2, 2, 4, 1, 16), dtype=FP8)
    k = torch.zeros((1, 1, 16), dtype=FP8)
    ids = torch.zeros(1, dtype=torch.int64)
    with pytest.raises(ValueError, match="for an fp8 cache"):
        write_kv(k, k, cache, ids, ids)
