"""How big the KV cache is, and whether the model's context fits in it. Pure arithmetic; the
engine measures the inputs (device memory, the profile step's peak) and logs the result.

On a GPU the cache gets what the budget leaves after everything else:

    gpu_memory_utilization x device memory
      - peak allocated during a profile step at full batch (weights + activations + every
        workspace; the profile's own scratch KV is subtracted back out)
      = KV cache bytes -> blocks

On a CPU it is the configured byte budget (`CacheConfig.kv_cache_bytes`).
"""

from __future__ import annotations

from typing import NamedTuple

from tandem.model.layer_groups import KVLayout


class KVSizing(NamedTuple):
    num_blocks: int
    num_tokens: int  # num_blocks x block_size
    num_bytes: int
    source: str  # how the size was chosen, for the startup log


def gpu_kv_bytes(
    device_total_bytes: int, utilization: float, profile_peak_bytes: int, scratch_kv_bytes: int
) -> int:
    """KV bytes a GPU worker can afford.

    Args:
        device_total_bytes: the device's memory.
        utilization: fraction of it this engine may use in all.
        profile_peak_bytes: peak allocated by this engine during the profile step.
        scratch_kv_bytes: the profile's temporary KV cache, part of that peak but not of the
            steady state.

    Raises:
        ValueError: the weights and activations alone exceed the budget (names the figures).
    """
    budget = int(device_total_bytes * utilization)
    used = profile_peak_bytes - scratch_kv_bytes
    if used >= budget:
        raise ValueError(
            f"no room for a KV cache: weights and activations peak at {used / 2**30:.2f} GiB, "
            f"gpu_memory_utilization {utilization} of {device_total_bytes / 2**30:.2f} GiB is "
            f"{budget / 2**30:.2f} GiB; raise gpu_memory_utilization or lower "
            f"max_num_batched_tokens"
        )
    return budget - used


def blocks_for_bytes(num_bytes: int, block_bytes: int, source: str, block_size: int) -> KVSizing:
    """The whole blocks `num_bytes` hold. Raises ValueError when not even one fits."""
    n = num_bytes // block_bytes
    if n < 1:
        raise ValueError(f"{source}={num_bytes} holds no block of {block_bytes} bytes")
    return KVSizing(n, n * block_size, n * block_bytes, source)


def fit_context(
    max_model_len: int,
    explicit: bool,
    num_blocks: int,
    block_size: int,
    block_bytes: int,
    layout: KVLayout | None = None,
    chunk_tokens: int = 1,
) -> int:
    """The context length the engine can honour with `num_blocks` blocks.

    A context longer than the cache is capped to the cache when it came from the model's
    config (`explicit` False): the worker still serves shorter requests, and says so. When
    an operator asked for it (`explicit`), the engine refuses to start instead.

    Raises:
        ValueError: an explicit max_model_len the cache cannot hold, with the figures.
    """
    capacity = num_blocks * block_size
    if layout is not None and layout.num_tables > 1:  # a sliding table holds its window only
        capacity = layout.max_tokens(num_blocks, block_size, chunk_tokens)
    if max_model_len <= capacity:
        return max_model_len
    if explicit:
        need = blocks_needed(max_model_len, block_size, layout, chunk_tokens)
        raise ValueError(
            f"max_model_len={max_model_len} does not fit the KV cache: {num_blocks} blocks x "
            f"{block_size} tokens = {capacity} tokens ({num_blocks * block_bytes} bytes); "
            f"give the cache {need * block_bytes} bytes or more, or lower max_model_len"
        )
    return capacity


def blocks_needed(
    num_tokens: int, block_size: int, layout: KVLayout | None, chunk_tokens: int
) -> int:
    """Blocks one request of `num_tokens` tokens holds at its peak."""
    if layout is None or layout.num_tables <= 1:
        return -(-num_tokens // block_size)
    return layout.peak_blocks(num_tokens, block_size, chunk_tokens)
