"""Prefix hashes are a wire contract: fixed test vectors, stable across processes."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tandem.engine.prefix_hash import ROOT_PARENT_HASH, hash_block, hash_blocks

# Changing any of these breaks every router/worker pair running mixed versions.
VECTORS = [
    (list(range(8)), 4, (), [842928951013875509, 13488342074359111695]),
    (list(range(8)), 4, ("model-a",), [10720060127238397466, 6981939670569071570]),
    (list(range(1, 17)), 16, ("llama",), [8201951769865077643]),
]


@pytest.mark.parametrize(("tokens", "block_size", "keys", "expected"), VECTORS)
def test_vectors(tokens, block_size, keys, expected) -> None:
    assert hash_blocks(tokens, block_size, keys) == expected


def test_single_block_vector() -> None:
    assert hash_block(ROOT_PARENT_HASH, [0] * 16) == 1187305763638096831


def test_chain_covers_the_whole_prefix() -> None:
    a = hash_blocks([1, 2, 3, 4, 5, 6, 7, 8], 4)
    b = hash_blocks([9, 2, 3, 4, 5, 6, 7, 8], 4)
    assert a[0] != b[0] and a[1] != b[1]  # same second block, different prefix


def test_partial_block_is_not_hashed_and_chain_extends() -> None:
    tokens = list(range(11))
    full = hash_blocks(tokens, 4)
    assert len(full) == 2
    head = hash_blocks(tokens[:4], 4)
    tail = hash_blocks(tokens[4:8], 4, parent_hash=head[-1])
    assert head + tail == full


def test_extra_keys_are_length_prefixed() -> None:
    # ("ab", "c") and ("a", "bc") must not collide.
    assert hash_blocks([1] * 4, 4, ("ab", "c")) != hash_blocks([1] * 4, 4, ("a", "bc"))


def test_bad_inputs_rejected() -> None:
    with pytest.raises(ValueError, match="block_size"):
        hash_blocks([1, 2], 0)
    with pytest.raises(ValueError, match="token ids"):
        hash_block(0, [-1])
    with pytest.raises(ValueError, match="parent_hash"):
        hash_block(-5, [1])


def test_same_value_in_another_process_with_other_hash_seed() -> None:
    code = (
        "from tandem.engine.prefix_hash import hash_blocks; print(hash_blocks(list(range(8)), 4))"
    )
    env = {**os.environ, "PYTHONHASHSEED": "12345"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(VECTORS[0][3])
