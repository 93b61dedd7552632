"""The prefix index's data in Redis: its key layout and the Lua scripts that update it.

Key layout (T = the model's tag, `index.model_tag(model)`: the first 8 bytes of BLAKE2b(model),
written as 16 hex digits in text keys; 2**-64 collision odds make a name registry unnecessary):

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

Scripts (each one runs as ONE `EVALSHA` and returns one of the codes below):

- `APPLY_LUA` (`apply`): check the worker's model, epoch and seq, then per stored hash SADD to
  the worker's set and (if new) SETBIT; per removed hash SREM and (if it was there) clear the
  bit, deleting the key when no bit is left (BITCOUNT 0); record the seq. A newer epoch drops
  the worker (as `REMOVE_LUA`) and answers NEED_SNAPSHOT.
- `SNAPSHOT_LUA` (`snapshot`): staleness check, a slot (HSETNX over 0..63; slots of removed
  workers are reused) when the worker is new to the model, then the new set goes into a
  staging set and only the difference is applied (SDIFF both ways), so blocks the worker keeps
  never disappear from lookups; the staging set becomes the worker's set.
- `REMOVE_LUA` (`remove_worker`): clear its bit from every key in its set, free its slot,
  forget its seq.

Every update is one Lua script, so it is atomic: a lookup sees a batch entirely or not at all.
The scripts name keys they derive (a worker's blocks), so this needs a standalone Redis or
Valkey, not a cluster. A script costs a few microseconds per block it touches, and Redis runs
nothing else meanwhile: an event batch is cheap, but snapshotting or removing a worker with
20k cached blocks holds Redis for ~50-130 ms on the 2-core benchmark machine
(benchmarks/bench_index.py); lookups wait that long. Splitting those into chunks is future
work.

Under a `maxmemory` eviction policy other than `noeviction`, evicted bitmap keys only hide
hits, but an evicted worker set leaves bits that `REMOVE_LUA` cannot find, so run the index's
Redis with `noeviction` (the default).
"""

from __future__ import annotations

from tandem.index.base import MAX_WORKERS_PER_MODEL, ApplyResult

NAMESPACE = "tandem:index:"
WORKERS_KEY = NAMESPACE + "workers"
BLOCK_KEY_PREFIX = b"tpx:"

# Script return codes. FULL comes only from SNAPSHOT_LUA, when the model has no free slot
# (the client raises IndexFull); the others map to an ApplyResult.
_APPLIED, _DUPLICATE, _NEED_SNAPSHOT, FULL = 0, 1, 2, 3
RESULT_OF_CODE = {
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
local APPLIED, DUPLICATE, NEED_SNAPSHOT, FULL = {_APPLIED}, {_DUPLICATE}, {_NEED_SNAPSHOT}, {FULL}

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
APPLY_LUA = (
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
SNAPSHOT_LUA = (
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
REMOVE_LUA = (
    _LUA_PRELUDE
    + """
drop(ARGV[1])
return APPLIED
"""
)
