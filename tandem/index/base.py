"""The cluster-wide prefix-cache index: which worker holds which KV blocks, per model.

Workers publish the changes of their prefix cache; routers ask, for a request's chain of block
hashes (`tandem.engine.prefix_hash.hash_blocks`), how many *leading* blocks of it each worker
holds. Because a block hash covers its whole prefix, a worker can reuse blocks 0..n-1 of a
request only if it holds all of them, so the count per worker stops at that worker's first
miss even if it holds later blocks.

Protocol between a worker and the index
---------------------------------------
A worker incarnation has an `epoch` (e.g. its start time in ns; epochs of one worker id must
increase across restarts). After each scheduler step it publishes one `EventBatch` with the
next `seq` (1, 2, 3, ... within the epoch) and acts on the `ApplyResult`:

    APPLIED        nothing to do.
    DUPLICATE      nothing to do: the index already has this batch (a resend), or the batch is
                   from an older epoch than the index knows (a delayed message from a dead
                   incarnation) and must not touch the live one's entries.
    NEED_SNAPSHOT  the index cannot apply the batch: a batch is missing (seq gap), the index
                   does not know this worker (first contact, `remove_worker`, or the index lost
                   its state, e.g. Redis restarted empty), the worker moved to another model,
                   or the epoch is newer than the index's (the worker restarted; its old
                   entries are dropped at once because the old process's cache is gone). The
                   worker replies with `snapshot(worker_id, model, epoch, seq, all hashes it
                   caches now)`, where `seq` is the batch's seq and the hashes already include
                   that batch's changes; it then continues with seq + 1.

A snapshot replaces the worker's whole set and is applied unless it is older than what the
index has (an older epoch, or the same epoch with a smaller seq): then it returns DUPLICATE
and changes nothing. Nothing is lost by a lost batch or a lost index: the next batch asks for
a snapshot, and a snapshot makes the index exact again.

A worker id belongs to at most one model at a time (`workers()` maps an id to one epoch and
seq); a snapshot under another model moves the worker there.

Every implementation is async (the router and the workers' publishers run on asyncio loops)
and raises the same errors, so one contract test suite covers them all:

- ValueError for misuse (naming the offending value), raised before any state changes;
- `IndexFull` when a snapshot would give a model more than `MAX_WORKERS_PER_MODEL` workers;
- `IndexUnavailable` when the index's backing store cannot be reached; callers then route on
  load alone and retry later.

This module and `tandem.index.memory` do no I/O.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import Enum

# A worker's entries are one bit in a 64-bit mask per block in the Redis implementation; the
# in-memory one enforces the same bound so that both behave alike.
MAX_WORKERS_PER_MODEL = 64
U64_LIMIT = 2**64
EPOCH_LIMIT = 2**63
# Sequence numbers are compared as Lua numbers (doubles) in the Redis scripts, exact below 2**53:
# 285,000 years of batches at 1000 per second.
SEQ_LIMIT = 2**53


class IndexUnavailable(Exception):
    """The index's backing store (e.g. Redis) cannot be reached or failed; the cause is chained.

    The operation may or may not have taken effect. A router falls back to load-only routing;
    a publisher may drop its batch: its next batch then meets a seq gap (or a restarted, empty
    index) and asks for a snapshot, which repairs everything.
    """


class IndexFull(Exception):
    """A snapshot would give a model more than `MAX_WORKERS_PER_MODEL` workers."""


class ApplyResult(Enum):
    """Outcome of `PrefixIndex.apply` (and `snapshot`); see the module docstring."""

    APPLIED = "applied"
    DUPLICATE = "duplicate"
    NEED_SNAPSHOT = "need_snapshot"


def check_name(what: str, value: object) -> str:
    """Return `value` if it is a non-empty printable str (no newline, tab or other control
    characters, which the Redis key and slot-table encodings rely on); else ValueError."""
    if not isinstance(value, str) or not value or not value.isprintable():
        raise ValueError(f"{what} must be a non-empty printable str, got {value!r}")
    return value


def check_int(what: str, value: object, low: int, high: int) -> int:
    """Return `value` if it is an int (not a bool) in [low, high); else ValueError."""
    # bool is an int subclass; `True` as a seq or a hash is a bug, not a number.
    if not isinstance(value, int) or isinstance(value, bool) or not low <= value < high:
        raise ValueError(f"{what} must be an int in [{low}, {high}), got {value!r}")
    return value


def check_hashes(what: str, values: Iterable[int]) -> tuple[int, ...]:
    """Return `values` as a tuple after checking each is an unsigned 64-bit int; else
    ValueError naming the first bad value and its position."""
    out = tuple(values)
    for i, h in enumerate(out):
        if not isinstance(h, int) or isinstance(h, bool) or not 0 <= h < U64_LIMIT:
            raise ValueError(f"{what}[{i}] must be an unsigned 64-bit int, got {h!r}")
    return out


def check_snapshot(
    worker_id: str, model: str, epoch: int, seq: int, hashes: Iterable[int]
) -> tuple[int, ...]:
    """Validate `PrefixIndex.snapshot`'s arguments (ValueError naming the bad one) and
    return its hashes without duplicates, in first-seen order."""
    check_name("worker_id", worker_id)
    check_name("model", model)
    check_int("epoch", epoch, 0, EPOCH_LIMIT)
    check_int("seq", seq, 0, SEQ_LIMIT)
    return tuple(dict.fromkeys(check_hashes("hashes", hashes)))


@dataclass(frozen=True, slots=True)
class EventBatch:
    """The prefix-cache changes of one worker over one scheduler step.

    Attributes:
        worker_id: the publishing worker (non-empty, printable).
        model: the model whose cache changed (non-empty, printable); hashes of different
            models never match.
        epoch: the worker's incarnation, in [0, 2**63); a new epoch means the worker
            restarted.
        seq: 1 for the first batch of an epoch, +1 per batch, below 2**53.
        stored: block hashes (u64) now cached.
        removed: block hashes (u64) evicted.

    `stored` and `removed` are the batch's *net* changes: a hash in both is ambiguous (was it
    stored then evicted, or the other way round?) and raises ValueError; `from_events` builds
    a batch from ordered events. Repeats within one tuple are harmless. Empty batches are
    valid: they advance `seq` and let a worker find out that it needs a snapshot.
    """

    worker_id: str
    model: str
    epoch: int
    seq: int
    stored: tuple[int, ...] = ()
    removed: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        check_name("EventBatch.worker_id", self.worker_id)
        check_name("EventBatch.model", self.model)
        check_int("EventBatch.epoch", self.epoch, 0, EPOCH_LIMIT)
        check_int("EventBatch.seq", self.seq, 1, SEQ_LIMIT)
        # Accept any iterable (a list, a generator) but keep an immutable tuple, so a batch
        # cannot change after validation. object.__setattr__ because the class is frozen.
        stored = check_hashes("EventBatch.stored", self.stored)
        removed = check_hashes("EventBatch.removed", self.removed)
        both = set(stored).intersection(removed)
        if both:
            raise ValueError(
                f"EventBatch: hashes {sorted(both)[:5]} are in both stored and removed; "
                "publish net changes (EventBatch.from_events does that)"
            )
        object.__setattr__(self, "stored", stored)
        object.__setattr__(self, "removed", removed)

    @classmethod
    def from_events(
        cls,
        worker_id: str,
        model: str,
        epoch: int,
        seq: int,
        events: Iterable[tuple[str, int]],
    ) -> EventBatch:
        """Build a batch from ordered `(kind, block_hash)` events, kind "stored" or "removed"
        (`tandem.engine.block_pool.KVEvent` fits). The last event of a hash wins: each event
        sets the block's state, so a block stored then evicted in one step is removed, and one
        evicted then stored again is stored. ValueError on an unknown kind."""
        last: dict[int, bool] = {}  # hash -> stored?; insertion order kept for stable output
        for i, (kind, block_hash) in enumerate(events):
            if kind == "stored":
                stored = True
            elif kind == "removed":
                stored = False
            else:
                raise ValueError(f"events[{i}] has kind {kind!r}; expected 'stored' or 'removed'")
            last.pop(block_hash, None)
            last[block_hash] = stored
        return cls(
            worker_id=worker_id,
            model=model,
            epoch=epoch,
            seq=seq,
            stored=tuple(h for h, s in last.items() if s),
            removed=tuple(h for h, s in last.items() if not s),
        )


def leading_counts_reference(
    holdings: dict[str, set[int]],
    chain: Sequence[int],
    marks: Sequence[int] | None = None,
    marks_from: Sequence[int] | None = None,
) -> dict[str, int]:
    """The lookup contract in its plainest form: for each worker (id -> hashes it holds), the
    number of leading hashes of `chain` it holds -- with `marks`, cut back to the largest n
    for which it holds marks[i] for every i in range(marks_from[n - 1], n) (no marks_from:
    mark n - 1 alone) -- omitting workers with none. Used by tests as the oracle; too slow
    for serving."""
    first = range(len(chain)) if marks_from is None else marks_from
    counts: dict[str, int] = {}
    for worker_id, held in holdings.items():
        n = 0
        while n < len(chain) and chain[n] in held:
            n += 1
        while marks is not None and n and not all(marks[i] in held for i in range(first[n - 1], n)):
            n -= 1
        if n:
            counts[worker_id] = n
    return counts


def resumable_counts(
    counts: Mapping[str, int],
    mark_holders: Sequence[Collection[str]],
    marks_from: Sequence[int],
) -> dict[str, int]:
    """Leading counts cut back to where each worker can resume: the largest n <= its count
    such that it holds marks[i] for every i in range(marks_from[n - 1], n)
    (`mark_holders[i]`: the workers holding marks[i]); workers left with 0 omitted.

    Linear in each count however wide the ranges: walking n down, marks [low, n) are known
    held and `low` only falls, so each n costs one test beyond those that move `low`."""
    out: dict[str, int] = {}
    for worker_id, n in counts.items():
        low = n
        while n:
            need = marks_from[n - 1]
            while low > need and worker_id in mark_holders[low - 1]:
                low -= 1
            if low <= need:
                break  # marks [need, n) all held
            n -= 1  # mark low - 1 (in [need, n)) is missing
            low = min(low, n)
        if n:
            out[worker_id] = n
    return out


def check_marks(
    chain: Sequence[int], marks: Sequence[int] | None, marks_from: Sequence[int] | None
) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """Validate `PrefixIndex.lookup`'s marks and marks_from (ValueError naming the bad one);
    return them as tuples, marks_from filled in (mark n - 1 alone for a count n) when None,
    or None without marks."""
    if marks is None:
        if marks_from is not None:
            raise ValueError("marks_from was given without marks")
        return None
    marks = check_hashes("marks", marks)
    if len(marks) != len(chain):
        raise ValueError(f"marks must have one hash per block of the chain ({len(chain)}), "
                         f"got {len(marks)}")  # fmt: skip
    if marks_from is None:
        return marks, tuple(range(len(chain)))
    first = tuple(marks_from)
    if len(first) != len(chain):
        raise ValueError(f"marks_from must have one int per block of the chain ({len(chain)}), "
                         f"got {len(first)}")  # fmt: skip
    for i, f in enumerate(first):
        if not isinstance(f, int) or isinstance(f, bool) or not 0 <= f <= i:
            raise ValueError(f"marks_from[{i}] must be an int in [0, {i}], got {f!r}")
    return marks, first


class PrefixIndex(ABC):
    """Block hash -> workers holding it, per model. See the module docstring for the protocol.

    Implementations are safe to call concurrently from tasks of one asyncio loop; each
    method is atomic with respect to the others.
    """

    @abstractmethod
    async def apply(self, batch: EventBatch) -> ApplyResult:
        """Apply one batch if it is the next one expected from its worker (same model and
        epoch, seq = last seq + 1). Idempotent: a resent batch returns DUPLICATE and changes
        nothing. NEED_SNAPSHOT changes nothing either, except that a newer epoch first drops
        the worker's entries."""

    @abstractmethod
    async def snapshot(
        self, worker_id: str, model: str, epoch: int, seq: int, hashes: Iterable[int]
    ) -> ApplyResult:
        """Replace the worker's whole set of hashes (under `model`) with `hashes`; the next
        batch expected is seq + 1 (seq >= 0; 0 before the first batch of an epoch).

        Returns APPLIED, or DUPLICATE (nothing changed) when the index already has a newer
        state of this worker: an older epoch, or the same epoch with a larger seq. Raises
        IndexFull, changing nothing, when the worker is new to `model` and the model already
        has MAX_WORKERS_PER_MODEL workers. Blocks the worker keeps stay visible to lookups
        throughout (only the difference is applied)."""

    @abstractmethod
    async def lookup(
        self,
        model: str,
        chain: Sequence[int],
        marks: Sequence[int] | None = None,
        marks_from: Sequence[int] | None = None,
    ) -> dict[str, int]:
        """For a request's chain of block hashes (block 0 first), map each worker holding
        chain[0] to the number of leading blocks of the chain it holds: counting stops at
        that worker's first miss. Workers with 0 are omitted; an empty chain or an unknown
        model gives {}.

        marks: for a model that resumes a prefix only where it also holds a state (linear
        attention: `tandem.engine.prefix_hash.state_mark`), one hash per block of the chain
        that a worker publishes when it can resume right after that block: each count is
        then cut back to the last block whose mark the worker holds (a prefix held by one
        group of layers but not another is a miss at that length).

        marks_from: for a model whose next token reads a window of the prefix's last blocks
        (sliding attention: marks are that table's keys, `tandem.engine.prefix_hash.table_key`,
        and `tandem.model.layer_groups.window_marks_from` gives marks_from), one int per
        block of the chain: a count n then needs every mark in range(marks_from[n - 1], n),
        not mark n - 1 alone (None: marks_from[i] = i). Requires marks; each entry must lie
        in [0, i]."""

    @abstractmethod
    async def remove_worker(self, worker_id: str) -> None:
        """Forget a worker (it died or left): drop all its entries and its seq, so its next
        batch, should it come back, gets NEED_SNAPSHOT. A no-op for an unknown worker."""

    @abstractmethod
    async def workers(self) -> dict[str, tuple[int, int]]:
        """Every known worker: worker_id -> (epoch, last applied seq)."""

    async def close(self) -> None:  # noqa: B027 -- a no-op by default, not abstract
        """Release connections; the index must not be used afterwards. Idempotent."""
