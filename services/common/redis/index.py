"""`PrefixIndex` in Redis: one bitmask key per (model, block), one MGET per lookup.

Key layout (T = the model's tag: the first 8 bytes of BLAKE2b(model), written as 16 hex digits
in text keys; 2**-64 collision odds make a name registry unnecessary):

    tpx:<T as 8 raw bytes><block hash as 8 bytes big-endian>      (20-byte binary key)
        string: bitmap of the workers holding the block, slot s = bit s (SETBIT order, so the
        value read as a big-endian number has slot s at bit 63 - s); absent when no worker
        holds it (emptied keys are deleted, so the key count equals the distinct blocks).
    tandem:index:workers                     hash: worker_id -> "<T hex> <slot> <epoch> <seq>"
    tandem:index:<T hex>:slots               hash: slot (0..63) -> worker_id
    tandem:index:<T hex>:slotmap             string: worker ids by slot, joined by "\\n" ("" for
                                             a free slot); derived from `slots`
    tandem:index:<T hex>:blocks:<worker_id>  set: the worker's hashes (8 bytes big-endian), so
                                             removing or replacing a worker needs no scan
    tandem:index:<T hex>:staging:<worker_id> set: transient, inside the snapshot script only

Operations:

- `lookup`: ONE `MGET slotmap, key(chain[0]), ..., key(chain[-1])`. MGET is atomic, so the slot
  table always matches the bitmaps even while slots are being reused. The client then walks
  the bitmasks with a running AND of "workers still holding every block so far"; a worker's
  count is the index of the first block whose bit is clear. The parsed slot table is cached
  by its raw bytes. The MGET goes through `_LookupClient` (plain asyncio streams and a RESP
  reader specialised for this reply), ~4x cheaper than redis-py's pure-Python parser.
- `apply`: ONE `EVALSHA` of `_APPLY`: check the worker's model, epoch and seq, then per stored
  hash SADD to the worker's set and (if new) SETBIT; per removed hash SREM and (if it was
  there) clear the bit, deleting the key when no bit is left (BITCOUNT 0); record the seq.
  A newer epoch drops the worker (as `remove_worker`) and answers NEED_SNAPSHOT.
- `snapshot`: ONE `EVALSHA` of `_SNAPSHOT`: staleness check, a slot (HSETNX over 0..63; slots
  of removed workers are reused) when the worker is new to the model, then the new set goes
  into a staging set and only the difference is applied (SDIFF both ways), so blocks the
  worker keeps never disappear from lookups; the staging set becomes the worker's set.
- `remove_worker`: ONE `EVALSHA` of `_REMOVE`: clear its bit from every key in its set, free
  its slot, forget its seq.

Every update is one Lua script, so it is atomic: a lookup sees a batch entirely or not at all.
The scripts name keys they derive (a worker's blocks), so this needs a standalone Redis or
Valkey, not a cluster. A script costs a few microseconds per block it touches, and Redis runs
nothing else meanwhile: an event batch is cheap, but snapshotting or removing a worker with
20k cached blocks holds Redis for ~50-130 ms on the 2-core benchmark machine
(benchmarks/bench_index.py); lookups wait that long. Splitting those into chunks is future
work.

Recovery: Redis is soft state. When it restarts empty, `tandem:index:workers` is gone, so each
worker's next batch finds no record and gets NEED_SNAPSHOT; its snapshot restores its
entries. Until then lookups return fewer hits, which only costs recomputation. The client
reconnects by itself (one immediate retry per command) and reloads the scripts (`NOSCRIPT`) on
first use. While Redis is unreachable every method raises `IndexUnavailable`.
Under a `maxmemory` eviction policy other than `noeviction`, evicted bitmap keys only hide
hits, but an evicted worker set leaves bits that `remove_worker` cannot find, so run the
index's Redis with `noeviction` (the default).
"""

from __future__ import annotations

import asyncio
import hashlib
import struct
from collections.abc import Awaitable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import redis.asyncio as aioredis
from redis.asyncio.connection import UnixDomainSocketConnection, parse_url
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError, ResponseError

from tandem.index.base import (
    MAX_WORKERS_PER_MODEL,
    ApplyResult,
    EventBatch,
    IndexFull,
    IndexUnavailable,
    PrefixIndex,
    check_hashes,
    check_name,
    check_snapshot,
)

T = TypeVar("T")

NAMESPACE = "tandem:index:"
WORKERS_KEY = NAMESPACE + "workers"
BLOCK_KEY_PREFIX = b"tpx:"
_TAG_PERSON = b"tandem.index.v1"  # BLAKE2b personalisation: at most 16 bytes

# Script return codes.
_APPLIED, _DUPLICATE, _NEED_SNAPSHOT, _FULL = 0, 1, 2, 3
_RESULTS = {
    _APPLIED: ApplyResult.APPLIED,
    _DUPLICATE: ApplyResult.DUPLICATE,
    _NEED_SNAPSHOT: ApplyResult.NEED_SNAPSHOT,
}

# Shared by the scripts. Epochs (ns timestamps) exceed 2^53, which Lua's doubles hold exactly,
# so they stay decimal strings and are compared as such; numbers that are written back (seq,
# slot) are kept as the strings they came in as, because Lua prints large doubles as 1e+15.
_LUA_PRELUDE = f"""
local NS = '{NAMESPACE}'
local WORKERS = '{WORKERS_KEY}'
local BLOCK_PREFIX = '{BLOCK_KEY_PREFIX.decode()}'
local MAX_SLOTS = {MAX_WORKERS_PER_MODEL}
local APPLIED, DUPLICATE, NEED_SNAPSHOT, FULL = {_APPLIED}, {_DUPLICATE}, {_NEED_SNAPSHOT}, {_FULL}

local function hex2bin(hex)
  return (string.gsub(hex, '..', function(c) return string.char(tonumber(c, 16)) end))
end

-- -1, 0, 1 for decimal strings of non-negative integers without leading zeros.
local function cmp_dec(a, b)
  if #a ~= #b then
    if #a < #b then return -1 end
    return 1
  end
  if a == b then return 0 end
  if a < b then return -1 end
  return 1
end

-- A worker's record: "<tag hex> <slot> <epoch> <seq>"; all four returned as strings.
local function parse(rec)
  return string.match(rec, '^(%x+) (%d+) (%d+) (%d+)$')
end

local function rewrite_slotmap(tag)
  local flat = redis.call('HGETALL', NS .. tag .. ':slots')
  local names = {{}}
  local top = -1
  for i = 1, #flat, 2 do
    local s = tonumber(flat[i])
    names[s + 1] = flat[i + 1]
    if s > top then top = s end
  end
  if top < 0 then
    redis.call('DEL', NS .. tag .. ':slotmap')
    return
  end
  for s = 1, top + 1 do
    if names[s] == nil then names[s] = '' end
  end
  redis.call('SET', NS .. tag .. ':slotmap', table.concat(names, '\\n', 1, top + 1))
end

local function clear_bit(key, slot)
  redis.call('SETBIT', key, slot, 0)
  if redis.call('BITCOUNT', key) == 0 then redis.call('DEL', key) end
end

-- Forget a worker entirely: its bits, its set, its slot and its record.
local function drop(worker)
  local rec = redis.call('HGET', WORKERS, worker)
  if not rec then return end
  local tag, slot = parse(rec)
  local kp = BLOCK_PREFIX .. hex2bin(tag)
  local blocks = NS .. tag .. ':blocks:' .. worker
  for _, h in ipairs(redis.call('SMEMBERS', blocks)) do clear_bit(kp .. h, slot) end
  redis.call('DEL', blocks)
  redis.call('HDEL', NS .. tag .. ':slots', slot)
  redis.call('HDEL', WORKERS, worker)
  rewrite_slotmap(tag)
end
"""

# ARGV: worker_id, tag hex, epoch, seq, number of stored hashes, stored hashes, removed hashes.
_APPLY = (
    _LUA_PRELUDE
    + """
local worker, tag, epoch, seq = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local n_stored = tonumber(ARGV[5])
local rec = redis.call('HGET', WORKERS, worker)
if not rec then return NEED_SNAPSHOT end
local rtag, slot, repoch, rseq = parse(rec)
if rtag ~= tag then return NEED_SNAPSHOT end
local c = cmp_dec(epoch, repoch)
if c < 0 then return DUPLICATE end
if c > 0 then
  drop(worker)
  return NEED_SNAPSHOT
end
local q, rq = tonumber(seq), tonumber(rseq)
if q <= rq then return DUPLICATE end
if q > rq + 1 then return NEED_SNAPSHOT end
local kp = BLOCK_PREFIX .. hex2bin(tag)
local blocks = NS .. tag .. ':blocks:' .. worker
for i = 6, 5 + n_stored do
  if redis.call('SADD', blocks, ARGV[i]) == 1 then redis.call('SETBIT', kp .. ARGV[i], slot, 1) end
end
for i = 6 + n_stored, #ARGV do
  if redis.call('SREM', blocks, ARGV[i]) == 1 then clear_bit(kp .. ARGV[i], slot) end
end
redis.call('HSET', WORKERS, worker, tag .. ' ' .. slot .. ' ' .. epoch .. ' ' .. seq)
return APPLIED
"""
)

# ARGV: worker_id, tag hex, epoch, seq, hashes.
_SNAPSHOT = (
    _LUA_PRELUDE
    + """
local worker, tag, epoch, seq = ARGV[1], ARGV[2], ARGV[3], ARGV[4]
local p = NS .. tag .. ':'
local rec = redis.call('HGET', WORKERS, worker)
local slot = nil
if rec then
  local rtag, rslot, repoch, rseq = parse(rec)
  local c = cmp_dec(epoch, repoch)
  if c < 0 or (c == 0 and tonumber(seq) < tonumber(rseq)) then return DUPLICATE end
  if rtag == tag then slot = rslot end
end
if slot == nil then
  -- New to this model: check for room before dropping it from its old model, so that FULL
  -- changes nothing.
  if redis.call('HLEN', p .. 'slots') >= MAX_SLOTS then return FULL end
  drop(worker)
  for s = 0, MAX_SLOTS - 1 do
    if redis.call('HSETNX', p .. 'slots', s, worker) == 1 then
      slot = tostring(s)
      break
    end
  end
  rewrite_slotmap(tag)
end
local blocks = p .. 'blocks:' .. worker
local staging = p .. 'staging:' .. worker
redis.call('DEL', staging)
-- unpack() is bounded by Lua's C stack (8000 values); 1000 per SADD stays well inside.
for i = 5, #ARGV, 1000 do
  redis.call('SADD', staging, unpack(ARGV, i, math.min(i + 999, #ARGV)))
end
local kp = BLOCK_PREFIX .. hex2bin(tag)
for _, h in ipairs(redis.call('SDIFF', blocks, staging)) do clear_bit(kp .. h, slot) end
for _, h in ipairs(redis.call('SDIFF', staging, blocks)) do
  redis.call('SETBIT', kp .. h, slot, 1)
end
if redis.call('EXISTS', staging) == 1 then
  redis.call('RENAME', staging, blocks)
else
  redis.call('DEL', blocks)
end
redis.call('HSET', WORKERS, worker, tag .. ' ' .. slot .. ' ' .. epoch .. ' ' .. seq)
return APPLIED
"""
)

# ARGV: worker_id.
_REMOVE = (
    _LUA_PRELUDE
    + """
drop(ARGV[1])
return APPLIED
"""
)


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
    first = values[0]
    if not first:
        return {}
    # Slot s is bit 63 - s of the value read big-endian and padded to 8 bytes (SETBIT writes
    # only as many bytes as the highest slot set needs).
    alive = int.from_bytes(first, "big") << (64 - 8 * len(first))
    counts: dict[str, int] = {}
    n = len(values)
    for i in range(1, n):
        raw = values[i]
        held = int.from_bytes(raw, "big") << (64 - 8 * len(raw)) if raw else 0
        lost = alive & ~held
        if lost:
            alive ^= lost
            while lost:
                low = lost & -lost
                lost ^= low
                _credit(counts, names, 64 - low.bit_length(), i)
            if not alive:
                return counts
    while alive:
        low = alive & -alive
        alive ^= low
        _credit(counts, names, 64 - low.bit_length(), n)
    return counts


def _credit(counts: dict[str, int], names: list[str], slot: int, count: int) -> None:
    # A bit without a name would be a slot freed while its bit stayed set, which the scripts
    # never leave behind; skip it rather than invent a worker.
    if slot < len(names) and names[slot]:
        counts[names[slot]] = count


_READ_CHUNK = 1 << 16


def _encode_command(args: Sequence[bytes]) -> bytes:
    """One RESP command (an array of bulk strings)."""
    parts = [b"*%d\r\n" % len(args)]
    for arg in args:
        parts.append(b"$%d\r\n%s\r\n" % (len(arg), arg))
    return b"".join(parts)


def _parse_reply(buf: bytes, pos: int = 0) -> tuple[Any, int] | None:
    """Parse one RESP2 reply at `pos`: (value, position after it), or None while `buf` does
    not hold the whole reply yet.

    Bulk strings are bytes, nil is None, integers are int, a status is bytes, an error reply is
    returned (not raised) as a ResponseError so that the caller can consume the whole reply
    first and keep the connection usable. Arrays of bulk strings, the MGET case, take a fast
    inline path.
    """
    end = buf.find(b"\r\n", pos)
    if end < 0:
        return None
    kind, head, pos = buf[pos : pos + 1], buf[pos + 1 : end], end + 2
    if kind == b"$":
        n = int(head)
        if n < 0:
            return None, pos
        if pos + n + 2 > len(buf):
            return None
        return buf[pos : pos + n], pos + n + 2
    if kind == b"*":
        items: list[Any] = []
        append, startswith, size = items.append, buf.startswith, len(buf)
        for _ in range(int(head)):
            # Fast paths for what an MGET of bitmaps returns: nil, or a bulk string of at most
            # 9 bytes ("$<digit>\r\n"); ~3x quicker than the general case below.
            if startswith(b"$-1\r\n", pos):
                append(None)
                pos += 5
                continue
            if pos + 3 < size and buf[pos] == 36 and buf[pos + 2] == 13:  # b"$", b"\r"
                start = pos + 4
                pos = start + buf[pos + 1] - 46  # digit - ord("0") + len(b"\r\n")
                if pos > size:
                    return None
                append(buf[start : pos - 2])
                continue
            parsed = _parse_reply(buf, pos)
            if parsed is None:
                return None
            append(parsed[0])
            pos = parsed[1]
        return items, pos
    if kind == b"+":
        return head, pos
    if kind == b":":
        return int(head), pos
    if kind == b"-":
        return ResponseError(head.decode("utf-8", errors="replace")), pos
    raise ResponseError(f"unexpected RESP reply type {kind!r} from Redis")


class _Connection:
    """One plain asyncio stream to Redis, one request at a time."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader = reader
        self._writer = writer

    async def request(self, payload: bytes) -> Any:
        """Send one command, return its reply; raise ResponseError for an error reply (the
        connection stays usable) and ConnectionError when Redis hung up."""
        self._writer.write(payload)
        await self._writer.drain()
        buf = b""
        while True:
            chunk = await self._reader.read(_READ_CHUNK)
            if not chunk:
                raise ConnectionError("Redis closed the connection")
            buf += chunk
            parsed = _parse_reply(buf)
            if parsed is not None:
                value, end = parsed
                if end != len(buf):
                    raise ResponseError(f"{len(buf) - end} unexpected bytes after a reply")
                if isinstance(value, ResponseError):
                    raise value
                return value

    def close(self) -> None:
        self._writer.close()

    async def aclose(self) -> None:
        self._writer.close()
        try:
            await self._writer.wait_closed()
        except OSError:
            pass  # the peer hung up first: closed either way


class _LookupClient:
    """The lookup's MGET on plain asyncio streams with a small RESP2 reader.

    Why not redis-py: without hiredis (not installed here) its pure-Python parser awaits a
    readline/readexactly per array element, so a 256-block lookup takes ~1.0 ms at p50
    against ~0.28 ms with this client, which parses the whole reply from one buffer (both
    measured by benchmarks/bench_index.py on the same machine). Only plain TCP and
    unix-socket URLs with optional username/password/db are spoken (`for_url` returns None
    otherwise, and the index then looks up through redis-py).

    Connections are pooled (up to `max_idle` kept), one request in flight each. A request
    that meets a dead pooled connection is resent on the next pooled or a new one (MGET is
    read-only, so resending is safe), which rides out connections killed by a Redis restart;
    a connection whose request failed or was cancelled midway is closed, never reused.
    """

    def __init__(self, connect_kwargs: dict[str, Any], timeout_s: float, max_idle: int) -> None:
        self._kw = connect_kwargs
        self._timeout_s = timeout_s
        self._max_idle = max_idle
        self._idle: list[_Connection] = []

    @classmethod
    def for_url(cls, url: str, timeout_s: float, max_idle: int = 16) -> _LookupClient | None:
        try:
            kw: dict[str, Any] = dict(parse_url(url))
        except ValueError:
            return None
        connection_class = kw.pop("connection_class", None)
        if connection_class not in (None, UnixDomainSocketConnection):
            return None  # TLS or something else we do not speak
        if set(kw) - {"host", "port", "path", "db", "username", "password"}:
            return None
        return cls(kw, timeout_s, max_idle)

    async def _connect(self) -> _Connection:
        kw = self._kw
        if "path" in kw:
            reader, writer = await asyncio.open_unix_connection(kw["path"])
        else:
            reader, writer = await asyncio.open_connection(
                kw.get("host", "localhost"), kw.get("port", 6379)
            )
        conn = _Connection(reader, writer)
        try:
            if kw.get("password") is not None:
                user = [kw["username"].encode()] if kw.get("username") else []
                await conn.request(_encode_command([b"AUTH", *user, kw["password"].encode()]))
            if kw.get("db"):
                await conn.request(_encode_command([b"SELECT", str(kw["db"]).encode()]))
        except BaseException:
            conn.close()
            raise
        return conn

    async def call(self, payload: bytes) -> Any:
        """One request; raises RedisError/OSError (TimeoutError after `timeout_s`)."""
        async with asyncio.timeout(self._timeout_s):
            while True:
                reused = bool(self._idle)
                conn = self._idle.pop() if reused else await self._connect()
                try:
                    reply = await conn.request(payload)
                except ResponseError:
                    self._release(conn)
                    raise
                except ConnectionError:
                    conn.close()
                    if reused:
                        continue  # stale pooled connection (e.g. Redis restarted): retry
                    raise
                except BaseException:
                    conn.close()  # mid-request: its stream position is unknown
                    raise
                self._release(conn)
                return reply

    def _release(self, conn: _Connection) -> None:
        if len(self._idle) < self._max_idle:
            self._idle.append(conn)
        else:
            conn.close()

    async def aclose(self) -> None:
        """Close the idle connections (in-flight ones close when their request ends)."""
        idle, self._idle = self._idle, []
        for conn in idle:
            await conn.aclose()


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

    Updates go through redis-py (redis.asyncio). Lookups use `_LookupClient`, a lean MGET
    over plain asyncio streams ~4x cheaper than redis-py's parser without hiredis, unless
    `fast_lookup` is False or the URL needs more than it speaks (TLS): then redis-py too.

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
            _LookupClient.for_url(redis_url, socket_timeout_s) if fast_lookup else None
        )
        self._apply_script = self._redis.register_script(_APPLY)
        self._snapshot_script = self._redis.register_script(_SNAPSHOT)
        self._remove_script = self._redis.register_script(_REMOVE)
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
            raise IndexUnavailable(f"prefix index {what} failed at {self._url}: {exc!r}") from exc

    async def apply(self, batch: EventBatch) -> ApplyResult:
        if not isinstance(batch, EventBatch):
            raise ValueError(f"batch must be an EventBatch, got {type(batch).__name__}")
        tag_hex = self._model_keys(batch.model).tag_hex
        args: list[Any] = [batch.worker_id, tag_hex, str(batch.epoch), str(batch.seq)]
        args.append(len(batch.stored))
        args += _pack(batch.stored)
        args += _pack(batch.removed)
        code = await self._call("apply", self._apply_script(args=args))
        return _RESULTS[int(code)]

    async def snapshot(
        self, worker_id: str, model: str, epoch: int, seq: int, hashes: Iterable[int]
    ) -> ApplyResult:
        unique = check_snapshot(worker_id, model, epoch, seq, hashes)
        tag_hex = self._model_keys(model).tag_hex
        args: list[Any] = [worker_id, tag_hex, str(epoch), str(seq), *_pack(unique)]
        code = int(await self._call("snapshot", self._snapshot_script(args=args)))
        if code == _FULL:
            raise IndexFull(
                f"model {model!r} already has {MAX_WORKERS_PER_MODEL} workers indexed, the "
                f"maximum; cannot add worker {worker_id!r}"
            )
        return _RESULTS[code]

    async def lookup(self, model: str, chain: Sequence[int]) -> dict[str, int]:
        check_name("model", model)
        if not chain:
            return {}
        # struct checks the range itself, at a fraction of check_hashes' cost on this hot path;
        # check_hashes then only words the error (it also rejects bools, which struct takes).
        try:
            packed = struct.pack(f">{len(chain)}Q", *chain)
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
        return _leading_counts(values[1:], cached[1])

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
