"""What the bytes of a KV hand-off are: memory, dtype and block geometry of a KV cache.

A handle (`RemoteKV`) is only an address range; the reader would copy it into its own cache
whatever it holds. Both sides therefore describe their cache with a `KVLayout`, and a reader
refuses a handle whose layout differs from its own in anything that changes the meaning of the
bytes (`check_compatible`), before it moves any:

    kv_cache: [num_blocks, num_layers, 2 (K, V), block_size, num_kv_heads, head_dim]   dtype
    block_bytes = num_layers * 2 * block_size * num_kv_heads * head_dim * itemsize(dtype)

Where the bytes live (memory type, device) may differ between the sides: NIXL reads VRAM into
DRAM and across devices.

An FP8 cache's bytes mean something only with its scales (tandem.quant.kv): the layout
carries them as a manifest, `k_scales` and `v_scales` (one per layer; empty for a cache in the
model's dtype), matched exactly like the dtype, and signed with the rest of the handle. Equal
fp8 bytes under other scales are other numbers: a peer that drops or changes them serves
garbage.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MEMORY_TYPES = ("DRAM", "VRAM")
# The only order the engine allocates (tandem.engine.kv_cache): block-major, all layers' K and
# V of a block contiguous, so that a block is one byte range.
BLOCK_MAJOR = "[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]"
# The fields that must be equal on both sides of a read, in the order a mismatch names them.
MATCHED_FIELDS = (
    "dtype",
    "k_scales",
    "v_scales",
    "order",
    "num_layers",
    "block_size",
    "num_kv_heads",
    "head_dim",
)


@dataclass(frozen=True, slots=True)
class KVLayout:
    """Where a KV cache lives and how its blocks are laid out.

    Attributes:
        memory_type: "DRAM" (host memory) or "VRAM" (device memory).
        device_id: the device's index for VRAM; 0 for DRAM.
        dtype: element type, as torch names it without the prefix ("bfloat16").
        num_layers, block_size, num_kv_heads, head_dim: the cache's dimensions after the
            block dimension; block_size is in tokens.
        order: the cache's dimension order; `BLOCK_MAJOR` for every engine cache.
        k_scales, v_scales: a scaled (fp8) cache's dequantization scales, one per layer
            (x = stored * scale); empty for a cache in the model's dtype.
    """

    memory_type: str
    device_id: int
    dtype: str
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    order: str = BLOCK_MAJOR
    k_scales: tuple[float, ...] = ()
    v_scales: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if self.memory_type not in MEMORY_TYPES:
            raise ValueError(f"memory_type must be one of {MEMORY_TYPES}, got {self.memory_type!r}")
        if self.device_id < 0 or (self.memory_type == "DRAM" and self.device_id != 0):
            raise ValueError(
                f"device_id must be 0 for DRAM and >= 0 for VRAM, got {self.device_id} "
                f"for {self.memory_type}"
            )
        # Canonical name ("float" -> "float32"), so that equal dtypes compare equal.
        object.__setattr__(self, "dtype", str(_torch_dtype(self.dtype)).removeprefix("torch."))
        for name in ("num_layers", "block_size", "num_kv_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if not self.order:
            raise ValueError("order must be a non-empty string")
        object.__setattr__(self, "k_scales", tuple(float(x) for x in self.k_scales))
        object.__setattr__(self, "v_scales", tuple(float(x) for x in self.v_scales))
        for name in ("k_scales", "v_scales"):
            n = len(getattr(self, name))
            if n not in (0, self.num_layers):
                raise ValueError(f"{name} must have 0 or num_layers={self.num_layers}, got {n}")

    @property
    def itemsize(self) -> int:
        """Bytes per element of `dtype`."""
        return _torch_dtype(self.dtype).itemsize

    @property
    def block_bytes(self) -> int:
        """Bytes of one block: every layer's K and V for `block_size` tokens."""
        elements = self.num_layers * 2 * self.block_size * self.num_kv_heads * self.head_dim
        return elements * self.itemsize

    @classmethod
    def of_cache(
        cls,
        kv_cache: torch.Tensor,
        scales: tuple[tuple[float, ...], tuple[float, ...]] = ((), ()),
    ) -> KVLayout:
        """The layout of an engine's KV cache tensor (`BLOCK_MAJOR`, see the module docstring),
        with `scales` = (k_scales, v_scales) for a scaled (fp8) cache.

        Raises:
            ValueError: the tensor does not have the engine cache's 6 dimensions with K and V
                in dimension 2.
        """
        shape = tuple(kv_cache.shape)
        if len(shape) != 6 or shape[2] != 2:
            raise ValueError(f"kv_cache must have shape {BLOCK_MAJOR}, got {shape}")
        device = kv_cache.device
        if device.type == "cpu":
            memory_type, device_id = "DRAM", 0
        else:
            memory_type, device_id = "VRAM", int(device.index or 0)
        _, num_layers, _, block_size, num_kv_heads, head_dim = shape
        return cls(
            memory_type=memory_type,
            device_id=device_id,
            dtype=str(kv_cache.dtype).removeprefix("torch."),
            num_layers=num_layers,
            block_size=block_size,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            k_scales=tuple(scales[0]),
            v_scales=tuple(scales[1]),
        )


class LayoutMismatch(ValueError):
    """A handle's KV layout differs from the reader's cache: its bytes would be read as
    something they are not. Raised before any byte moves.

    Attributes:
        diffs: (field, handle's value, reader's value) for each differing field.
    """

    def __init__(self, diffs: tuple[tuple[str, object, object], ...]) -> None:
        parts = [f"{name}: handle has {theirs}, this worker {ours}" for name, theirs, ours in diffs]
        super().__init__("KV layout mismatch: " + "; ".join(parts))
        self.diffs = diffs

    @property
    def fields(self) -> tuple[str, ...]:
        """Names of the differing fields."""
        return tuple(name for name, _, _ in self.diffs)


def layout_diff(remote: KVLayout, local: KVLayout) -> tuple[tuple[str, object, object], ...]:
    """(field, remote value, local value) for each field in `MATCHED_FIELDS` that differs."""
    return tuple(
        (name, getattr(remote, name), getattr(local, name))
        for name in MATCHED_FIELDS
        if getattr(remote, name) != getattr(local, name)
    )


def check_compatible(remote: KVLayout, local: KVLayout) -> None:
    """Whether a reader with cache `local` may copy blocks described by `remote` verbatim.

    dtype, scales, order and block geometry must be equal; memory type and device may
    differ.

    Raises:
        LayoutMismatch: naming each differing field with both values.
    """
    diffs = layout_diff(remote, local)
    if diffs:
        raise LayoutMismatch(diffs)


def _torch_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None) if name else None
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"dtype must name a torch dtype (e.g. 'bfloat16'), got {name!r}")
    return dtype
