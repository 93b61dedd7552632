"""Signed KV hand-offs: a signature holds for exactly one request, prompt and handle."""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import hmac
import struct

import pytest

from tandem.engine.prefix_hash import hash_block, hash_blocks, hash_keys
from tandem.services.common.rpc import convert
from tandem.transfer import KVHandoff, KVLayout, RankKV, RemoteKV
from tandem.transfer.sections import HandoffSection
from tandem.transfer.signing import handoff_message, prompt_hashes, sign_handoff, verify_handoff

KEY = b"k" * 32
LAYOUT = KVLayout("DRAM", 0, "float32", 2, 4, 2, 8)
HANDOFF = KVHandoff(
    RemoteKV("nixl", "prefill-0", b"md", 4096, LAYOUT.block_bytes, (3, 4, 9), LAYOUT),
    4, 10, "127.0.0.1:5000", "lease-1", 1_700_000_000_000_000_000, 1.7e9,
)  # fmt: skip
PROMPT = list(range(5, 15))  # 10 tokens: 2 full blocks and a partial one
HASHES = prompt_hashes(PROMPT, 4, hash_keys("tiny"))
SIGNED = dataclasses.replace(HANDOFF, signature=sign_handoff(KEY, "r1", HASHES, HANDOFF))


def altered(obj, **changes):  # type: ignore[no-untyped-def]
    """A copy of a frozen dataclass with fields set, skipping __post_init__'s checks (a
    forger is not bound by them)."""
    new = copy.copy(obj)
    for name, value in changes.items():
        object.__setattr__(new, name, value)
    return new


def test_genuine_handoff_verifies() -> None:
    assert len(SIGNED.signature) == 32
    assert verify_handoff(KEY, "r1", HASHES, SIGNED)
    # Deterministic: the owner and any reader compute the same bytes.
    assert sign_handoff(KEY, "r1", HASHES, SIGNED) == SIGNED.signature


def test_encoding_is_pinned() -> None:
    """The module docstring's encoding, spelled out: changing it breaks mixed-version pairs."""

    def u32(v: int) -> bytes:
        return v.to_bytes(4, "little")

    def u64(v: int) -> bytes:
        return v.to_bytes(8, "little")

    def s(b: bytes) -> bytes:
        return u32(len(b)) + b

    def ints(xs: list[int]) -> bytes:
        return u32(len(xs)) + b"".join(u64(x) for x in xs)

    layout_fields = s(b"DRAM") + u64(0) + s(b"float32") + u64(2) + u64(4) + u64(2) + u64(8)
    expected = (
        b"tandem.kv-handoff.v1" + s(b"r1") + ints(HASHES) + ints([3, 4, 9]) + u64(10) + u64(4)
        + s(b"lease-1") + u64(1_700_000_000_000_000_000) + struct.pack("<d", 1.7e9)
        + s(b"127.0.0.1:5000") + s(b"nixl") + s(b"prefill-0") + s(b"md")
        + u64(4096) + u64(LAYOUT.block_bytes) + layout_fields + s(LAYOUT.order.encode())
    )  # fmt: skip
    assert handoff_message("r1", HASHES, HANDOFF) == expected
    assert SIGNED.signature == hmac.new(KEY, expected, hashlib.sha256).digest()


# Every field of the hand-off, its handle and the handle's layout, with another value.
HANDOFF_CHANGES = {
    "block_size": 8,
    "num_tokens": 9,
    "owner_address": "127.0.0.1:5001",
    "lease_id": "lease-2",
    "epoch": 1_700_000_000_000_000_001,
    "expires_at": 1.8e9,
    # typed sections added (each section's fields altered: test_handoff_sections.py)
    "sections": (HandoffSection("attention", "float32", 3),),
}
REMOTE_CHANGES = {
    "transport": "local",
    "agent_name": "prefill-1",
    "agent_metadata": b"mD",
    "base_addr": 4096 + LAYOUT.block_bytes,
    "block_bytes": LAYOUT.block_bytes * 2,
    "block_ids": (3, 4, 10),
    # A tensor-parallel owner's ranks added (altered ranks: tests/unit/test_transfer_ranks.py).
    "ranks": (RankKV(4096, 0, 1), RankKV(1 << 20, 1, 1)),
}
LAYOUT_CHANGES = {
    "memory_type": "VRAM",
    "device_id": 1,
    "dtype": "bfloat16",
    "num_layers": 3,
    "block_size": 8,
    "num_kv_heads": 1,
    "head_dim": 16,
    "order": "[other]",
    "k_scales": (1.0, 1.0),  # scales added to an unscaled handle (tests/unit/test_kv_fp8.py:
    "v_scales": (1.0, 1.0),  # a scaled handle's scales altered or dropped)
}


def test_the_changes_cover_every_field() -> None:
    """A field added to the handle later must be signed (and listed above)."""
    assert set(HANDOFF_CHANGES) | {"remote", "signature"} == {
        f.name for f in dataclasses.fields(KVHandoff)
    }
    assert set(REMOTE_CHANGES) | {"layout"} == {f.name for f in dataclasses.fields(RemoteKV)}
    assert set(LAYOUT_CHANGES) == {f.name for f in dataclasses.fields(KVLayout)}


@pytest.mark.parametrize(("name", "value"), HANDOFF_CHANGES.items())
def test_any_handoff_field_changed_fails(name, value) -> None:
    assert not verify_handoff(KEY, "r1", HASHES, altered(SIGNED, **{name: value}))


@pytest.mark.parametrize(("name", "value"), REMOTE_CHANGES.items())
def test_any_handle_field_changed_fails(name, value) -> None:
    forged = altered(SIGNED, remote=altered(SIGNED.remote, **{name: value}))
    assert not verify_handoff(KEY, "r1", HASHES, forged)


@pytest.mark.parametrize(("name", "value"), LAYOUT_CHANGES.items())
def test_any_layout_field_changed_fails(name, value) -> None:
    layout = altered(LAYOUT, **{name: value})
    forged = altered(SIGNED, remote=altered(SIGNED.remote, layout=layout))
    assert not verify_handoff(KEY, "r1", HASHES, forged)


@pytest.mark.parametrize(
    ("request_id", "hashes"),
    [
        ("r2", HASHES),  # another request
        ("r1 ", HASHES),
        ("r1", HASHES[:-1]),  # the partial block dropped
        ("r1", HASHES + [1]),
        ("r1", [HASHES[0] ^ 1, *HASHES[1:]]),
        ("r1", prompt_hashes([6, *PROMPT[1:]], 4, hash_keys("tiny"))),  # another prompt
        ("r1", prompt_hashes(PROMPT, 4, hash_keys("tiny", "tenant-a"))),  # another tenant
        ("r1", prompt_hashes(PROMPT, 4, hash_keys("other-model"))),
    ],
)
def test_another_request_or_prompt_fails(request_id, hashes) -> None:
    assert not verify_handoff(KEY, request_id, hashes, SIGNED)


def test_wrong_key_or_bad_signature_fails() -> None:
    assert not verify_handoff(b"K" * 32, "r1", HASHES, SIGNED)
    sig = SIGNED.signature
    for bad in (b"", sig[:-1], sig + b"\0", bytes([sig[0] ^ 1]) + sig[1:], b"\0" * 32):
        assert not verify_handoff(KEY, "r1", HASHES, altered(SIGNED, signature=bad))
    with pytest.raises(ValueError, match="key must not be empty"):
        sign_handoff(b"", "r1", HASHES, HANDOFF)


def test_field_boundaries_cannot_shift() -> None:
    """Length prefixes: moving bytes from one field into its neighbour changes the message."""

    def message(request_id, hashes, handoff) -> bytes:  # type: ignore[no-untyped-def]
        return handoff_message(request_id, hashes, handoff)

    # Adjacent strings ("ab" + "c" vs "a" + "bc").
    a = altered(HANDOFF, owner_address="ab", remote=altered(HANDOFF.remote, transport="c"))
    b = altered(HANDOFF, owner_address="a", remote=altered(HANDOFF.remote, transport="bc"))
    assert message("r1", HASHES, a) != message("r1", HASHES, b)
    c = altered(HANDOFF, remote=altered(HANDOFF.remote, agent_name="ab", agent_metadata=b"c"))
    d = altered(HANDOFF, remote=altered(HANDOFF.remote, agent_name="a", agent_metadata=b"bc"))
    assert message("r1", HASHES, c) != message("r1", HASHES, d)
    # Adjacent integer lists: block hashes then block ids.
    e = altered(HANDOFF, remote=altered(HANDOFF.remote, block_ids=(3,)))
    f = altered(HANDOFF, remote=altered(HANDOFF.remote, block_ids=(2, 3)))
    assert message("r1", [1, 2], e) != message("r1", [1], f)
    # The request id's bytes cannot stand in for the start of the hashes.
    assert message("r1", [], HANDOFF) != message("r", [], HANDOFF)
    for x, y in ((a, b), (c, d)):
        x_signed = altered(x, signature=sign_handoff(KEY, "r1", HASHES, x))
        assert not verify_handoff(KEY, "r1", HASHES, altered(y, signature=x_signed.signature))


def test_integers_out_of_range_are_refused() -> None:
    with pytest.raises(ValueError, match="not an unsigned 64-bit integer"):
        sign_handoff(KEY, "r1", [2**64], HANDOFF)
    assert not verify_handoff(KEY, "r1", [-1], SIGNED)


def test_prompt_hashes_cover_full_blocks_and_the_partial_one() -> None:
    keys = hash_keys("tiny")
    full = hash_blocks(PROMPT, 4, keys)
    assert HASHES == [*full, hash_block(full[-1], PROMPT[8:], keys)]
    assert prompt_hashes(PROMPT[:8], 4, keys) == full  # no partial block: the cache's hashes
    assert prompt_hashes(PROMPT[:3], 4, keys) == [hash_block(0, PROMPT[:3], keys)]
    # Prompts that differ only inside the last, partial block differ in the signed hashes.
    other = prompt_hashes(PROMPT[:-1] + [99], 4, keys)
    assert other[:2] == HASHES[:2] and other[2] != HASHES[2]


def test_signature_round_trips_through_the_proto() -> None:
    msg = convert.handoff_to_proto(SIGNED)
    assert msg.signature == SIGNED.signature
    back = convert.handoff_from_proto(msg)
    assert back == SIGNED and verify_handoff(KEY, "r1", HASHES, back)
    assert convert.handoff_from_proto(convert.handoff_to_proto(HANDOFF)).signature == b""
