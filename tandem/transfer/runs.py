"""Block runs: a read's block mapping grouped into the transfer descriptors that move it.

A read copies owner block `remote_ids[i]` into reader block `local_ids[i]`. Where both sides
advance by one, consecutive pairs travel as one run `(remote_start, local_start, num_blocks)`,
i.e. one descriptor (one contiguous byte range on each side). Every transport's `_do_*` hooks
take these runs; plain and head-split reads (`tandem.transfer.ranks`) both build them here.
"""

from __future__ import annotations

from collections.abc import Sequence


def coalesce(remote_ids: Sequence[int], local_ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """Group a block mapping into runs that are consecutive on both sides.

    `remote_ids[i]` is copied to `local_ids[i]`. Returns `(remote_start, local_start, num_blocks)`
    runs, in input order, such that for each run block `remote_start + k` maps to
    `local_start + k` for `k < num_blocks`; a run only grows while *both* sides advance by one,
    so the result is one descriptor per run and the runs reproduce the mapping exactly.

    Raises:
        ValueError: the sequences differ in length.
    """
    if len(remote_ids) != len(local_ids):
        raise ValueError(
            f"remote_ids and local_ids differ in length: {len(remote_ids)} != {len(local_ids)}"
        )
    runs: list[tuple[int, int, int]] = []
    if not remote_ids:
        return runs
    run_remote, run_local, run_len = int(remote_ids[0]), int(local_ids[0]), 1
    for r, loc in zip(remote_ids[1:], local_ids[1:], strict=True):
        r, loc = int(r), int(loc)
        if r == run_remote + run_len and loc == run_local + run_len:
            run_len += 1
        else:
            runs.append((run_remote, run_local, run_len))
            run_remote, run_local, run_len = r, loc, 1
    runs.append((run_remote, run_local, run_len))
    return runs
