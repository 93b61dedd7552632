"""Per-request block tables on top of the block pool, with prefix-cache lookups.

    request tokens:  [t0 ............ t15 | t16 ........ t31 | t32 t33 t34 ]
    block table:     [       7            |        2         |      9      ]
    block hashes:    [       h0           |        h1        |  (partial)  ]

A token at position p lives in block table[p // block_size] at offset p % block_size.
"""

from __future__ import annotations

from collections.abc import Sequence

from tandem.engine.block_pool import BlockPool, KVEvent
from tandem.engine.request import Request
from tandem.engine.state_checkpoints import StateCheckpoints
from tandem.model.layer_groups import LayerGroup, LayerKind, resumable_prefix


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Owns the block pool and every request's block table.

    A model with linear-attention layers (`groups` holds one) resumes a cached prefix only
    where a state checkpoint was taken (`checkpoints`, which the runner fills): lookups stop
    at the longest prefix every group can resume from.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        record_events: bool = False,
        groups: Sequence[LayerGroup] = (),
        checkpoints: StateCheckpoints | None = None,
    ) -> None:
        if any(g.kind is LayerKind.LINEAR for g in groups) and enable_caching:
            if checkpoints is None:
                raise ValueError("prefix caching with linear-attention layers needs checkpoints")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.groups = tuple(groups)
        self.checkpoints = checkpoints if enable_caching else None
        self.pool = BlockPool(num_blocks, enable_caching, record_events)
        self.block_tables: dict[str, list[int]] = {}
        self._num_cached_blocks: dict[str, int] = {}  # request id -> blocks already published

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def usage(self) -> float:
        """Fraction of blocks held by requests."""
        return self.pool.num_used_blocks / self.pool.num_blocks

    def get_block_ids(self, request_id: str) -> list[int]:
        return self.block_tables.get(request_id, [])

    def get_computed_blocks(self, request: Request) -> tuple[list[int], int]:
        """Longest cached prefix of the request, as (block ids, number of tokens).

        At least one token is always left to compute: the step that computes it produces the
        logits for the next token.
        """
        if not self.enable_caching:
            return [], 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[int] = []
        for block_hash in request.block_hashes[:max_blocks]:
            block_id = self.pool.get_cached_block(block_hash)
            if block_id is None:
                break
            hits.append(block_id)
        if self.checkpoints is not None:
            hits = hits[: self._resumable(request, len(hits)) // self.block_size]
        return hits, len(hits) * self.block_size

    def _resumable(self, request: Request, num_hits: int) -> int:
        """Tokens of the first `num_hits` cached blocks every group can resume from (the
        pages hold every attention layer; linear layers need a checkpoint), its checkpoint
        marked used."""
        assert self.checkpoints is not None
        bs, hashes = self.block_size, request.block_hashes
        pages = range(num_hits)
        held = {(i + 1) * bs for i in pages if hashes[i] in self.checkpoints}
        tokens = resumable_prefix(
            self.groups,
            {i: pages for i, g in enumerate(self.groups) if g.kind is not LayerKind.LINEAR},
            {i: held for i, g in enumerate(self.groups) if g.kind is LayerKind.LINEAR},
            num_hits * bs,
            bs,
        )
        if tokens:
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
        self, request: Request, num_new_tokens: int, computed_block_ids: Sequence[int] = ()
    ) -> list[int] | None:
        """Make room for `num_new_tokens` more tokens after the computed ones.

        Args:
            computed_block_ids: prefix-cache hits (from get_computed_blocks) to take into the
                table first; only for a request that holds no blocks yet.

        Returns:
            The newly allocated block ids, or None (nothing changed) if too few are free.
        """
        table = self.block_tables.get(request.request_id, [])
        if computed_block_ids and table:
            raise ValueError(f"request {request.request_id} already holds blocks")
        num_tokens = (
            request.num_computed_tokens + len(computed_block_ids) * self.block_size + num_new_tokens
        )
        num_needed = cdiv(num_tokens, self.block_size) - len(table) - len(computed_block_ids)
        # Hits on free blocks take those blocks out of the free queue.
        num_revived = sum(self.pool.blocks[b].ref_cnt == 0 for b in computed_block_ids)
        if num_needed > self.pool.num_free_blocks - num_revived:
            return None
        self.pool.touch(computed_block_ids)
        new_ids = self.pool.allocate(max(num_needed, 0))
        assert new_ids is not None
        table = table + list(computed_block_ids) + new_ids
        self.block_tables[request.request_id] = table
        if computed_block_ids:
            self._num_cached_blocks[request.request_id] = len(computed_block_ids)
        return new_ids

    def cache_blocks(self, request: Request) -> None:
        """Publish every full block whose KV is computed under its prefix hash."""
        if not self.enable_caching:
            return
        table = self.block_tables.get(request.request_id)
        if table is None:
            return
        num_full = min(request.num_computed_tokens // self.block_size, len(request.block_hashes))
        done = self._num_cached_blocks.get(request.request_id, 0)
        for i in range(done, num_full):
            self.pool.cache_block(table[i], request.block_hashes[i])
        self._num_cached_blocks[request.request_id] = max(done, num_full)

    def append_blocks(self, request_id: str, num_blocks: int) -> list[int] | None:
        """`num_blocks` more blocks at the end of a request's table, past its tokens (a
        linear-attention state packed for a hand-off); None if too few are free. They are
        never published, and go back with the request (`free`) or `drop_blocks`."""
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
        table = self.block_tables.pop(request_id, None)
        self._num_cached_blocks.pop(request_id, None)
        if table:
            self.pool.free(reversed(table))

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
        for table in self.block_tables.values():
            for block_id in table:
                refs[block_id] = refs.get(block_id, 0) + 1
        self.pool.check_integrity(refs)
        if self.checkpoints is not None:
            self.checkpoints.check_integrity()
