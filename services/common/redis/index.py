"""`PrefixIndex` in Redis: one bitmask key per (model, block), one MGET per lookup.

This module holds `RedisPrefixIndex` and the client-side key material it derives per model;
the key layout and the Lua scripts that update it are in `scripts.py`, the lean RESP client
that lookups use is in `resp.py`.

Operations:

- `lookup`: ONE `MGET slotmap, key(chain[0]), ..., key(chain[-1])`. MGET is atomic, so the slot
  table always matches the bitmaps even while slots are being reused. The client then walks
  the bitmasks with a running AND of "workers still holding every block so far"; a worker's
  count is the index of the first block whose bit is clear. With marks, their keys follow
  the chain's in the same MGET, and `resumable_counts` cuts the counts back by their holders.
  The parsed slot table is cached by its raw bytes. The MGET goes through
  `resp.LookupClient` (plain asyncio streams and a RESP reader specialised for this reply),
  ~4x cheaper than redis-py's pure-Python parser.
- `apply`, `snapshot`, `remove_worker`: ONE `EVALSHA` each, of `APPLY_LUA`, `SNAPSHOT_LUA`
  and `REMOVE_LUA` (see `scripts.py`), so every update is atomic: a lookup sees a batch
  entirely or not at all. The scripts need a standalone Redis or Valkey (not a cluster) with
  the `noeviction` policy (the default); `scripts.py` says why.

Recovery: Redis is soft state. When it restarts empty, `tandem:index:workers` is gone, so each
worker's next batch finds no record and gets NEED_SNAPSHOT; its snapshot restores its
entries. Until then lookups return fewer hits, which only costs recomputation. The client
reconnects by itself (one immediate retry per command) and reloads the scripts (`NOSCRIPT`) on
first use. While Redis is unreachable every method raises `IndexUnavailable`.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Awaitable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from tandem.index.base import (
    MAX_WORKERS_PER_MODEL,
    ApplyResult,
    EventBatch,
    IndexFull,
    IndexUnavailable,
    PrefixIndex,
    check_hashes,
    check_marks,
    check_name,
    check_snapshot,
    resumable_counts,
)
from tandem.services.common.redis.resp import LookupClient
from tandem.services.common.redis.scripts import (
    APPLY_LUA,
    BLOCK_KEY_PREFIX,
    FULL,
    NAMESPACE,
    REMOVE_LUA,
    RESULT_OF_CODE,
    SNAPSHOT_LUA,
    WORKERS_KEY,
)
from tandem.services.common.redis.url import redact_url

T = TypeVar("T")

_TAG_PERSON = b"tandem.index.v1"  # BLAKE2b personalisation: at most 16 bytes


def model_tag(model: str) -> bytes:
    """The 8-byte tag naming `model` in keys."""
    return hashlib.blake2b(model.encode("utf-8"), digest_size=8, person=_TAG_PERSON).digest()


def _pack(hashes: tuple[int, ...]) -> list[bytes]:
    """Each (already validated) u64 hash as 8 bytes big-endian."""
    packed = struct.pack(f">{len(hashes)}Q", *hashes)
    return [packed[i : i + 8] for i in range(0, len(packed), 8)]


def _leading_counts(values: list[bytes | None], names: list[str]) -> dict[str, int]:
    """Per worker, the number of leading `values` (bitmaps, None for a missing key) that have
    its bit set, omitting workers with none. `names[s]` is the worker of slot s."""
    alive = _bitmap(values[0])
    if not alive:
        return {}
    counts: dict[str, int] = {}
    n = len(values)
    for i in range(1, n):
        lost = alive & ~_bitmap(values[i])
        if lost:
            alive ^= lost
            for worker in _workers(lost, names):
                counts[worker] = i
            if not alive:
                return counts
    for worker in _workers(alive, names):
        counts[worker] = n
    return counts


def _holders(raw: bytes | None, names: list[str]) -> set[str]:
    """The workers whose bits a block's bitmap (None: no key) has set."""
    return set(_workers(_bitmap(raw), names))


def _bitmap(raw: bytes | None) -> int:
    """A block's worker bitmap as a 64-bit int, None (no key) as 0. Slot s is bit 63 - s of
    the value read big-endian and padded to 8 bytes (SETBIT writes only as many bytes as the
    highest slot set needs)."""
    return int.from_bytes(raw, "big") << (64 - 8 * len(raw)) if raw else 0


def _workers(bits: int, names: list[str]) -> Iterator[str]:
    """The workers of the slots whose bits are set in `bits`. A bit without a name would be a
    slot freed while its bit stayed set, which the scripts never leave behind; it is skipped
    rather than a worker invented."""
    while bits:
        low = bits & -bits
        bits ^= low
        slot = 64 - low.bit_length()
        if slot < len(names) and names[slot]:
            yield names[slot]


@dataclass(frozen=True, slots=True)
class _ModelKeys:
    """The key material of one model, computed once."""

    tag_hex: str
    block_prefix: bytes  # b"tpx:" + tag
    slotmap_key: bytes
    # Pieces of a RESP MGET request, so that encoding a lookup is one bytes.join.
    item_open: bytes  # b"$20\r\n" + block_prefix
    item_sep: bytes  # b"\r\n" + item_open

    @classmethod
    def of(cls, model: str) -> _ModelKeys:
        tag = model_tag(model)
        prefix = BLOCK_KEY_PREFIX + tag
        item_open = b"$%d\r\n%s" % (len(prefix) + 8, prefix)
        return cls(
            tag_hex=tag.hex(),
            block_prefix=prefix,
            slotmap_key=f"{NAMESPACE}{tag.hex()}:slotmap".encode(),
            item_open=item_open,
            item_sep=b"\r\n" + item_open,
        )


class RedisPrefixIndex(PrefixIndex):
    """`PrefixIndex` in a standalone Redis/Valkey at `redis_url`; see the module docstring.

    `socket_timeout_s` bounds every command: a router on the request path would rather fall
    back to load-only routing than wait, so it is short by default. Client-level retries are
    one immediate reconnect (which rides out a pooled connection killed by a Redis restart).
    Failures raise `IndexUnavailable` with the cause chained.

    Updates go through redis-py (redis.asyncio). Lookups use `LookupClient`, a lean MGET
    over asyncio streams (AUTH and TLS as the URL says) ~4x cheaper than redis-py's parser
    without hiredis, unless `fast_lookup` is False or the URL needs more than it speaks
    (e.g. an `ssl_*` parameter it does not know): then redis-py too. Errors name the URL
    with its password redacted.

    The clients bind to the event loop they are first used in; create, use and `close()` the
    index inside one loop. Several indexes (routers, workers) may share one Redis.
    """

    def __init__(
        self, redis_url: str, *, socket_timeout_s: float = 0.5, fast_lookup: bool = True
    ) -> None:
        if socket_timeout_s <= 0:
            raise ValueError(f"socket_timeout_s must be > 0, got {socket_timeout_s}")
        self._url = redis_url
        self._redis = aioredis.Redis.from_url(
            redis_url,
            socket_timeout=socket_timeout_s,
            socket_connect_timeout=socket_timeout_s,
            retry=Retry(NoBackoff(), 1),
        )
        self._lookup_client = (
            LookupClient.for_url(redis_url, socket_timeout_s) if fast_lookup else None
        )
        self._apply_script = self._redis.register_script(APPLY_LUA)
        self._snapshot_script = self._redis.register_script(SNAPSHOT_LUA)
        self._remove_script = self._redis.register_script(REMOVE_LUA)
        self._models: dict[str, _ModelKeys] = {}
        self._slotmaps: dict[str, tuple[bytes, list[str]]] = {}  # model -> raw, parsed

    @property
    def redis_url(self) -> str:
        return self._url

    @property
    def fast_lookup(self) -> bool:
        """Whether lookups use the lean MGET client rather than redis-py."""
        return self._lookup_client is not None

    def _model_keys(self, model: str) -> _ModelKeys:
        keys = self._models.get(model)
        if keys is None:
            keys = self._models[model] = _ModelKeys.of(model)
        return keys

    async def _call(self, what: str, op: Awaitable[T]) -> T:
        try:
            return await op
        except (RedisError, OSError) as exc:
            where = redact_url(self._url)
            raise IndexUnavailable(f"prefix index {what} failed at {where}: {exc!r}") from exc

    async def apply(self, batch: EventBatch) -> ApplyResult:
        if not isinstance(batch, EventBatch):
            raise ValueError(f"batch must be an EventBatch, got {type(batch).__name__}")
        tag_hex = self._model_keys(batch.model).tag_hex
        args: list[Any] = [batch.worker_id, tag_hex, str(batch.epoch), str(batch.seq)]
        args.append(len(batch.stored))
        args += _pack(batch.stored)
        args += _pack(batch.removed)
        code = await self._call("apply", self._apply_script(args=args))
        return RESULT_OF_CODE[int(code)]

    async def snapshot(
        self, worker_id: str, model: str, epoch: int, seq: int, hashes: Iterable[int]
    ) -> ApplyResult:
        unique = check_snapshot(worker_id, model, epoch, seq, hashes)
        tag_hex = self._model_keys(model).tag_hex
        args: list[Any] = [worker_id, tag_hex, str(epoch), str(seq), *_pack(unique)]
        code = int(await self._call("snapshot", self._snapshot_script(args=args)))
        if code == FULL:
            raise IndexFull(
                f"model {model!r} already has {MAX_WORKERS_PER_MODEL} workers indexed, the "
                f"maximum; cannot add worker {worker_id!r}"
            )
        return RESULT_OF_CODE[code]

    async def lookup(
        self,
        model: str,
        chain: Sequence[int],
        marks: Sequence[int] | None = None,
        marks_from: Sequence[int] | None = None,
    ) -> dict[str, int]:
        check_name("model", model)
        checked = check_marks(chain, marks, marks_from)
        if not chain:
            return {}
        # struct checks the range itself, at a fraction of check_hashes' cost on this hot path;
        # check_hashes then only words the error (it also rejects bools, which struct takes).
        # The marks' keys are read in the same MGET, after the chain's.
        keyed = [*chain, *checked[0]] if checked is not None else chain
        try:
            packed = struct.pack(f">{len(keyed)}Q", *keyed)
        except struct.error:
            check_hashes("chain", chain)
            raise
        hashes = [packed[i : i + 8] for i in range(0, len(packed), 8)]
        mk = self._model_keys(model)
        values: list[bytes | None]
        if self._lookup_client is not None:
            payload = b"".join((
                b"*%d\r\n$4\r\nMGET\r\n$%d\r\n%s\r\n"
                % (len(hashes) + 2, len(mk.slotmap_key), mk.slotmap_key),
                mk.item_open,
                mk.item_sep.join(hashes),
                b"\r\n",
            ))  # fmt: skip
            values = await self._call("lookup", self._lookup_client.call(payload))
        else:
            keys = [mk.block_prefix + h for h in hashes]
            values = await self._call(
                "lookup", self._redis.execute_command("MGET", mk.slotmap_key, *keys)
            )
        raw_slotmap = values[0]
        if raw_slotmap is None:
            return {}  # no worker indexed for this model
        cached = self._slotmaps.get(model)
        if cached is None or cached[0] != raw_slotmap:
            cached = (raw_slotmap, raw_slotmap.decode("utf-8").split("\n"))
            self._slotmaps[model] = cached
        names, n = cached[1], len(chain)
        counts = _leading_counts(values[1 : 1 + n], names)
        if checked is None or not counts:
            return counts
        holders = [_holders(v, names) for v in values[1 + n :]]
        return resumable_counts(counts, holders, checked[1])

    async def remove_worker(self, worker_id: str) -> None:
        check_name("worker_id", worker_id)
        await self._call("remove_worker", self._remove_script(args=[worker_id]))

    async def workers(self) -> dict[str, tuple[int, int]]:
        # Replies are bytes: the client does not decode responses.
        raw: dict[Any, Any] = await self._call("workers", self._redis.hgetall(WORKERS_KEY))
        out: dict[str, tuple[int, int]] = {}
        for worker_id, record in raw.items():
            _, _, epoch, seq = record.split(b" ")  # "<tag> <slot> <epoch> <seq>"
            out[worker_id.decode("utf-8")] = (int(epoch), int(seq))
        return out

    async def close(self) -> None:
        if self._lookup_client is not None:
            await self._lookup_client.aclose()
        await self._redis.aclose()
