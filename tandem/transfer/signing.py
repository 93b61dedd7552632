"""Signed KV hand-offs: a handle names only blocks its owner computed for this very prompt.

A decode worker copies the blocks a handle names into its cache and publishes them in its
prefix cache. Unsigned, anyone who reaches a worker could hand it other KV for a prompt
(poisoning every later user of that prefix), read other users' blocks, or make it connect
anywhere. So the prefill worker signs each handle it grants, with a key derived from the
cluster secret, and the reader verifies before it reserves or reads anything:

    prefill worker                                   decode worker
    h = prompt_hashes(prompt, bs, keys)              h' = prompt_hashes(own prompt, bs, keys')
    sig = HMAC(key, msg(request id, h, handle))  ->  HMAC(key, msg(own request id, h', handle))
                                                     == sig, else PERMISSION_DENIED

The reader recomputes the hashes from its own request's tokens and cache salt, so a genuine
handle for prompt Q is refused for any other prompt P, another tenant, or another request id.
Every field of the handle is signed (block ids, addresses, the owner's identity and
incarnation, lease, layout), so no part of it can be altered either.

Canonical message (no two field lists encode alike: every variable-length field carries its
length, every integer is fixed width):

    "tandem.kv-handoff.v1"
    str(request_id) ints(block_hashes) ints(block_ids) u64(num_tokens) u64(block_size)
    str(lease_id) u64(epoch) f64(expires_at)
    str(owner_address) str(transport) str(agent_name) bytes(agent_metadata)
    u64(base_addr) u64(block_bytes)
    str(memory_type) u64(device_id) str(dtype) u64(num_layers) u64(layout block_size)
    u64(num_kv_heads) u64(head_dim) str(order)
    [f32s(k_scales) f32s(v_scales)]         only when the layout has scales (an fp8 cache)
    ["ranks" ints(base_addr, head_start, num_heads for each rank)]
                                            only for a tensor-parallel owner (`RemoteKV.ranks`):
                                            every rank's cache address and KV-head range
    ["sections" u32(count) (str(kind) str(format) u64(num_blocks) u64(num_bytes))*]
                                            only for a handle with typed sections
                                            (`tandem.transfer.sections`): a section dropped,
                                            cut short or relabelled fails verification

    bytes(b) = u32le(len(b)) || b     str(s) = bytes(utf8(s))
    ints(xs) = u32le(len(xs)) || u64le(x) for x in xs     f64 = IEEE 754 little-endian
    f32s(xs) = u32le(len(xs)) || f32le(x) for x in xs     (the fp8 cache's scales: a handle
    whose scales were altered, dropped or added fails verification)
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from collections.abc import Sequence

from tandem.engine.prefix_hash import ROOT_PARENT_HASH, hash_block, hash_blocks
from tandem.transfer.lease import KVHandoff
from tandem.transfer.sections import HandoffSection

_DOMAIN = b"tandem.kv-handoff.v1"


def prompt_hashes(
    prompt_token_ids: Sequence[int], block_size: int, extra_keys: Sequence[str]
) -> list[int]:
    """What a hand-off is signed over: the chained hashes of the prompt's full blocks (the
    prefix cache's own hashes, `prefix_hash.hash_blocks`) and, when the prompt ends inside a
    block, that partial block chained to them: its KV is handed off too, and joins the
    reader's cache once generated tokens fill the block, so every prompt token is covered.

    Args:
        extra_keys: `prefix_hash.hash_keys(model_id, cache_salt)`.
    """
    hashes = hash_blocks(prompt_token_ids, block_size, extra_keys)
    tail = prompt_token_ids[len(hashes) * block_size :]
    if tail:
        parent = hashes[-1] if hashes else ROOT_PARENT_HASH
        hashes.append(hash_block(parent, tail, extra_keys))
    return hashes


def _u64(value: int) -> bytes:
    try:
        return struct.pack("<Q", value)
    except struct.error:
        raise ValueError(f"{value!r} is not an unsigned 64-bit integer") from None


def _bytes(raw: bytes) -> bytes:
    return struct.pack("<I", len(raw)) + raw


def _str(text: str) -> bytes:
    return _bytes(text.encode("utf-8"))


def _ints(values: Sequence[int]) -> bytes:
    return struct.pack("<I", len(values)) + b"".join(_u64(v) for v in values)


def _f32s(values: Sequence[float]) -> bytes:
    return struct.pack(f"<I{len(values)}f", len(values), *values)


def handoff_message(request_id: str, block_hashes: Sequence[int], handoff: KVHandoff) -> bytes:
    """The canonical bytes signed for `handoff` (module docstring); its signature is not
    part of them. Raises ValueError for an integer outside [0, 2**64)."""
    remote, layout = handoff.remote, handoff.remote.layout
    scaled = bool(layout.k_scales or layout.v_scales)
    return b"".join(
        (
            _DOMAIN,
            _str(request_id),
            _ints(block_hashes),
            _ints(remote.block_ids),
            _u64(handoff.num_tokens),
            _u64(handoff.block_size),
            _str(handoff.lease_id),
            _u64(handoff.epoch),
            struct.pack("<d", handoff.expires_at),
            _str(handoff.owner_address),
            _str(remote.transport),
            _str(remote.agent_name),
            _bytes(remote.agent_metadata),
            _u64(remote.base_addr),
            _u64(remote.block_bytes),
            _str(layout.memory_type),
            _u64(layout.device_id),
            _str(layout.dtype),
            _u64(layout.num_layers),
            _u64(layout.block_size),
            _u64(layout.num_kv_heads),
            _u64(layout.head_dim),
            _str(layout.order),
            # Only for a scaled (fp8) cache: an unscaled hand-off signs the same bytes as
            # before the manifest existed.
            _f32s(layout.k_scales) + _f32s(layout.v_scales) if scaled else b"",
            # Only for a tensor-parallel owner: a single-rank hand-off signs the same bytes
            # as before ranks existed.
            _str("ranks")
            + _ints([x for r in remote.ranks for x in (r.base_addr, r.head_start, r.num_heads)])
            if remote.ranks
            else b"",
            _sections(handoff.sections) if handoff.sections else b"",
        )
    )


def _sections(sections: Sequence[HandoffSection]) -> bytes:
    return (
        _str("sections")
        + struct.pack("<I", len(sections))
        + b"".join(
            _str(s.kind) + _str(s.format) + _u64(s.num_blocks) + _u64(s.num_bytes) for s in sections
        )
    )


def sign_handoff(
    key: bytes, request_id: str, block_hashes: Sequence[int], handoff: KVHandoff
) -> bytes:
    """HMAC-SHA256 of `handoff` for the request `request_id` whose prompt hashes (see
    `prompt_hashes`) are `block_hashes`. `handoff.signature` is ignored.

    Raises:
        ValueError: an empty key, or an integer field outside [0, 2**64).
    """
    if not key:
        raise ValueError("the hand-off key must not be empty")
    message = handoff_message(request_id, block_hashes, handoff)
    return hmac.new(key, message, hashlib.sha256).digest()


def verify_handoff(
    key: bytes, request_id: str, block_hashes: Sequence[int], handoff: KVHandoff
) -> bool:
    """Whether `handoff.signature` is the owner's signature of `handoff` for this request and
    these prompt hashes (the reader's own). Constant-time; False for a missing signature."""
    if not handoff.signature:
        return False
    try:
        expected = sign_handoff(key, request_id, block_hashes, handoff)
    except ValueError:
        return False
    return hmac.compare_digest(expected, handoff.signature)
