"""Per-request block tables on top of the block pool, with prefix-cache lookups.

    request tokens:  [t0 ............ t15 | t16 ........ t31 | t32 t33 t34 ]
    block table:     [       7            |        2         |      9      ]
    block hashes:    [       h0           |        h1        |  (partial)  ]

A token at position p lives in block table[p // block_size] at offset p % block_size.

A model whose attention layers share the cache in several tables (tandem.model.layer_groups
`KVLayout`: gpt-oss's full and sliding layers, Gemma 3's) holds one block per table for each
logical block, kept interleaved in one list, so that the runner's rows only ever grow:

    tables 2 (full, sliding):  [f0 s0 | f1 s1 | f2 s2 | f3 s3]   entry j * 2 + t: table t, block j

A sliding table frees the blocks every later token's window has passed while the request
runs (its entries before `_first_live` are no longer its own and are never read: each
kernel starts at its window). Each table's blocks are cached under their own key
(`prefix_hash.table_key`), and a prefix hit holds a sliding table's blocks only where the
next token's window reads them (`NULL_BLOCK` before).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

from tandem.engine.block_pool import BlockPool, KVEvent
from tandem.engine.prefix_hash import table_key
from tandem.engine.request import Request
from tandem.engine.state_checkpoints import StateCheckpoints
from tandem.model.layer_groups import (
    KVLayout,
    KVTable,
    LayerGroup,
    LayerKind,
    resumable_prefix,
)

# What `_Hits` says of a block only a lower KV tier holds (tandem.engine.tiering).
TIERED = -2
# A table entry no block backs: a sliding table's block outside the window of a prefix hit
# or of a hand-off. Never read (kernels start at the window) and never freed.
NULL_BLOCK = -1

# The layout of a model whose attention layers all keep every token: one full table.
DENSE = KVLayout(1, (KVTable(LayerKind.FULL, ()),))


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Owns the block pool and every request's block tables.

    A model with linear-attention layers (`groups` holds one) resumes a cached prefix only
    where a state checkpoint was taken (`checkpoints`, which the runner fills); one with
    sliding tables (`layout`) only where each holds the next token's window. Lookups stop at
    the longest prefix every group and table can resume from.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        record_events: bool = False,
        groups: Sequence[LayerGroup] = (),
        checkpoints: StateCheckpoints | None = None,
        layout: KVLayout = DENSE,
    ) -> None:
        if any(g.kind is LayerKind.LINEAR for g in groups) and enable_caching:
            if checkpoints is None:
                raise ValueError("prefix caching with linear-attention layers needs checkpoints")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.groups = tuple(groups)
        self.layout = layout
        self.num_tables = max(1, layout.num_tables)
        self._sliding = [t for t, tab in enumerate(layout.tables) if tab.kind is LayerKind.SLIDING]
        # Tables whose cached blocks the prefix index hears of: table 0 and the first sliding.
        self._published = {0, *self._sliding[:1]}
        self.checkpoints = checkpoints if enable_caching else None
        self.pool = BlockPool(num_blocks, enable_caching, record_events)
        self.block_tables: dict[str, list[int]] = {}  # interleaved, see the module docstring
        # request id -> per table, its first logical block still its own (0 for full tables)
        self._first_live: dict[str, list[int]] = {}
        self._num_cached_blocks: dict[str, int] = {}  # request id -> blocks already published

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def usage(self) -> float:
        """Fraction of blocks held by requests."""
        return self.pool.num_used_blocks / self.pool.num_blocks

    def get_block_ids(self, request_id: str) -> list[int]:
        """The request's tables, interleaved (entries a sliding table no longer holds
        included: the runner's rows never shrink, and no kernel reads them)."""
        return self.block_tables.get(request_id, [])

    def held_blocks(self, request_id: str) -> list[int]:
        """The blocks the request holds, in table order: logical block order per table."""
        table, k = self.block_tables.get(request_id, []), self.num_tables
        first = self._first_live.get(request_id, [0] * k)
        return [b for t in range(k) for b in table[first[t] * k + t :: k] if b != NULL_BLOCK]

    def handoff_live(self, num_tokens: int) -> list[range]:
        """Per table, the logical blocks a hand-off after `num_tokens` tokens moves (one
        table: all of them)."""
        if self.num_tables == 1:
            return [range(cdiv(num_tokens, self.block_size))]
        return self.layout.live_blocks(num_tokens, self.block_size)

    def handoff_blocks(self, request_id: str, num_tokens: int) -> list[int]:
        """What a hand-off of the request after `num_tokens` tokens moves: table by table,
        the blocks its next token reads (a sliding table's window only; the blocks before
        it are freed). A one-table model names its whole table (a packed state's blocks
        after the pages included)."""
        table = self.block_tables.get(request_id, [])
        if self.num_tables == 1:
            return list(table)
        self.trim(request_id, num_tokens)
        k = self.num_tables
        ids = [
            table[j * k + t] for t, live in enumerate(self.handoff_live(num_tokens)) for j in live
        ]
        assert NULL_BLOCK not in ids, f"request {request_id!r} lacks a block it hands off"
        return ids

    def get_computed_blocks(
        self, request: Request, max_tokens: int | None = None
    ) -> tuple[list[int], int]:
        """Longest cached prefix of the request, of at most `max_tokens` tokens, as (block
        ids, interleaved as the tables keep them, `NULL_BLOCK` where a sliding table needs
        none; number of tokens).

        At least one token is always left to compute: the step that computes it produces the
        logits for the next token.
        """
        if not self.enable_caching:
            return [], 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        if max_tokens is not None:
            max_blocks = min(max_blocks, max_tokens // self.block_size)
        hashes = request.block_hashes[:max_blocks]
        if self.num_tables == 1 and self.checkpoints is None:
            hits: list[int] = []
            for block_hash in hashes:
                block_id = self.pool.get_cached_block(block_hash)
                if block_id is None:
                    break
                hits.append(block_id)
            return hits, len(hits) * self.block_size
        found, num_full = self._table_hits(hashes)
        tokens = self._resumable(request, found, num_full)
        n, k = tokens // self.block_size, self.num_tables
        live = self.layout.live_blocks(tokens, self.block_size) if k > 1 else [range(n)]
        flat = [found[t][j] if j in live[t] else NULL_BLOCK for j in range(n) for t in range(k)]
        return flat, tokens

    def tier_plan(
        self, request: Request, tier_of: Callable[[int], int | None]
    ) -> tuple[list[tuple[int, int, int, bool]], int]:
        """What lower KV tiers (`tier_of(key)`: the tier holding a block, or None) would add
        to the request's cached prefix: ((key, tier, table, needed) of each block of that
        prefix a tier holds, in prefix order -- needed: the device lacks it; the others are
        there to replace the device's should it evict them before the request runs; the
        prefix's tokens). Empty when the tiers add nothing."""
        if not self.enable_caching:
            return [], 0
        hashes = request.block_hashes[: (request.num_tokens - 1) // self.block_size]
        found, num_full = self._table_hits(hashes, tier_of)
        tokens = self._resumable(request, found, num_full)
        n, k = tokens // self.block_size, self.num_tables
        live = self.layout.live_blocks(tokens, self.block_size) if k > 1 else [range(n)]
        if not any(j in found[t].tiers for t in range(k) for j in live[t]):
            return [], tokens
        plan = []
        for j in range(n):
            for t in range(k):
                if j not in live[t]:
                    continue
                if j in found[t].tiers:
                    plan.append((*found[t].tiers[j], t, True))
                elif (tier := tier_of(key := table_key(hashes[j], t))) is not None:
                    plan.append((key, tier, t, False))
        return plan, tokens

    def _table_hits(
        self, hashes: Sequence[int], tier_of: Callable[[int], int | None] | None = None
    ) -> tuple[list[_Hits], int]:
        """Per table, its cached blocks of the prompt, and how many leading blocks every
        full table holds: full tables are looked up up to their first miss (the shortest
        bounds every other), sliding tables as the hit rule asks (the windows it tries)."""
        found = [_Hits(self.pool, hashes, t, tier_of) for t in range(self.num_tables)]
        limit = len(hashes)
        for t, hits in enumerate(found):
            if t not in self._sliding:
                n = 0
                while n < limit and n in hits:
                    n += 1
                limit = n
        return found, limit

    def _resumable(self, request: Request, found: list[_Hits], num_blocks: int) -> int:
        """Tokens of the longest cached prefix every table and group can resume from (a
        linear group needs a checkpoint there, marked used); every full table holds the
        first `num_blocks`."""
        bs, hashes = self.block_size, request.block_hashes
        tables: list[KVTable | LayerGroup] = list(self.layout.tables) or [DENSE.tables[0]]
        held: dict[int, range | _Hits] = {
            t: hits if t in self._sliding else range(num_blocks) for t, hits in enumerate(found)
        }
        points: dict[int, set[int]] = {}
        if self.checkpoints is not None:
            for group in self.groups:
                if group.kind is LayerKind.LINEAR:
                    points[len(tables)] = {
                        (j + 1) * bs for j in range(num_blocks) if hashes[j] in self.checkpoints
                    }
                    tables.append(group)
        tokens = resumable_prefix(tables, held, points, num_blocks * bs, bs)
        if tokens and self.checkpoints is not None:
            self.checkpoints.lookup(hashes[tokens // bs - 1])
        return tokens

    def checkpoint_slot(self, request: Request, num_tokens: int) -> int:
        """The state checkpoint a request resumes from after its first `num_tokens` tokens
        (a prefix `get_computed_blocks` found this step)."""
        slot = None
        if self.checkpoints is not None and num_tokens % self.block_size == 0:
            slot = self.checkpoints.lookup(request.block_hashes[num_tokens // self.block_size - 1])
        if slot is None:
            raise RuntimeError(
                f"request {request.request_id!r} resumes at token {num_tokens} without a "
                "linear-attention state checkpoint there"
            )
        return slot

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        computed_block_ids: Sequence[int] = (),
        live_only: bool = False,
    ) -> list[int] | None:
        """Make room for `num_new_tokens` more tokens after the computed ones; first free the
        sliding tables' blocks that no later token reads.

        Args:
            computed_block_ids: prefix-cache hits (from get_computed_blocks) to take into the
                tables first; only for a request that holds no blocks yet.
            live_only: the tokens' KV is written from elsewhere (a hand-off), not computed:
                a sliding table takes blocks only for the last window.

        Returns:
            The newly allocated block ids, or None (no more blocks taken) if too few are free.
        """
        rid, bs, k = request.request_id, self.block_size, self.num_tables
        table = self.block_tables.get(rid, [])
        if computed_block_ids and table:
            raise ValueError(f"request {request.request_id} already holds blocks")
        start = request.num_computed_tokens + len(computed_block_ids) // k * bs
        end = start + num_new_tokens
        if self._sliding and table:
            self.trim(rid, start)
        old = (len(table) + len(computed_block_ids)) // k  # logical blocks already in the tables
        new = max(cdiv(end, bs) - old, 0)
        skip = [0] * k  # per table, the new blocks it leaves NULL (out of the window)
        if live_only:
            for t in self._sliding:
                skip[t] = min(new, max(self.layout.tables[t].live_blocks(end, bs).start - old, 0))
        num_needed = new * k - sum(skip)
        # Hits on free blocks take those blocks out of the free queue.
        hits = [b for b in computed_block_ids if b != NULL_BLOCK]
        num_revived = sum(self.pool.blocks[b].ref_cnt == 0 for b in hits)
        if num_needed > self.pool.num_free_blocks - num_revived:
            return None
        self.pool.touch(hits)
        new_ids = self.pool.allocate(num_needed)
        assert new_ids is not None
        fresh = iter(new_ids)
        added = [NULL_BLOCK if j < skip[t] else next(fresh) for j in range(new) for t in range(k)]
        self.block_tables[rid] = table + list(computed_block_ids) + added
        if rid not in self._first_live:
            first = [0] * k
            if computed_block_ids:
                held = self.layout.live_blocks(start, bs) if k > 1 else [range(old)]
                first = [min(held[t].start, old) if t in self._sliding else 0 for t in range(k)]
            self._first_live[rid] = first
        if computed_block_ids:
            self._num_cached_blocks[rid] = old
        if live_only and self._sliding:
            self.trim(rid, end)
        return new_ids

    def trim(self, request_id: str, num_tokens: int) -> None:
        """Free each sliding table's blocks before the window of the token after the first
        `num_tokens` (no later token of the request reads them; a cached one stays cached)."""
        table, first, k = (
            self.block_tables[request_id],
            self._first_live[request_id],
            self.num_tables,
        )
        dead: list[int] = []
        for t in self._sliding:
            stop = self.layout.tables[t].live_blocks(num_tokens, self.block_size).start
            stop = min(stop, len(table) // k)
            dead += [b for b in table[first[t] * k + t : stop * k : k] if b != NULL_BLOCK]
            first[t] = max(first[t], stop)
        self.pool.free(dead)

    def cache_blocks(self, request: Request) -> None:
        """Cache every full block whose KV is computed under its table's key."""
        if not self.enable_caching:
            return
        rid = request.request_id
        table = self.block_tables.get(rid)
        if table is None:
            return
        num_full = min(request.num_computed_tokens // self.block_size, len(request.block_hashes))
        done = self._num_cached_blocks.get(rid, 0)
        k, first = self.num_tables, self._first_live[rid]
        for j in range(done, num_full):
            for t in range(k):
                block_id = table[j * k + t]
                if j >= first[t] and block_id != NULL_BLOCK:  # still its own
                    key = table_key(request.block_hashes[j], t)
                    self.pool.cache_block(block_id, key, t in self._published)
        self._num_cached_blocks[rid] = max(done, num_full)

    def append_blocks(self, request_id: str, num_blocks: int) -> list[int] | None:
        """`num_blocks` more blocks at the end of a request's table, past its tokens (a
        linear-attention state packed for a hand-off); None if too few are free. They are
        never published, and go back with the request (`free`) or `drop_blocks`. One-table
        layouts only (Qwen3-Next's)."""
        assert self.num_tables == 1, "a packed state follows the pages of a one-table layout"
        new_ids = self.pool.allocate(num_blocks)
        if new_ids is not None:
            self.block_tables[request_id] = self.block_tables.get(request_id, []) + new_ids
        return new_ids

    def drop_blocks(self, request_id: str, num_blocks: int) -> None:
        """Free the last `num_blocks` of a request's table (those `append_blocks` added)."""
        table = self.block_tables[request_id]
        dropped = table[len(table) - num_blocks :]
        del table[len(table) - num_blocks :]
        self.pool.free(reversed(dropped))

    def free(self, request_id: str) -> None:
        """Release a request's blocks, tail first so its prefix is evicted last."""
        held = self.held_blocks(request_id)
        self.block_tables.pop(request_id, None)
        self._first_live.pop(request_id, None)
        self._num_cached_blocks.pop(request_id, None)
        self.pool.free(reversed(held))

    def reset_prefix_cache(self) -> None:
        """Forget every cached prefix no request holds, and every state checkpoint."""
        self.pool.reset_prefix_cache()
        if self.checkpoints is not None:
            self.checkpoints.clear()

    def enable_events(self) -> None:
        """Record prefix-cache changes (blocks, and state checkpoints' marks) for
        `take_events`."""
        self.pool.record_events = True
        if self.checkpoints is not None:
            self.checkpoints.record_events = True

    def take_events(self) -> list[KVEvent]:
        events = self.pool.take_events()
        if self.checkpoints is not None:
            events += self.checkpoints.take_events()
        return events

    def cached_hashes(self) -> list[int]:
        """Every block hash (and state checkpoint mark) a lookup can find here now."""
        marks = self.checkpoints.marks() if self.checkpoints is not None else []
        return self.pool.cached_hashes() + marks

    def check_integrity(self) -> None:
        refs: dict[int, int] = {}
        for request_id in self.block_tables:
            for block_id in self.held_blocks(request_id):
                refs[block_id] = refs.get(block_id, 0) + 1
        self.pool.check_integrity(refs)
        if self.checkpoints is not None:
            self.checkpoints.check_integrity()


class _Hits:
    """A KV table's cached blocks of a prompt (logical block -> block id), each looked up
    in the pool on first use: `j in hits` is whether block j of the table is cached."""

    def __init__(
        self,
        pool: BlockPool,
        hashes: Sequence[int],
        table: int,
        tier_of: Callable[[int], int | None] | None = None,
    ) -> None:
        self._pool, self._hashes, self._table = pool, hashes, table
        self._ids: dict[int, int | None] = {}
        self._tier_of = tier_of  # with it, a block a lower tier holds is a hit (TIERED)
        self.tiers: dict[int, tuple[int, int]] = {}  # j -> (key, tier) of TIERED hits

    def get(self, j: int) -> int | None:
        if j not in self._ids:
            key = table_key(self._hashes[j], self._table) if j < len(self._hashes) else None
            block_id = None if key is None else self._pool.get_cached_block(key)
            if block_id is None and key is not None and self._tier_of is not None:
                tier = self._tier_of(key)
                if tier is not None:
                    block_id, self.tiers[j] = TIERED, (key, tier)
            self._ids[j] = block_id
        return self._ids[j]

    def __getitem__(self, j: int) -> int:
        block_id = self.get(j)
        if block_id is None:
            raise KeyError(j)
        return block_id

    def __contains__(self, j: object) -> bool:
        return isinstance(j, int) and self.get(j) is not None

    def __iter__(self) -> Iterator[int]:
        return (j for j, b in self._ids.items() if b is not None)

    def __len__(self) -> int:
        """Blocks found so far (for a full table filled from 0 on: its leading run)."""
        return sum(b is not None for b in self._ids.values())
