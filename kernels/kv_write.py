"""Store a step's new K/V into their slots of the block-major paged cache.

One program per (token, group of kv heads) copies that token's K and V rows; the slot is
named by (block id, offset) pairs the runner computed, so tokens of different requests and
non-adjacent blocks cost the same:

    token t  ->  kv_layer[slot_block_ids[t], 0, slot_offsets[t]] = k[t]   (all kv heads)
                 kv_layer[slot_block_ids[t], 1, slot_offsets[t]] = v[t]

An fp8 (e4m3) cache stores each value divided by its tensor's scale, saturated to +-448
(`tandem.kernels.reference.quantize_kv_reference`; tandem.quant.kv):

    kv_layer[..., 0, ...] = e4m3(clamp(k[t] / k_scale, -448, 448))     likewise V, v_scale

`kv_layer` is one layer's strided view of the whole cache (`kv_cache[:, layer]`), so the
block stride spans every layer: block id * block stride is computed in int64.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

KV_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
FP8_KV_DTYPE = torch.float8_e4m3fn  # a quantized cache; k and v stay in a KV_DTYPES dtype
FP8_MAX = 448.0  # largest finite e4m3fn value (spelled out in the kernel: a jit global)
SLOT_DTYPES = (torch.int32, torch.int64)
# Elements one program moves per tensor (K or V); more heads than fit go to more programs.
MAX_TILE_ELEMENTS = 4096


@triton.jit
def _round_to_e4m3(x):  # type: ignore[no-untyped-def]
    """fp32 `x` in [-448, 448] rounded to the nearest e4m3 value (ties to even), still fp32.

    Rounded here, not by the fp32 -> fp8 conversion, so that the stored bits are the same on
    every backend: Triton's CPU interpreter (the tests) rounds that conversion wrongly (a
    carry out of the mantissa, subnormals truncated); on a GPU the conversion of an exact
    e4m3 value is exact, so this costs a few ALU ops in a memory-bound kernel, nothing else.

        e4m3: 3 mantissa bits, normal from 2**-6, subnormal steps of 2**-9
        quantum(x) = 2**(max(exponent(x), -6) - 3)
        round(x)   = rint(x / quantum) * quantum       (x / quantum < 16: exact in fp32)
    """
    bits = x.to(tl.int32, bitcast=True)
    exponent = ((bits >> 23) & 0xFF) - 127
    quantum = ((tl.maximum(exponent, -6) - 3 + 127) << 23).to(tl.float32, bitcast=True)
    # rint by the 1.5 * 2**23 trick: fp32 addition rounds to nearest even.
    y = x / quantum
    rounded = ((y + 12582912.0) - 12582912.0) * quantum
    # A negative value that rounds to zero stays -0, as torch's conversion keeps it.
    sign = bits & -2147483648  # 0x80000000
    return (rounded.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


# Triton reads kernel annotations (tl.constexpr), so the arguments carry comments instead.
@triton.jit
def _write_kv_kernel(  # type: ignore[no-untyped-def]
    k_ptr,  # [num_tokens, num_kv_heads, head_dim] new keys, head_dim contiguous
    v_ptr,  # [num_tokens, num_kv_heads, head_dim] new values, head_dim contiguous
    cache_ptr,  # [num_blocks, 2, block_size, num_kv_heads, head_dim] kv_layer, dim contiguous
    slot_block_ids_ptr,  # [num_tokens] int32/int64: block of each token's slot
    slot_offsets_ptr,  # [num_tokens] int32/int64: offset of the slot inside its block
    stride_k_token,  # k.stride(0), elements
    stride_k_head,  # k.stride(1)
    stride_v_token,  # v.stride(0)
    stride_v_head,  # v.stride(1)
    stride_c_block,  # kv_layer.stride(0): spans all layers of a block, may exceed int32 range
    stride_c_kv,  # kv_layer.stride(1): from a slot's K to its V
    stride_c_slot,  # kv_layer.stride(2)
    stride_c_head,  # kv_layer.stride(3)
    num_kv_heads,  # heads per token (runtime: masks the last head tile)
    head_dim,  # elements per head (runtime: masks the padded BLOCK_D tail)
    k_scale,  # fp32: an fp8 cache stores k / k_scale (unused otherwise)
    v_scale,  # fp32: likewise for v
    BLOCK_H: tl.constexpr,  # kv heads per program, a power of two
    BLOCK_D: tl.constexpr,  # next power of two >= head_dim
    FP8: tl.constexpr,  # the cache is e4m3: quantize with the scales, saturating
):
    token = tl.program_id(0).to(tl.int64)
    head_tile = tl.program_id(1)
    # int64 before multiplying: block id * stride_c_block overflows int32 in a large cache.
    block = tl.load(slot_block_ids_ptr + token).to(tl.int64)
    offset = tl.load(slot_offsets_ptr + token).to(tl.int64)

    heads = head_tile * BLOCK_H + tl.arange(0, BLOCK_H)  # [BLOCK_H]
    dims = tl.arange(0, BLOCK_D)  # [BLOCK_D]
    mask = (heads[:, None] < num_kv_heads) & (dims[None, :] < head_dim)  # [BLOCK_H, BLOCK_D]

    k = tl.load(
        k_ptr + token * stride_k_token + heads[:, None] * stride_k_head + dims[None, :],
        mask=mask,
    )
    v = tl.load(
        v_ptr + token * stride_v_token + heads[:, None] * stride_v_head + dims[None, :],
        mask=mask,
    )
    dst = (
        cache_ptr
        + block * stride_c_block
        + offset * stride_c_slot
        + heads[:, None] * stride_c_head
        + dims[None, :]
    )
    if FP8:
        # Divided in fp32 and saturated (e4m3fn has no infinity, so out-of-range values would
        # become NaN), then rounded to e4m3 as torch's .to(float8_e4m3fn) does.
        k = _round_to_e4m3(tl.clamp(k.to(tl.float32) / k_scale, -448.0, 448.0))
        v = _round_to_e4m3(tl.clamp(v.to(tl.float32) / v_scale, -448.0, 448.0))
    tl.store(dst, k.to(cache_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + stride_c_kv, v.to(cache_ptr.dtype.element_ty), mask=mask)


def _check(
    k: torch.Tensor,
    v: torch.Tensor,
    kv_layer: torch.Tensor,
    slot_block_ids: torch.Tensor,
    slot_offsets: torch.Tensor,
) -> None:
    if k.dim() != 3 or v.shape != k.shape:
        raise ValueError(
            f"k and v must both be [num_tokens, num_kv_heads, head_dim], "
            f"got k {tuple(k.shape)} and v {tuple(v.shape)}"
        )
    if kv_layer.dim() != 5 or kv_layer.shape[1] != 2 or kv_layer.shape[3:] != k.shape[1:]:
        raise ValueError(
            f"kv_layer must be [num_blocks, 2, block_size, {k.shape[1]}, {k.shape[2]}] "
            f"for k {tuple(k.shape)}, got {tuple(kv_layer.shape)}"
        )
    if kv_layer.dtype == FP8_KV_DTYPE:
        if k.dtype not in KV_DTYPES or v.dtype != k.dtype:
            raise ValueError(
                f"k and v must share a dtype of {KV_DTYPES} for an fp8 cache, got {k.dtype}, "
                f"{v.dtype}"
            )
    elif kv_layer.dtype not in KV_DTYPES:
        raise ValueError(
            f"kv_layer dtype must be one of {KV_DTYPES} or {FP8_KV_DTYPE}, got {kv_layer.dtype}"
        )
    elif k.dtype != kv_layer.dtype or v.dtype != kv_layer.dtype:
        raise ValueError(
            f"k, v and kv_layer must share a dtype, got {k.dtype}, {v.dtype}, {kv_layer.dtype}"
        )
    num_tokens = k.shape[0]
    for name, ids in (("slot_block_ids", slot_block_ids), ("slot_offsets", slot_offsets)):
        if ids.shape != (num_tokens,):
            raise ValueError(f"{name} must be [{num_tokens}], got {tuple(ids.shape)}")
        if ids.dtype not in SLOT_DTYPES:
            raise ValueError(f"{name} must be int32 or int64, got {ids.dtype}")
    devices = {t.device for t in (k, v, kv_layer, slot_block_ids, slot_offsets)}
    if len(devices) != 1:
        raise ValueError(
            f"all tensors must be on one device, got k {k.device}, v {v.device}, "
            f"kv_layer {kv_layer.device}, slot_block_ids {slot_block_ids.device}, "
            f"slot_offsets {slot_offsets.device}"
        )
    strides = {"k": k.stride(-1), "v": v.stride(-1), "kv_layer": kv_layer.stride(-1)}
    if any(s != 1 for s in strides.values()):
        raise ValueError(f"head_dim must be contiguous (stride 1), got strides {strides}")


def write_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    kv_layer: torch.Tensor,
    slot_block_ids: torch.Tensor,
    slot_offsets: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Write token t's k/v into slot (slot_block_ids[t], slot_offsets[t]) of `kv_layer`.

    Args:
        k, v: [num_tokens, num_kv_heads, head_dim], the cache's dtype (any of KV_DTYPES for
            an fp8 cache), head_dim contiguous.
        kv_layer: [num_blocks, 2, block_size, num_kv_heads, head_dim], a strided view of the
            whole cache (`kv_cache[:, layer]`); written in place. float8_e4m3fn: quantized.
        k_scale, v_scale: an fp8 cache's scales (stored = value / scale); ignored otherwise.
        slot_block_ids: [num_tokens] int32/int64, block of each token's slot.
        slot_offsets: [num_tokens] int32/int64, offset inside that block.

    Slots are not range-checked (that would need a device->host sync): the runner hands out
    slots of blocks it allocated. Two tokens naming one slot leave either one's K/V.

    Raises:
        ValueError: shapes, dtypes, devices or strides that do not fit together.
    """
    _check(k, v, kv_layer, slot_block_ids, slot_offsets)
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    block_d = triton.next_power_of_2(head_dim)
    block_h = min(triton.next_power_of_2(num_kv_heads), max(1, MAX_TILE_ELEMENTS // block_d))
    grid = (num_tokens, triton.cdiv(num_kv_heads, block_h))
    _write_kv_kernel[grid](
        k,
        v,
        kv_layer,
        slot_block_ids,
        slot_offsets,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        kv_layer.stride(0),
        kv_layer.stride(1),
        kv_layer.stride(2),
        kv_layer.stride(3),
        num_kv_heads,
        head_dim,
        float(k_scale),
        float(v_scale),
        BLOCK_H=block_h,
        BLOCK_D=block_d,
        FP8=kv_layer.dtype == FP8_KV_DTYPE,
    )
