"""The KV cache tensor and its layout.

    kv_cache: [num_blocks, num_layers, 2 (K, V), block_size, num_kv_heads, head_dim]

One block holds every layer's K and V contiguously, so moving a block to another worker is
one descriptor, and a run of adjacent block ids is one contiguous byte range. A layer's
view `kv_cache[:, layer]` is strided across blocks, which the attention backend handles.
"""

from __future__ import annotations

import torch

from tandem.model.config import ModelConfig


def block_bytes(model: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one block across all layers."""
    return block_size * model.kv_elements_per_token * dtype.itemsize


def allocate_kv_cache(
    model: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """Zeroed cache tensor (zeros so that a never-written slot is not NaN garbage)."""
    shape = (num_blocks, model.num_layers, 2, block_size, model.num_kv_heads, model.head_dim)
    return torch.zeros(shape, dtype=dtype, device=device)
