"""plan_read: which of the owner's blocks a decode worker pulls, given its own cache."""

from __future__ import annotations

import pytest

from tandem.transfer import ReadPlan, TransferError, plan_read


def test_nothing_cached_reads_every_prompt_block() -> None:
    # 33 tokens of 16 = 3 blocks; the handle may carry more (never read past the prompt).
    plan = plan_read([7, 8, 9, 10], 16, [0, 1, 2], 0, 33, 16)
    assert plan == ReadPlan((7, 8, 9), (0, 1, 2))


def test_locally_cached_prefix_is_not_read() -> None:
    # 20 cached tokens = block 0 full (and part of block 1, which is read whole).
    assert plan_read([7, 8, 9], 16, [4, 5, 6], 20, 40, 16) == ReadPlan((8, 9), (5, 6))
    assert plan_read([7, 8, 9], 16, [4, 5, 6], 32, 40, 16) == ReadPlan((9,), (6,))


def test_fully_cached_prompt_reads_nothing() -> None:
    assert plan_read([7, 8], 16, [4, 5], 32, 32, 16) == ReadPlan((), ())


@pytest.mark.parametrize(
    ("handle_ids", "handle_block_size", "message"),
    [
        ([7, 8], 16, "KV handle has 2 blocks of 16 tokens; need 3 of 16"),
        ([7, 8, 9], 32, "KV handle has 3 blocks of 32 tokens; need 3 of 16"),
    ],
)
def test_a_handle_that_does_not_cover_the_prompt_is_a_transfer_error(
    handle_ids: list[int], handle_block_size: int, message: str
) -> None:
    with pytest.raises(TransferError, match=message):
        plan_read(handle_ids, handle_block_size, [0, 1, 2], 0, 40, 16)


def test_a_short_local_table_is_misuse() -> None:
    with pytest.raises(ValueError, match="local table has 2 blocks, need 3"):
        plan_read([7, 8, 9], 16, [0, 1], 0, 40, 16)
