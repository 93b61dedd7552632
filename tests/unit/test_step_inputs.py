"""The persistent block tables and the staged copy of a step's arrays (tandem.engine.
step_inputs), exact; and the runner's Triton path building no TorchAttention metadata."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tandem.engine.step_inputs import BlockTables, HostStaging

CPU = torch.device("cpu")


def step(tables: BlockTables, *requests: tuple[str, tuple[int, ...]]) -> list[int]:
    """Assign rows as a step would, apply the writes, return the rows."""
    rows = [tables.row(rid, blocks) for rid, blocks in requests]
    tables.apply(*(torch.tensor(w, dtype=torch.int64) for w in tables.take_writes()))
    return rows


def test_a_new_request_writes_its_whole_table() -> None:
    tables = BlockTables(max_blocks=4, device=CPU)
    assert tables.row("a", (7, 2)) == 0
    assert tables.row("b", (4,)) == 1
    assert tables.take_writes() == ([0, 0, 1], [0, 1, 0], [7, 2, 4])


def test_a_decode_step_writes_only_what_changed() -> None:
    tables = BlockTables(max_blocks=4, device=CPU)
    step(tables, ("a", (7, 2)))
    assert tables.row("a", (7, 2)) == 0
    assert tables.take_writes() == ([], [], [])  # same blocks: nothing to write
    tables.row("a", (7, 2, 9))
    assert tables.take_writes() == ([0], [2], [9])  # one new block


def test_a_changed_table_is_rewritten() -> None:
    # Preempted, then resumed on other blocks: the row no longer holds a prefix of them.
    tables = BlockTables(max_blocks=4, device=CPU)
    step(tables, ("a", (7, 2, 9)))
    tables.row("a", (3, 5))
    assert tables.take_writes() == ([0, 0], [0, 1], [3, 5])


def test_the_device_table_holds_every_live_row() -> None:
    tables = BlockTables(max_blocks=4, device=CPU)
    step(tables, ("a", (7, 2)), ("b", (4,)))
    step(tables, ("a", (7, 2, 9)), ("b", (4, 1)))
    assert tables.table[0, :3].tolist() == [7, 2, 9]
    assert tables.table[1, :2].tolist() == [4, 1]


def test_a_released_row_is_reused_and_rewritten() -> None:
    tables = BlockTables(max_blocks=4, device=CPU)
    step(tables, ("a", (7, 2)), ("b", (4,)))
    tables.release("a")
    tables.release("never-seen")  # nothing
    assert tables.request_ids() == {"b"}
    assert tables.row("c", (7, 2)) == 0  # a's old row, written again for c
    assert tables.take_writes() == ([0, 0], [0, 1], [7, 2])


def test_the_table_grows_keeping_its_rows() -> None:
    tables = BlockTables(max_blocks=2, device=CPU)
    n = tables.table.shape[0]
    rows = step(tables, *((f"r{i}", (i,)) for i in range(n + 1)))
    assert rows == list(range(n + 1))
    assert tables.table.shape == (2 * n, 2)
    assert tables.table[: n + 1, 0].tolist() == list(range(n + 1))


def test_staging_sends_every_array_as_views_of_one_tensor() -> None:
    ids, positions, empty = HostStaging(CPU).send([[5, 6, 7], [0, 1, 2], []])
    assert ids.tolist() == [5, 6, 7] and positions.tolist() == [0, 1, 2] and empty.numel() == 0
    assert ids.dtype == torch.int64
    assert ids.untyped_storage().data_ptr() == positions.untyped_storage().data_ptr()


def test_the_triton_path_builds_no_torch_metadata(
    tiny_model_dir: Path, engine_factory: Any
) -> None:
    """A step with decode rows and a prefill chunk: the Triton backend gets the paged batch
    only (no masks, groups or spans), from the persistent table; the torch backend gets its
    groups and spans and no paged batch."""
    from tandem.engine.sampling import SamplingParams

    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    for backend in ("triton", "torch"):
        engine = engine_factory(
            tiny_model_dir, block_size=16, num_blocks=16, attention_backend=backend
        )
        engine.add_request(engine.spec("a", list(range(5, 25)), params))
        engine.add_request(engine.spec("b", list(range(30, 37)), params))
        engine.step()  # both prefilled
        engine.add_request(engine.spec("c", list(range(40, 60)), params))
        out = engine.scheduler.schedule()
        meta = engine.runner.prepare(out).meta
        if backend == "triton":
            assert meta.decode_groups == [] and meta.prefills == []
            paged = meta.paged
            assert paged is not None and paged.num_decode == 2
            assert paged.decode_context_lens.tolist() == [21, 8]  # longest first
            assert paged.max_decode_context_len == 21
            assert paged.prefill_block_tables[0, :2].tolist() == list(engine.block_table("c"))
            assert engine.runner.block_tables.request_ids() == {"a", "b", "c"}
        else:
            assert meta.paged is None
            assert len(meta.decode_groups) == 1 and len(meta.prefills) == 1


def test_finished_and_aborted_requests_free_their_rows(
    tiny_model_dir: Path, engine_factory: Any
) -> None:
    from tandem.engine.sampling import SamplingParams

    engine = engine_factory(
        tiny_model_dir, block_size=16, num_blocks=16, attention_backend="triton"
    )
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    engine.add_request(engine.spec("kept", [5, 6, 7], params))
    engine.add_request(engine.spec("aborted", [8, 9], params))
    engine.step()
    assert engine.runner.block_tables.request_ids() == {"kept", "aborted"}
    engine.abort("aborted")
    engine.check_integrity()  # rows only for live requests
    while engine.has_unfinished():
        engine.step()
    assert engine.runner.block_tables.request_ids() == set()
