"""Tier-aware prefix scoring: what a worker's host and disk KV tiers save a prompt. Pure.

A worker with KV tiers (tandem.tiers) publishes to the prefix index, next to the plain hash of
each block its device cache holds, `tier_mark(h, HOST_TIER)` for each block it holds in host
memory or the device and `tier_mark(h, DISK_TIER)` for each block it holds in any tier
(tandem.engine.prefix_hash). Three lookups of a prompt's chain (plain hashes, host marks,
disk marks) so give, per worker, the leading blocks it holds in each tier or a faster one:

    prompt   |<------------------------ num_prompt_tokens ------------------------>|
    device   |== device_blocks ==|
    host     |======== host_blocks =========|
    disk     |============== disk_blocks ===============|
             |  device tokens    | host seg |  disk seg  |  recomputed             |x|
                                                          the last token always ---^

A tier segment of t tokens is onloaded (read, verified, copied into the device cache) at
the tier's rate, or recomputed at the worker's prefill rate, whichever is faster: onloaded
it costs t x prefill_rate / tier_rate prefill-token equivalents (less than t), recomputed
it costs t. Each segment is weighed on its own (a host tier slower than recompute does not
stop a faster disk tier's blocks from counting). A worker without tiers publishes no marks,
so its host and disk counts equal its device count and it scores exactly as before.

An unknown prefill rate (0: the worker has not yet measured a prefill) gives nothing to
compare a tier's rate with, so its tier segments count as recomputed: such a worker scores as
it would without tiers (never better than it can show), until its first prefill measures
the rate. An unknown tier rate (0) counts likewise: no such tier.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple


@dataclass(frozen=True, slots=True)
class TierOverlap:
    """A worker's leading blocks of a prompt per tier, each counting the faster tiers too:
    held in its device cache, in host memory or the device, in any tier (disk included).

    Attributes:
        device_blocks: leading blocks in the device cache (the plain hashes' lookup).
        host_blocks: leading blocks in host memory or the device (>= device_blocks).
        disk_blocks: leading blocks in any tier (>= host_blocks).
    """

    device_blocks: int = 0
    host_blocks: int = 0
    disk_blocks: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.device_blocks <= self.host_blocks <= self.disk_blocks:
            raise ValueError(
                "TierOverlap needs 0 <= device_blocks <= host_blocks <= disk_blocks, got "
                f"{self.device_blocks}, {self.host_blocks}, {self.disk_blocks}"
            )

    @classmethod
    def of(cls, num_device: int, num_host_marks: int, num_disk_marks: int) -> TierOverlap:
        """From the three lookups' counts (plain hashes, host marks, disk marks), normalized
        so that each tier counts the faster ones: a block the device holds is servable from
        "host or above" even while the host mark's publication lags, and so on down."""
        host = max(num_device, num_host_marks)
        return cls(num_device, host, max(host, num_disk_marks))


class TierCost(NamedTuple):
    """What a worker would do with a prompt's tokens, and what that costs.

    device_tokens: served from its device cache; host_tokens, disk_tokens: onloaded from
    those tiers (0 where onloading does not pay); uncached_cost: the prompt's remaining
    work in prefill-token equivalents, recomputed tokens plus each onloaded segment's
    t x prefill_rate / tier_rate (== num_prompt_tokens - device_tokens without tier hits).
    """

    device_tokens: int
    host_tokens: int
    disk_tokens: int
    uncached_cost: float

    @property
    def tier_tokens(self) -> int:
        """Tokens onloaded from the host and disk tiers."""
        return self.host_tokens + self.disk_tokens


def tier_cost(
    overlap: TierOverlap,
    block_size: int,
    num_prompt_tokens: int,
    prefill_tokens_per_s: float,
    host_onload_tokens_per_s: float,
    disk_onload_tokens_per_s: float,
) -> TierCost:
    """The worker's split of the prompt between its tiers and recompute (module docstring).

    Args:
        overlap: the worker's leading blocks of the prompt per tier.
        block_size: tokens per KV block.
        num_prompt_tokens: the prompt's length; its last token is always computed.
        prefill_tokens_per_s: the worker's measured prefill rate (0 = unknown).
        host_onload_tokens_per_s, disk_onload_tokens_per_s: its tiers' onload rates (0 = no
            such tier or unknown).
    """
    limit = max(num_prompt_tokens - 1, 0)
    device = min(overlap.device_blocks * block_size, limit)
    host_end = min(overlap.host_blocks * block_size, limit)
    disk_end = min(overlap.disk_blocks * block_size, limit)
    host = _onloaded(host_end - device, prefill_tokens_per_s, host_onload_tokens_per_s)
    disk = _onloaded(disk_end - host_end, prefill_tokens_per_s, disk_onload_tokens_per_s)
    recomputed = num_prompt_tokens - device - host - disk
    cost: float = recomputed
    for tokens, rate in ((host, host_onload_tokens_per_s), (disk, disk_onload_tokens_per_s)):
        if tokens:
            cost += tokens * prefill_tokens_per_s / rate
    return TierCost(device, host, disk, cost)


def _onloaded(tokens: int, prefill_tokens_per_s: float, tier_tokens_per_s: float) -> int:
    """The segment's tokens if onloading them beats recomputing them, else 0."""
    if prefill_tokens_per_s > 0 and tier_tokens_per_s > prefill_tokens_per_s:
        return tokens
    return 0
