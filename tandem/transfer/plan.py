"""Read planning on the decode side: which of an owner's blocks a reader pulls for a prompt.

A decode worker that already caches a prefix of the prompt reads only the blocks after it;
`plan_read` turns a handle's blocks and the reader's block table into that mapping, which
`KVTransport.read` then moves.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from tandem.transfer.base import TransferError


class ReadPlan(NamedTuple):
    """Which of an owner's blocks a reader pulls, and into which of its own blocks."""

    remote_block_ids: tuple[int, ...]
    local_block_ids: tuple[int, ...]


def plan_read(
    handle_block_ids: Sequence[int],
    handle_block_size: int,
    local_block_table: Sequence[int],
    num_cached_tokens: int,
    num_prompt_tokens: int,
    block_size: int,
    live: Sequence[range] | None = None,
) -> ReadPlan:
    """The blocks a decode worker must pull for a prompt, given what it already caches.

    The reader reserved `local_block_table` for the prompt and found its first
    `num_cached_tokens` in its own prefix cache; only the blocks after those are read:

        prompt blocks   [0 ........ first) [first ............ num_blocks)
                         cached locally      remote[i] -> local[i]

    With several KV tables (`live`: per table, the logical blocks a hand-off of the prompt
    moves, tandem.model.layer_groups.KVLayout.live_blocks) the handle names them table by
    table and the reader's table interleaves them (entry j * tables + t); each table's blocks
    from `first` on are read.

    Raises:
        TransferError: the handle does not cover the prompt with blocks of `block_size`
            tokens (the two workers disagree about the prompt or the cache layout).
    """
    if live is not None:
        return _plan_tables(handle_block_ids, handle_block_size, local_block_table,
                            num_cached_tokens, block_size, live)  # fmt: skip
    num_blocks = -(-num_prompt_tokens // block_size)
    if len(handle_block_ids) < num_blocks or handle_block_size != block_size:
        raise TransferError(
            f"KV handle has {len(handle_block_ids)} blocks of {handle_block_size} tokens; "
            f"need {num_blocks} of {block_size}"
        )
    if len(local_block_table) < num_blocks:
        raise ValueError(f"local table has {len(local_block_table)} blocks, need {num_blocks}")
    first = num_cached_tokens // block_size
    return ReadPlan(
        tuple(handle_block_ids[first:num_blocks]), tuple(local_block_table[first:num_blocks])
    )


def _plan_tables(
    handle_block_ids: Sequence[int],
    handle_block_size: int,
    local_block_table: Sequence[int],
    num_cached_tokens: int,
    block_size: int,
    live: Sequence[range],
) -> ReadPlan:
    need, k = sum(len(r) for r in live), len(live)
    if len(handle_block_ids) != need or handle_block_size != block_size:
        raise TransferError(
            f"KV handle has {len(handle_block_ids)} blocks of {handle_block_size} tokens; "
            f"need {need} of {block_size} ({k} tables)"
        )
    first = num_cached_tokens // block_size
    remote: list[int] = []
    local: list[int] = []
    i = 0
    for t, blocks in enumerate(live):
        for j in blocks:
            if j >= first:
                if j * k + t >= len(local_block_table) or local_block_table[j * k + t] < 0:
                    raise ValueError(f"local table holds no block {j} of table {t}")
                remote.append(handle_block_ids[i])
                local.append(local_block_table[j * k + t])
            i += 1
    return ReadPlan(tuple(remote), tuple(local))
