"""KVLayout: what a KV cache's bytes are, derived from the tensor, and the rule that a reader
only copies blocks whose dtype and block geometry equal its own (memory and device may differ)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tandem.transfer import KVLayout, LayoutMismatch, check_compatible, layout_diff
from tandem.transfer.layout import BLOCK_MAJOR

# [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]
SHAPE = (8, 3, 2, 4, 2, 16)
BF16 = KVLayout("DRAM", 0, "bfloat16", num_layers=3, block_size=4, num_kv_heads=2, head_dim=16)


def test_of_cache_reads_dtype_device_and_geometry() -> None:
    kv = torch.zeros(SHAPE, dtype=torch.bfloat16)
    layout = KVLayout.of_cache(kv)
    assert layout == BF16 and layout.order == BLOCK_MAJOR
    assert layout.itemsize == 2
    assert layout.block_bytes == 3 * 2 * 4 * 2 * 16 * 2 == kv[0].numel() * kv.element_size()
    f32 = KVLayout.of_cache(torch.zeros(SHAPE, dtype=torch.float32))
    assert f32 == dataclasses.replace(BF16, dtype="float32")
    assert f32.block_bytes == 2 * BF16.block_bytes


def test_of_cache_maps_devices_to_memory_types() -> None:
    meta = KVLayout.of_cache(torch.empty(SHAPE, device="meta"))  # any non-CPU device is VRAM
    assert (meta.memory_type, meta.device_id) == ("VRAM", 0)
    if torch.cuda.is_available():
        index = torch.cuda.device_count() - 1
        vram = KVLayout.of_cache(torch.zeros(SHAPE, device=f"cuda:{index}"))
        assert (vram.memory_type, vram.device_id) == ("VRAM", index)


@pytest.mark.parametrize(
    "shape", [(8, 96), (8, 3, 1, 4, 2, 16), (8, 3, 2, 4, 2, 16, 1)], ids=["2d", "no-kv", "7d"]
)
def test_of_cache_rejects_other_shapes(shape: tuple[int, ...]) -> None:
    with pytest.raises(ValueError) as err:
        KVLayout.of_cache(torch.zeros(shape))
    assert str(err.value) == f"kv_cache must have shape {BLOCK_MAJOR}, got {shape}"


def test_validation_names_the_field() -> None:
    assert KVLayout("VRAM", 3, "bfloat16", 3, 4, 2, 16).device_id == 3
    assert dataclasses.replace(BF16, dtype="float").dtype == "float32"  # canonical names
    with pytest.raises(ValueError, match="^memory_type must be one of .* got 'HBM'"):
        dataclasses.replace(BF16, memory_type="HBM")
    with pytest.raises(ValueError, match="^device_id must be 0 for DRAM .* got 1 for DRAM"):
        dataclasses.replace(BF16, device_id=1)
    with pytest.raises(ValueError, match="^device_id .* got -1 for VRAM"):
        dataclasses.replace(BF16, memory_type="VRAM", device_id=-1)
    for bad in ("", "bf16", "Tensor"):
        with pytest.raises(ValueError, match=f"^dtype must name a torch dtype .* got {bad!r}"):
            dataclasses.replace(BF16, dtype=bad)
    for name in ("num_layers", "block_size", "num_kv_heads", "head_dim"):
        with pytest.raises(ValueError, match=f"^{name} must be > 0, got 0"):
            dataclasses.replace(BF16, **{name: 0})
    with pytest.raises(ValueError, match="^order"):
        dataclasses.replace(BF16, order="")
    with pytest.raises(dataclasses.FrozenInstanceError):
        BF16.dtype = "float32"  # type: ignore[misc]


def test_memory_type_and_device_may_differ() -> None:
    vram = dataclasses.replace(BF16, memory_type="VRAM", device_id=5)
    assert layout_diff(vram, BF16) == ()
    check_compatible(vram, BF16)  # a VRAM owner, a DRAM reader: NIXL reads across
    check_compatible(BF16, vram)
    check_compatible(vram, dataclasses.replace(vram, device_id=0))


def test_dtype_mismatch_names_both_values() -> None:
    with pytest.raises(LayoutMismatch) as err:
        check_compatible(dataclasses.replace(BF16, dtype="float32"), BF16)
    assert str(err.value) == "KV layout mismatch: dtype: handle has float32, this worker bfloat16"
    assert err.value.diffs == (("dtype", "float32", "bfloat16"),)
    assert err.value.fields == ("dtype",)
    assert isinstance(err.value, ValueError)


def test_every_differing_field_is_named_in_order() -> None:
    remote = KVLayout("VRAM", 1, "float16", 2, 16, 8, 64, order="[num_layers, num_blocks, ...]")
    assert layout_diff(remote, BF16) == (
        ("dtype", "float16", "bfloat16"),
        ("order", "[num_layers, num_blocks, ...]", BLOCK_MAJOR),
        ("num_layers", 2, 3),
        ("block_size", 16, 4),
        ("num_kv_heads", 8, 2),
        ("head_dim", 64, 16),
    )
    with pytest.raises(LayoutMismatch) as err:
        check_compatible(remote, BF16)
    assert str(err.value) == (
        "KV layout mismatch: dtype: handle has float16, this worker bfloat16; "
        f"order: handle has [num_layers, num_blocks, ...], this worker {BLOCK_MAJOR}; "
        "num_layers: handle has 2, this worker 3; block_size: handle has 16, this worker 4; "
        "num_kv_heads: handle has 8, this worker 2; head_dim: handle has 64, this worker 16"
    )


def test_equal_block_bytes_is_not_enough() -> None:
    # Same bytes per block, different meaning: the check is on the layout, not the size.
    remote = dataclasses.replace(BF16, num_layers=6, block_size=2)
    assert remote.block_bytes == BF16.block_bytes
    with pytest.raises(LayoutMismatch) as err:
        check_compatible(remote, BF16)
    assert err.value.fields == ("num_layers", "block_size")
