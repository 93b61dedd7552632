"""Per-layer-group state (tandem.model.layer_groups): groups read from config.json's
layer_types, their bytes, the blocks a sliding window still reads, and the prefix-hit rule
across groups (a hit on one group but not another is a miss at that length)."""

from __future__ import annotations

from typing import Any

import pytest

from tandem.model.layer_groups import (
    KVTable,
    LayerGroup,
    LayerKind,
    layer_groups,
    linear_state_bytes,
    resumable_prefix,
    window_marks_from,
)

FULL, SLIDING, LINEAR = LayerKind.FULL, LayerKind.SLIDING, LayerKind.LINEAR
DENSE = {"num_hidden_layers": 4, "hidden_size": 64, "num_attention_heads": 4,
         "num_key_value_heads": 2}  # fmt: skip
NEXT = {"linear_num_key_heads": 16, "linear_num_value_heads": 32, "linear_key_head_dim": 128,
        "linear_value_head_dim": 128, "linear_conv_kernel_dim": 4}  # fmt: skip


def test_a_dense_config_is_one_full_group() -> None:
    (group,) = layer_groups(DENSE, dtype_bytes=2)
    assert group == LayerGroup(FULL, (0, 1, 2, 3), kv_token_bytes=2 * 2 * 16 * 2)


def test_alternating_sliding_and_full_layers() -> None:
    raw = {**DENSE, "sliding_window": 128, "head_dim": 64,
           "layer_types": ["sliding_attention", "full_attention"] * 2}  # fmt: skip
    sliding, full = layer_groups(raw, dtype_bytes=2)
    assert sliding == LayerGroup(SLIDING, (0, 2), 128, kv_token_bytes=2 * 2 * 64 * 2)
    assert full == LayerGroup(FULL, (1, 3), kv_token_bytes=2 * 2 * 64 * 2)


def test_linear_layers_keep_a_state_per_request() -> None:
    """Qwen3-Next's sizes: conv over q, k (16 heads x 128) and v (32 x 128) for 3 inputs, in
    the model's dtype, and a 128 x 128 float32 matrix per value head."""
    assert linear_state_bytes(NEXT, 2) == (2 * 16 * 128 + 32 * 128) * 3 * 2 + 32 * 128 * 128 * 4
    raw = {**DENSE, **NEXT, "layer_types": ["linear_attention"] * 3 + ["full_attention"]}
    linear, full = layer_groups(raw, dtype_bytes=2)
    assert linear.kind is LINEAR and linear.layers == (0, 1, 2)
    assert linear.request_bytes(1, 16) == linear.request_bytes(100_000, 16) == 3 * 2_146_304
    assert full.layers == (3,)


def test_the_families_default_configs_in_transformers() -> None:
    transformers = pytest.importorskip("transformers")
    counts = {}
    for name in ("GptOssConfig", "Gemma3TextConfig", "Qwen3NextConfig"):
        raw: dict[str, Any] = getattr(transformers, name)().to_dict()
        counts[name] = {g.kind.value: len(g.layers) for g in layer_groups(raw, 2)}
    assert counts == {
        "GptOssConfig": {"sliding_attention": 18, "full_attention": 18},
        "Gemma3TextConfig": {"sliding_attention": 22, "full_attention": 4},
        "Qwen3NextConfig": {"linear_attention": 36, "full_attention": 12},
    }


def test_sliding_layers_keep_only_the_pages_the_next_token_reads() -> None:
    """Window 4, blocks of 2: after 7 tokens the next one (position 7) reads positions 4-6,
    blocks 2 and 3; the full group keeps all four blocks."""
    sliding = LayerGroup(SLIDING, (0,), 4, kv_token_bytes=10)
    full = LayerGroup(FULL, (1, 2), kv_token_bytes=10)
    assert sliding.live_blocks(7, 2) == range(2, 4)
    assert sliding.live_blocks(3, 2) == range(0, 2)  # the window reaches back to position 0
    assert sliding.live_blocks(0, 2) == range(0)
    assert full.live_blocks(7, 2) == range(4)
    assert sliding.request_bytes(100, 2) == 2 * 2 * 10  # positions 97-99: blocks 48, 49
    assert full.request_bytes(100, 2) == 50 * 2 * 10 * 2


def test_window_marks_from_starts_where_the_next_tokens_window_does() -> None:
    """Window 8, blocks of 4: after n blocks the next token (position 4n) reads positions
    4n - 7 .. 4n, so from block (4n - 7) // 4 = n - 2 on, and block 0 while n <= 2."""
    assert window_marks_from(6, 8, 4) == (0, 0, 1, 2, 3, 4)
    # a window just past a block: positions 4n - 4 .. 4n, the last block alone
    assert window_marks_from(4, 5, 4) == (0, 1, 2, 3)
    # a window of 10 blocks and a bit: block 0 until the window leaves it
    assert window_marks_from(13, 42, 4) == (0,) * 10 + (0, 1, 2)
    assert window_marks_from(0, 8, 4) == ()
    for bad in ((3, 1, 4), (3, 8, 0), (-1, 8, 4)):
        with pytest.raises(ValueError, match="need window >= 2"):
            window_marks_from(*bad)


@pytest.mark.parametrize("block_size", [1, 3, 4, 16])
@pytest.mark.parametrize("window", [2, 3, 4, 5, 8, 17, 128])
def test_window_marks_from_agrees_with_the_tables_live_blocks(window: int, block_size: int) -> None:
    table = KVTable(SLIDING, (0, 1), window)
    marks_from = window_marks_from(40, window, block_size)
    for n in range(1, 41):
        live = table.live_blocks(n * block_size, block_size)
        assert live == range(marks_from[n - 1], n), (n, live)


def test_a_prefix_is_a_hit_only_where_every_group_resumes() -> None:
    groups = (LayerGroup(FULL, (0,)), LayerGroup(SLIDING, (1,), 4), LayerGroup(LINEAR, (2,)))
    full_blocks = set(range(5))  # 10 tokens in blocks of 2
    # every group holds what resuming at 10 needs: full 0-4, sliding 3-4 (positions 7-9)
    assert resumable_prefix(groups, {0: full_blocks, 1: {3, 4}}, {2: {10}}, 10, 2) == 10
    # the linear state only at 8: the hit is 8 if the window there (blocks 2-3) is held
    assert resumable_prefix(groups, {0: full_blocks, 1: {2, 3, 4}}, {2: {8, 6}}, 10, 2) == 8
    # a hit on full and linear but not on the sliding window: a miss at every length
    assert resumable_prefix(groups, {0: full_blocks, 1: {4}}, {2: {2, 4, 6, 8, 10}}, 10, 2) == 0
    # nothing past max_tokens, and no group at all cached
    assert resumable_prefix(groups, {0: full_blocks, 1: {3, 4}}, {2: {10}}, 9, 2) == 0
    assert resumable_prefix(groups, {}, {}, 10, 2) == 0
    dense = (LayerGroup(FULL, (0, 1)),)
    assert resumable_prefix(dense, {0: {0, 1, 2}}, {}, 10, 2) == 6


@pytest.mark.parametrize(
    ("raw", "match"),
    [({**DENSE, "layer_types": ["full_attention"] * 3}, "names 3 layers"),
     ({**DENSE, "layer_types": ["mamba"] * 4}, "unknown layer types"),
     ({**DENSE, "layer_types": ["sliding_attention"] * 4}, "need a sliding_window"),
     ({**DENSE, "layer_types": ["linear_attention"] * 4}, "need linear_num_key_heads")],
)  # fmt: skip
def test_configs_it_cannot_read(raw: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        layer_groups(raw, 2)
