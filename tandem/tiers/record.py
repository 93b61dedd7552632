"""A tier's block record: the bytes of one KV block bound to what they are.

    header (72 bytes)                                                         payload
    [magic 8 | identity 16 | key 8 | flags 4 | payload bytes 8 | pad 12 | digest 16] [...]

`identity` is a digest of everything that decides what a block's bytes mean (`identity`:
the model and its tokenizer, the KV dtype and format with its scales, the cache layout, the
tier format's version); `key` is the block's prefix-cache key (`prefix_hash.table_key` of its
chained hash, which already covers the model, the tenant's salt and every earlier token);
`digest` is an XXH3-128 of the identity, the key, the flags and the payload, in that order. A
record read back is served only if its magic, identity, key and length are the expected
ones and its digest matches its bytes: a flipped bit, a truncated file, a file of another
model, layout or version, or one renamed to another block's name is a miss, never KV.

Host-memory records keep the payload and its digest (the header is implied); disk files are
the whole record. Pure: no I/O.

XXH3, not a cryptographic hash: what it guards against is corruption (a flipped bit in memory
or on disk, a torn or truncated write) and confusion (another model's, layout's or block's
record), and it does so at memory speed (26 GB/s on one core of the CPU box against BLAKE2b's
0.5: BENCHMARKS.md "KV tiers"), so that verifying a block costs a fraction of copying it and a
tier hit still beats recomputing on a GPU. Anyone able to write the tier's directory can forge
any digest derivable from public inputs; the directory is the worker's own volume.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Mapping
from dataclasses import dataclass

import xxhash

MAGIC = b"TNDMKV\x00\x01"
# Bump when the payload's meaning changes for the same identity fields (the cache's byte
# order, what a record holds): every older record is then ignored.
FORMAT_VERSION = 1
_HEADER = struct.Struct("<8s16sQIQ12s16s")
HEADER_BYTES = _HEADER.size
FLAG_PUBLISHED = 1  # the block's key is told to the prefix index (`BlockPool.cache_block`)


def identity(fields: Mapping[str, object]) -> bytes:
    """A 16-byte digest of a tier's identity fields (str, int and nested lists of them),
    the format version included: two workers share records only if every field is equal."""
    body = json.dumps({"version": FORMAT_VERSION, **fields}, sort_keys=True, default=str)
    return hashlib.blake2b(body.encode(), digest_size=16, person=b"tandem.tierid").digest()


def digest(ident: bytes, key: int, flags: int, payload: memoryview | bytes) -> bytes:
    """The record digest (16 bytes): XXH3-128 of the identity, block key and flags, then
    the payload (so no field can be swapped under the same bytes)."""
    h = xxhash.xxh3_128()
    h.update(ident + struct.pack("<QI", key, flags))
    h.update(payload)
    return h.digest()


@dataclass(frozen=True, slots=True)
class Header:
    ident: bytes
    key: int
    flags: int
    payload_bytes: int
    digest: bytes

    def pack(self) -> bytes:
        return _HEADER.pack(
            MAGIC, self.ident, self.key, self.flags, self.payload_bytes, bytes(12), self.digest
        )


def seal(ident: bytes, key: int, flags: int, payload: memoryview | bytes) -> Header:
    """The header of a record of `payload` (its digest computed here)."""
    return Header(ident, key, flags, len(payload), digest(ident, key, flags, payload))


def parse_header(raw: bytes) -> Header | None:
    """The header at the start of `raw`, or None when it is too short or not a record."""
    if len(raw) < HEADER_BYTES:
        return None
    magic, ident, key, flags, size, _, dig = _HEADER.unpack_from(raw)
    if magic != MAGIC:
        return None
    return Header(ident, key, flags, size, dig)


def check(header: Header, ident: bytes, payload: memoryview | bytes, key: int | None = None) -> str:
    """Why a record must not be served ("" when it may): another identity, another key than
    `key` (when given), a length other than its header says, or bytes its digest does not
    match."""
    if header.ident != ident:
        return "written by another model, layout or format version"
    if key is not None and header.key != key:
        return f"holds block {header.key:016x}, not {key:016x}"
    if len(payload) != header.payload_bytes:
        return f"truncated: {len(payload)} of {header.payload_bytes} payload bytes"
    if digest(ident, header.key, header.flags, payload) != header.digest:
        return "its bytes do not match their digest"
    return ""
