"""CUDA-graph bookkeeping for decode steps: capture sizes and the static, padded buffers."""

from __future__ import annotations

import pytest
import torch

from tandem.engine.cuda_graphs import (
    MAX_CAPTURE_SIZE,
    DecodeBuffers,
    DecodeGraphs,
    capture_sizes,
    graph_size_for,
)

CPU = torch.device("cpu")
PAD = 9  # the padding block id in these tests


def make_buffers(num_rows: int = 4, max_blocks: int = 3) -> DecodeBuffers:
    return DecodeBuffers(num_rows, max_blocks, padding_block_id=PAD, device=CPU)


def i64(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64, device=CPU)


def fill_rows(buffers: DecodeBuffers, size: int, tables: list[list[int]]) -> None:
    """Fill len(tables) real rows, row i with ids 100+i, position 10+i, slot (50+i, i),
    context length 11+i."""
    n = len(tables)
    buffers.fill(
        size,
        input_ids=i64([100 + i for i in range(n)]),
        positions=i64([10 + i for i in range(n)]),
        slot_block_ids=i64([50 + i for i in range(n)]).view(1, n),
        slot_offsets=i64(list(range(n))),
        block_tables=torch.tensor(tables, dtype=torch.int64, device=CPU).view(n, -1),
        context_lens=i64([11 + i for i in range(n)]),
    )


def test_capture_sizes_small() -> None:
    assert capture_sizes(1) == (1,)
    assert capture_sizes(3) == (1, 2, 3)
    assert capture_sizes(8) == (1, 2, 4, 8)
    assert capture_sizes(12) == (1, 2, 4, 8, 12)
    assert capture_sizes(64) == (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64)


def test_capture_sizes_end_at_max_num_seqs_between_grid_points() -> None:
    assert capture_sizes(100) == (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 100)


def test_capture_sizes_capped() -> None:
    up_to_64 = (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64)
    full = up_to_64 + (80, 96, 112, 128, 144, 160, 176, 192, 208, 224, 240, 256)
    assert MAX_CAPTURE_SIZE == 256
    assert capture_sizes(256) == full
    assert capture_sizes(1000) == full
    assert len(full) == 23


def test_capture_sizes_rejects_non_positive() -> None:
    with pytest.raises(ValueError, match="max_num_seqs must be positive, got 0"):
        capture_sizes(0)


def test_graph_size_for() -> None:
    sizes = capture_sizes(256)
    batches = (1, 2, 3, 4, 5, 8, 9, 64, 65, 81, 256)
    expected = [1, 2, 4, 4, 8, 8, 16, 64, 80, 96, 256]
    assert [graph_size_for(b, sizes) for b in batches] == expected
    assert graph_size_for(257, sizes) is None
    assert graph_size_for(3, (1, 2, 3)) == 3
    assert graph_size_for(4, (1, 2, 3)) is None
    with pytest.raises(ValueError, match="batch must be positive, got 0"):
        graph_size_for(0, sizes)


def test_new_buffers_are_all_padding() -> None:
    b = make_buffers()
    assert b.input_ids.tolist() == [0, 0, 0, 0]
    assert b.positions.tolist() == [0, 0, 0, 0]
    assert b.slot_block_ids.tolist() == [[PAD] * 4]
    assert b.slot_offsets.tolist() == [0, 0, 0, 0]
    assert b.block_tables.tolist() == [[PAD] * 3] * 4
    assert b.context_lens.tolist() == [1, 1, 1, 1]


def test_buffer_dtypes_and_shapes() -> None:
    b = make_buffers(num_rows=5, max_blocks=7)
    for t in (b.input_ids, b.positions, b.slot_offsets):
        assert t.dtype == torch.int64 and t.shape == (5,)
    assert b.slot_block_ids.dtype == torch.int64 and b.slot_block_ids.shape == (1, 5)
    assert b.block_tables.dtype == torch.int32 and b.block_tables.shape == (5, 7)
    assert b.context_lens.dtype == torch.int32 and b.context_lens.shape == (5,)
    assert b.input_ids.device == CPU


def test_fill_copies_real_rows_and_pads_the_rest() -> None:
    b = make_buffers()
    fill_rows(b, 4, [[3, 4], [5, 6]])
    assert b.input_ids.tolist() == [100, 101, 0, 0]
    assert b.positions.tolist() == [10, 11, 0, 0]
    assert b.slot_block_ids.tolist() == [[50, 51, PAD, PAD]]
    assert b.slot_offsets.tolist() == [0, 1, 0, 0]
    # Real rows: their tables, then the padding block; padding rows: all padding block.
    assert b.block_tables.tolist() == [[3, 4, PAD], [5, 6, PAD], [PAD] * 3, [PAD] * 3]
    assert b.context_lens.tolist() == [11, 12, 1, 1]
    assert b.block_tables.dtype == torch.int32  # int64 input converted on copy


def test_fill_full_width_and_full_size() -> None:
    b = make_buffers(num_rows=2, max_blocks=3)
    fill_rows(b, 2, [[1, 2, 3], [4, 5, 6]])
    assert b.block_tables.tolist() == [[1, 2, 3], [4, 5, 6]]
    assert b.context_lens.tolist() == [11, 12]


def test_fill_overwrites_the_previous_batch() -> None:
    b = make_buffers()
    fill_rows(b, 4, [[3, 4, 7], [5, 6, 8], [1, 2, 0]])
    fill_rows(b, 4, [[2]])
    assert b.input_ids.tolist() == [100, 0, 0, 0]
    assert b.slot_block_ids.tolist() == [[50, PAD, PAD, PAD]]
    assert b.block_tables.tolist() == [[2, PAD, PAD], [PAD] * 3, [PAD] * 3, [PAD] * 3]
    assert b.context_lens.tolist() == [11, 1, 1, 1]


def test_fill_leaves_rows_beyond_size_untouched() -> None:
    b = make_buffers()
    fill_rows(b, 4, [[3], [4], [5], [6]])
    fill_rows(b, 2, [[7]])
    # Rows 2 and 3 are outside the size-2 graph: they keep the previous batch.
    assert b.input_ids.tolist() == [100, 0, 102, 103]
    assert b.block_tables.tolist() == [[7, PAD, PAD], [PAD] * 3, [5, PAD, PAD], [6, PAD, PAD]]
    assert b.context_lens.tolist() == [11, 1, 13, 14]


def test_fill_with_no_rows_pads_everything_up_to_size() -> None:
    b = make_buffers()
    fill_rows(b, 4, [[3], [4], [5], [6]])
    empty, no_slots = i64([]), torch.zeros(1, 0, dtype=torch.int64, device=CPU)
    b.fill(
        3, empty, empty, no_slots, empty, torch.zeros(0, 0, dtype=torch.int64, device=CPU), empty
    )
    assert b.input_ids.tolist() == [0, 0, 0, 103]
    assert b.context_lens.tolist() == [1, 1, 1, 14]


def test_reset_pads_every_row() -> None:
    b = make_buffers()
    fill_rows(b, 4, [[3], [4], [5], [6]])
    b.reset()
    assert b.input_ids.tolist() == [0] * 4
    assert b.positions.tolist() == [0] * 4
    assert b.slot_block_ids.tolist() == [[PAD] * 4]
    assert b.slot_offsets.tolist() == [0] * 4
    assert b.block_tables.tolist() == [[PAD] * 3] * 4
    assert b.context_lens.tolist() == [1] * 4


def test_views_share_storage_with_the_buffers() -> None:
    b = make_buffers()
    v = b.views(2)
    assert v.input_ids.shape == (2,)
    assert v.block_tables.shape == (2, 3)
    pairs = [
        (v.input_ids, b.input_ids),
        (v.positions, b.positions),
        (v.slot_block_ids, b.slot_block_ids),
        (v.slot_offsets, b.slot_offsets),
        (v.block_tables, b.block_tables),
        (v.context_lens, b.context_lens),
    ]
    for view, buf in pairs:
        assert view.data_ptr() == buf.data_ptr()
    # A fill after the views were taken (as before a replay) is what the views read.
    fill_rows(b, 2, [[3, 4]])
    assert v.input_ids.tolist() == [100, 0]
    assert v.positions.tolist() == [10, 0]
    assert v.slot_block_ids.tolist() == [[50, PAD]]
    assert v.slot_offsets.tolist() == [0, 0]
    assert v.block_tables.tolist() == [[3, 4, PAD], [PAD] * 3]
    assert v.context_lens.tolist() == [11, 1]
    b.input_ids[1] = 42
    assert v.input_ids.tolist() == [100, 42]


def test_views_rejects_sizes_outside_the_buffers() -> None:
    b = make_buffers()
    with pytest.raises(ValueError, match=r"size 5 is outside 1\.\.4"):
        b.views(5)
    with pytest.raises(ValueError, match=r"size 0 is outside 1\.\.4"):
        b.views(0)


def test_fill_refuses_more_rows_than_size() -> None:
    b = make_buffers()
    with pytest.raises(ValueError, match="batch of 3 rows does not fit a graph of size 2"):
        fill_rows(b, 2, [[1], [2], [3]])
    with pytest.raises(ValueError, match=r"size 5 is outside 1\.\.4"):
        fill_rows(b, 5, [[1]])


def test_fill_refuses_tables_wider_than_max_blocks() -> None:
    b = make_buffers()
    with pytest.raises(ValueError, match="block tables are 4 blocks wide, max_blocks is 3"):
        fill_rows(b, 4, [[1, 2, 3, 4]])


def test_fill_refuses_rows_of_differing_lengths() -> None:
    b = make_buffers()
    two, three, slots = i64([1, 2]), i64([1, 2, 3]), i64([1, 2]).view(1, 2)
    table = torch.zeros(2, 1, dtype=torch.int64, device=CPU)
    with pytest.raises(ValueError, match=r"positions has shape \(3,\), expected \(2,\)"):
        b.fill(4, two, three, slots, two, table, two)
    with pytest.raises(ValueError, match=r"context_lens has shape \(3,\), expected \(2,\)"):
        b.fill(4, two, two, slots, two, table, three)
    with pytest.raises(ValueError, match=r"slot_block_ids has shape \(2,\), expected \(1, 2\)"):
        b.fill(4, two, two, two, two, table, two)
    bad_table = torch.zeros(3, 1, dtype=torch.int64, device=CPU)
    with pytest.raises(ValueError, match=r"block_tables has shape \(3, 1\), expected \(2, width\)"):
        b.fill(4, two, two, slots, two, bad_table, two)


def test_several_kv_tables_interleave_in_each_row() -> None:
    """A layout of two KV tables (full, sliding): rows twice as wide, a slot block per
    table per row, every table's padding the padding block."""
    b = DecodeBuffers(3, 2, padding_block_id=PAD, device=CPU, num_tables=2)
    assert b.block_tables.shape == (3, 4) and b.slot_block_ids.shape == (2, 3)
    slots = torch.tensor([[50, 51], [60, 61]], dtype=torch.int64)
    tables = torch.tensor([[1, 2, 3, 4], [5, 6, 0, 0]], dtype=torch.int64)
    b.fill(3, i64([7, 8]), i64([1, 2]), slots, i64([0, 1]), tables, i64([2, 3]))
    assert b.slot_block_ids.tolist() == [[50, 51, PAD], [60, 61, PAD]]
    assert b.block_tables.tolist() == [[1, 2, 3, 4], [5, 6, 0, 0], [PAD] * 4]
    assert b.views(2).slot_block_ids.tolist() == [[50, 51], [60, 61]]
    with pytest.raises(ValueError, match=r"expected \(2, 2\)"):
        b.fill(3, i64([7, 8]), i64([1, 2]), slots[:1], i64([0, 1]), tables, i64([2, 3]))


def test_a_refused_fill_changes_nothing() -> None:
    b = make_buffers()
    fill_rows(b, 4, [[3], [4]])
    before = [t.clone() for t in b.views(4)]
    with pytest.raises(ValueError):
        fill_rows(b, 4, [[1, 2, 3, 4]])
    assert all(torch.equal(x, y) for x, y in zip(before, b.views(4), strict=True))


@pytest.mark.parametrize(
    ("num_rows", "max_blocks", "pad", "message"),
    [
        (0, 3, 9, "num_rows must be positive, got 0"),
        (4, 0, 9, "max_blocks must be positive, got 0"),
        (4, 3, -1, "padding_block_id must be >= 0, got -1"),
    ],
)
def test_buffers_reject_bad_config(num_rows: int, max_blocks: int, pad: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        DecodeBuffers(num_rows, max_blocks, padding_block_id=pad, device=CPU)


def test_graphs_need_cuda() -> None:
    with pytest.raises(ValueError, match="CUDA graphs need a CUDA device; the buffers are on cpu"):
        DecodeGraphs(make_buffers(), capture_sizes(4))


@pytest.mark.parametrize(
    ("overrides", "paged", "wanted"),
    [
        (dict(device="cuda"), True, True),
        (dict(device="cuda:1", role="decode"), True, True),
        (dict(device="cuda", role="prefill"), True, False),  # hands off, never decodes
        (dict(device="cuda"), False, False),  # TorchAttention's grids follow the values
        (dict(device="cuda", cuda_graphs=False), True, False),
        (dict(device="cpu"), True, False),
    ],
)
def test_which_engines_capture_decode_graphs(
    overrides: dict[str, object], paged: bool, wanted: bool
) -> None:
    from tandem.config import EngineConfig
    from tandem.engine.engine import wants_decode_graphs

    config = EngineConfig(model_dir="m", **overrides)  # type: ignore[arg-type]
    assert wants_decode_graphs(config, paged) is wanted
