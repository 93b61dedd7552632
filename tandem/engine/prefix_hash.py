"""Chained 64-bit prefix hashes of KV blocks.

One function, shared by the router and every worker, so a hash computed anywhere names the
same block content everywhere. The hash of block i covers every token of blocks 0..i (through
the parent hash) plus the extra keys (model id, adapter, ...), so equal hashes mean equal
prefixes, not merely equal blocks.

    block 0            block 1            block 2
    [t0 .. t15]        [t16 .. t31]       [t32 .. t47]
    h0 = H(ROOT,k,b0)  h1 = H(h0,k,b1)    h2 = H(h1,k,b2)

H is BLAKE2b with an 8-byte digest over a fixed byte encoding: parent hash (8 bytes,
little-endian), length-prefixed extra keys (UTF-8), then the block's token ids as
little-endian uint32. Never Python's `hash()`: it is salted per process.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

# Parent of the first block. Distinct from any digest we would plausibly produce for a real
# parent only by convention; the chain is still unique because every block hash includes it.
ROOT_PARENT_HASH = 0
_HASH_DOMAIN = b"tandem.prefix.v1"


def _encode_extra_keys(extra_keys: Sequence[str]) -> bytes:
    parts = [struct.pack("<I", len(extra_keys))]
    for key in extra_keys:
        raw = key.encode("utf-8")
        parts.append(struct.pack("<I", len(raw)))
        parts.append(raw)
    return b"".join(parts)


def hash_block(parent_hash: int, token_ids: Sequence[int], extra_keys: Sequence[str] = ()) -> int:
    """Hash of one full block given its parent's hash.

    Args:
        parent_hash: hash of the previous block, or ROOT_PARENT_HASH for the first block.
        token_ids: the block's token ids (each in [0, 2**32)).
        extra_keys: strings that partition the cache (model id, adapter name, ...).

    Returns:
        An unsigned 64-bit integer.
    """
    if not 0 <= parent_hash < 2**64:
        raise ValueError(f"parent_hash must be an unsigned 64-bit int, got {parent_hash}")
    h = hashlib.blake2b(digest_size=8, person=_HASH_DOMAIN[:16])
    h.update(struct.pack("<Q", parent_hash))
    h.update(_encode_extra_keys(extra_keys))
    try:
        h.update(struct.pack(f"<{len(token_ids)}I", *token_ids))
    except struct.error as exc:
        raise ValueError(f"token ids must be in [0, 2**32): {exc}") from None
    return int.from_bytes(h.digest(), "little")


def hash_keys(model_id: str, cache_salt: str = "", kv_format: str = "") -> tuple[str, ...]:
    """The extra keys of a request's block hashes: the model, and its cache salt if any.
    Every party that hashes a prompt (router, prefill, decode, signature checks) uses this.

    `kv_format`: a scaled (FP8) cache's format (`tandem.quant.kv.kv_format`), "" for a
    cache in the model's dtype. It follows the salt, which is then always present, so the
    three-key form can never equal a two-key one: fp8 blocks never share a hash with bf16
    ones, nor with another tenant's salt.
    """
    if kv_format:
        return (model_id, cache_salt, "kv:" + kv_format)
    return (model_id, cache_salt) if cache_salt else (model_id,)


def kv_hash_format(kv_format: str) -> str:
    """The `hash_keys` kv_format of a worker advertising `kv_format`
    (`tandem.quant.kv.kv_format`): itself for a scaled (fp8) cache, whose format names
    its scales after a "/", and "" for a cache in the model's dtype (unchanged hashes)."""
    return kv_format if "/" in kv_format else ""


def hash_blocks(
    token_ids: Sequence[int],
    block_size: int,
    extra_keys: Sequence[str] = (),
    parent_hash: int = ROOT_PARENT_HASH,
) -> list[int]:
    """Hashes of every *full* block of `token_ids` (a trailing partial block is not hashed).

    `parent_hash` lets a caller extend an existing chain: pass the last hash it already has
    and only the tokens after it.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    hashes: list[int] = []
    parent = parent_hash
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[start : start + block_size], extra_keys)
        hashes.append(parent)
    return hashes


def state_mark(block_hash: int) -> int:
    """What a worker of a model with linear-attention layers publishes to the prefix index
    when it holds a state checkpoint right after the block `block_hash`
    (tandem.engine.state_checkpoints): a lookup with these marks counts a prefix only up to
    where the worker can resume it (`PrefixIndex.lookup`). Its own digest domain, so a mark
    never equals a block's hash."""
    h = hashlib.blake2b(digest_size=8, person=b"tandem.state.v1")
    h.update(struct.pack("<Q", block_hash))
    return int.from_bytes(h.digest(), "little")


def table_key(block_hash: int, table: int) -> int:
    """The prefix-cache key of a block of KV table `table` (tandem.model.layer_groups.KVLayout)
    holding the prompt block `block_hash`: the hash itself for table 0, else a digest in its
    own domain, so each table's pages are cached, hit and evicted on their own. A worker
    publishes table 0's keys and its first sliding table's to the prefix index, which counts
    a sliding model's prefix only where that table holds the window's blocks."""
    if table == 0:
        return block_hash
    h = hashlib.blake2b(digest_size=8, person=b"tandem.table.v1")
    h.update(struct.pack("<QI", block_hash, table))
    return int.from_bytes(h.digest(), "little")


# KV tiers a worker may hold a block in below its device cache (tandem.tiers), by speed.
HOST_TIER = 1
DISK_TIER = 2


def tier_mark(block_hash: int, tier: int) -> int:
    """What a worker with KV tiers publishes to the prefix index for a block it holds in
    `tier` (HOST_TIER, DISK_TIER) *or a faster one* (its device cache included), next to the
    block's hash, which it publishes while the device holds the block: a lookup of the chain
    of a tier's marks counts the leading blocks the worker can serve from that tier or
    above, so the router learns, per worker, how much of a prompt each tier would bring
    back (tandem.routing.tiers). Its own digest domain, so a mark never equals a block's
    hash or another tier's mark."""
    if tier not in (HOST_TIER, DISK_TIER):
        raise ValueError(f"tier must be {HOST_TIER} (host) or {DISK_TIER} (disk), got {tier!r}")
    h = hashlib.blake2b(digest_size=8, person=b"tandem.tier.v1")
    h.update(struct.pack("<QI", block_hash, tier))
    return int.from_bytes(h.digest(), "little")
