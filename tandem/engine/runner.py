"""The torch boundary: turns a SchedulerOutput into tensors, runs the model, samples."""

from __future__ import annotations

from typing import NamedTuple, Protocol

import torch

from tandem.engine.cuda_graphs import (
    CapturePlan,
    DecodeBuffers,
    DecodeGraphs,
    DecodeInputs,
    capture_plan,
    graph_size_for,
)
from tandem.engine.kv_manager import KVCacheManager
from tandem.engine.request import Request
from tandem.engine.sampling import Sampler, SampleResult
from tandem.engine.scheduler import ScheduledRequest, SchedulerOutput
from tandem.engine.spec_states import StateRollback
from tandem.engine.step_inputs import BlockTables, HostStaging
from tandem.engine.verify import sample_scheduled
from tandem.model.attention import AttentionMetadata, DecodeGroup, PagedBatch, PrefillSpan
from tandem.model.linear_attention import Chunk, StateRows
from tandem.model.llama import LlamaModel

# Decode rows are split into groups of similar context length, each padded to its own
# longest row; a group holds at least this many rows (fewer groups = fewer kernel calls).
MIN_DECODE_GROUP_ROWS = 8
MAX_DECODE_GROUPS = 8


class StepRow(NamedTuple):
    """One request's share of a step as every rank of a worker needs it: what the runner
    reads of a `ScheduledRequest`, with the tokens it computes (tandem.engine.ranks sends
    these to the other ranks)."""

    request_id: str
    start: int
    num_new_tokens: int
    block_ids: tuple[int, ...]
    sample: bool
    token_ids: list[int]  # positions [start, start + num_new_tokens)
    num_draft: int = 0  # speculative tokens ending token_ids: each of them is sampled too

    @classmethod
    def of(cls, s: ScheduledRequest) -> StepRow:
        known = s.start + s.num_new_tokens - len(s.draft)
        ids = s.request.token_ids_slice(s.start, known) + list(s.draft)
        return cls(s.request.request_id, s.start, s.num_new_tokens, s.block_ids, s.sample, ids,
                   len(s.draft))  # fmt: skip

    @property
    def is_decode(self) -> bool:
        return self.num_new_tokens == 1 and self.start > 0


class StepPlan(NamedTuple):
    """A step for the other ranks: its rows in the order the runner runs them, the
    requests released since the last step (their block table rows are freed first), and
    rank 0's decision on CUDA graphs: the captured size every rank replays, or None: every
    rank runs the step eagerly (a graph's collectives pair only with the same graph's on
    the other ranks, so no rank decides for itself)."""

    rows: list[StepRow]
    released: list[str]
    graph_size: int | None = None


class CaptureGraphs(NamedTuple):
    """Rank 0 captures decode graphs now (`ModelRunner.capture_graphs`), as `plan`: every
    rank captures at this point of its step sequence, each its own plan, which must be
    rank 0's (tandem.engine.ranks checks)."""

    plan: CapturePlan


class StepFollowers(Protocol):
    """The other ranks of a tensor-parallel worker (tandem.engine.ranks.Followers)."""

    def send(self, message: StepPlan | CaptureGraphs) -> None: ...


class StepInputs(NamedTuple):
    """One step's model inputs, built by `ModelRunner.prepare`."""

    rows: list[StepRow]  # decode rows first (longest context first), then prefills
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    meta: AttentionMetadata
    last_idx: torch.Tensor  # [num_sampled] int64: each sampling row's last token
    num_decode: int
    # [num_tables, num_tokens] int64: each new token's block in each KV table
    slot_blocks: torch.Tensor | None = None
    # [rows, max_blocks * num_tables] int32, the rows' interleaved tables (paged backends)
    block_tables: torch.Tensor | None = None


def replay_size(rows: list[StepRow], graphs: DecodeGraphs | None) -> int | None:
    """Rank 0's decision for a step: the captured graph size its rows replay (a decode-only
    step that a graph holds), or None: the step runs eagerly."""
    n = len(rows)
    if graphs is None or not n or not all(r.is_decode for r in rows) or not graphs.can_serve(n):
        return None
    return graph_size_for(n, graphs.sizes)


def order_rows(out: SchedulerOutput) -> list[ScheduledRequest]:
    """Decode rows first, longest context first (so each decode group is a contiguous run
    of rows), then prefills."""
    decodes = sorted((s for s in out.scheduled if s.is_decode), key=lambda s: -s.start)
    return decodes + [s for s in out.scheduled if not s.is_decode]


class ModelRunner:
    """Runs scheduled steps on the model.

    With a paged backend (Triton) a step's inputs come from a persistent device block table
    and one staged copy (`tandem.engine.step_inputs`); the torch backend's groups and masks
    are built only for the torch backend.

    Args:
        max_model_len: the longest context, which sets the block tables' width.
    """

    def __init__(
        self,
        model: LlamaModel,
        kv_cache: torch.Tensor,
        block_size: int,
        sampler: Sampler,
        max_model_len: int,
        followers: StepFollowers | None = None,
        kv: KVCacheManager | None = None,
    ) -> None:
        self.model = model
        self.kv = kv  # rank 0's: a linear-attention model's prefix-cache checkpoints
        self.followers = followers  # tensor parallelism: the ranks that follow this one
        self._released: list[str] = []  # since the last step, for the followers' tables
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.sampler = sampler
        self.device = kv_cache.device
        self.staging = HostStaging(self.device)
        # KV tables (layer_groups.KVLayout): a request's entry j * num_tables + t is table t's j
        layout = model.config.kv_layout
        self.num_tables = max(1, layout.num_tables)
        self.slots = layout.slots
        self.block_tables = (
            BlockTables(-(-max_model_len // block_size) * self.num_tables, self.device)
            if model.attention.needs_paged_batch
            else None
        )
        self.graphs: DecodeGraphs | None = None  # captured by capture_decode_graphs (CUDA)
        # Linear-attention models (Qwen3-Next): each live request's state slot in
        # model.linear_states, assigned at its first token and reused after it is released
        self._state_slots: dict[str, int] = {}
        self._state_pos: dict[str, int] = {}  # request id -> tokens its slot's state is after
        self._free_slots: list[int] = []
        self.num_state_restores = 0  # rows resumed from a checkpoint (prefix hit, preemption)
        self.rollback: StateRollback | None = None  # speculation on a linear-attention model

    def release(self, request_id: str) -> None:
        """The request is gone (finished, aborted, released): free its block table row
        (the other ranks' with the next step) and its linear-attention state slot."""
        slot = self._state_slots.pop(request_id, None)
        self._state_pos.pop(request_id, None)
        if slot is not None:
            self._free_slots.append(slot)
        if self.block_tables is not None:
            self.block_tables.release(request_id)
            if self.followers is not None:
                self._released.append(request_id)

    def prepare(self, out: SchedulerOutput) -> StepInputs:
        """Order rows (decode first) and build input ids, positions and attention metadata."""
        scheduled = order_rows(out)
        return self.prepare_rows([StepRow.of(s) for s in scheduled], [s.request for s in scheduled])

    def prepare_rows(
        self, rows: list[StepRow], requests: list[Request] | None = None
    ) -> StepInputs:
        """A step's inputs from its rows, ordered as `order_rows` orders them; `requests`,
        theirs (rank 0): what a linear-attention model's state checkpoints are keyed by."""
        num_decode = sum(1 for s in rows if s.is_decode)
        decodes, prefills = rows[:num_decode], rows[num_decode:]
        bs, k = self.block_size, self.num_tables
        ids: list[int] = []
        positions: list[int] = []
        slot_blocks: list[list[int]] = [[] for _ in range(k)]  # per KV table
        last_idx: list[int] = []
        for s in rows:
            ids += s.token_ids
            for pos in range(s.start, s.start + s.num_new_tokens):
                positions.append(pos)
                for t in range(k):
                    slot_blocks[t].append(s.block_ids[pos // bs * k + t])
            if s.sample:  # logits only at each sampling row's last token (and its draft's)
                last_idx += range(len(ids) - 1 - s.num_draft, len(ids))
        arrays = [ids, positions, last_idx, [b for t in slot_blocks for b in t]]
        if self.block_tables is not None:
            arrays += self._paged_arrays(decodes, prefills)
        staged = self.staging.send(arrays)
        ids_t, pos_t, last_t = staged[:3]
        slot_t, offsets = staged[3].view(k, -1), pos_t % bs
        metas = [AttentionMetadata(slot_t[t], offsets, kv_offset=t * self.slots) for t in range(k)]
        step_tables = self._step_tables(staged[4:]) if self.block_tables is not None else None
        for t, meta in enumerate(metas):
            if step_tables is not None:
                meta.paged = self._paged_batch(decodes, prefills, staged[4:], step_tables, t)
                if self.model.config.features.mla is not None:  # its prefill is torch's
                    self._prefill_spans(meta, prefills, len(decodes), t)
            else:
                self._torch_groups(meta, decodes, prefills, t)
        meta = metas[0]
        meta.tables = tuple(metas[1:])
        if self.model.linear_states is not None:
            meta.state_rows = self._state_rows(rows, num_decode, requests)
        return StepInputs(rows, ids_t, pos_t, meta, last_t, num_decode, slot_t, step_tables)

    def _state_rows(
        self, rows: list[StepRow], num_decode: int, requests: list[Request] | None
    ) -> StateRows:
        """Each row's linear-attention state slot, and the checkpoints the step takes.

        A request's first chunk starts from a zeroed slot, a later one from where its last
        step left the slot -- or, when it resumes elsewhere (a prefix-cache hit, after a
        preemption too), from the checkpoint taken after exactly that prefix, copied in. A
        row that crosses a block boundary saves the state at its last one as that block's
        checkpoint (`StateCheckpoints.claim`: none if it has one).
        """
        states, ckpt_states = self.model.linear_states, self.model.linear_checkpoints
        assert states is not None and ckpt_states is not None
        kv = self.kv if self.kv is not None and self.kv.checkpoints is not None else None
        slots, restore_from, restore_to = [], [], []
        for i, s in enumerate(rows):
            slot = self.state_slot(s.request_id)
            if s.start == 0:
                states.reset(slot)
            elif self._state_pos.get(s.request_id) != s.start:
                if kv is None or requests is None:
                    raise RuntimeError(
                        f"request {s.request_id!r} resumes at token {s.start} without its "
                        "linear-attention state"
                    )
                restore_from.append(kv.checkpoint_slot(requests[i], s.start))
                restore_to.append(slot)
            self._state_pos[s.request_id] = s.start + s.num_new_tokens
            slots.append(slot)
        states.copy_slots(ckpt_states, restore_from, restore_to)
        self.num_state_restores += len(restore_from)
        saves = self._claim_checkpoints(rows, requests, set(restore_from)) if kv else {}
        chunks, start = [], num_decode
        for i in range(num_decode, len(rows)):
            n = rows[i].num_new_tokens
            chunks.append(Chunk(start, n, slots[i], *saves.get(i, (0, -1))))
            start += n
        decode_slots = torch.tensor(slots[:num_decode], dtype=torch.int64, device=self.device)
        decode_saves = tuple((slots[i], saves[i][1]) for i in range(num_decode) if i in saves)
        return StateRows(decode_slots, tuple(chunks), decode_saves, ckpt_states)

    def state_slot(self, request_id: str, num_tokens: int | None = None) -> int:
        """A request's linear-attention state slot, assigned at its first use; `num_tokens`:
        the caller has just put the state after that many tokens in it (a hand-off's)."""
        slot = self._state_slots.get(request_id)
        if slot is None:
            used = len(self._state_slots) + len(self._free_slots)
            slot = self._free_slots.pop() if self._free_slots else used
            self._state_slots[request_id] = slot
        if num_tokens is not None:
            self._state_pos[request_id] = num_tokens
        return slot

    def _claim_checkpoints(
        self, rows: list[StepRow], requests: list[Request] | None, pinned: set[int]
    ) -> dict[int, tuple[int, int]]:
        """Row index -> (tokens into the row, checkpoint slot) for each row crossing a block
        boundary whose prefix has no checkpoint yet: the last boundary it crosses."""
        assert self.kv is not None and self.kv.checkpoints is not None and requests is not None
        bs, saves = self.block_size, {}
        for i, (s, request) in enumerate(zip(rows, requests, strict=True)):
            boundary = (s.start + s.num_new_tokens) // bs * bs
            if boundary <= s.start or boundary // bs > len(request.block_hashes):
                continue
            slot = self.kv.checkpoints.claim(request.block_hashes[boundary // bs - 1], pinned)
            if slot is not None:
                pinned.add(slot)
                saves[i] = (boundary - s.start, slot)
        return saves

    def _paged_arrays(self, decodes: list[StepRow], prefills: list[StepRow]) -> list[list[int]]:
        """Host arrays of the paged batch: table rows, lengths, query starts, table writes."""
        tables = self.block_tables
        assert tables is not None
        table_rows = [tables.row(s.request_id, s.block_ids) for s in decodes + prefills]
        starts = [0]
        for s in prefills:
            starts.append(starts[-1] + s.num_new_tokens)
        return [
            table_rows,
            [s.start + 1 for s in decodes],
            [s.start + s.num_new_tokens for s in prefills],
            starts,
            *tables.take_writes(),
        ]

    def _step_tables(self, staged: list[torch.Tensor]) -> torch.Tensor:
        """The step's rows of the persistent tables, the step's writes applied first."""
        tables = self.block_tables
        assert tables is not None
        table_rows, _, _, _, *writes = staged
        tables.apply(*writes)
        return tables.table[table_rows]  # [rows, max_blocks * num_tables] int32

    def _paged_batch(
        self,
        decodes: list[StepRow],
        prefills: list[StepRow],
        staged: list[torch.Tensor],
        step_tables: torch.Tensor,
        table: int,
    ) -> PagedBatch:
        """The step as paged-attention kernels take it for KV table `table`: its columns of
        the interleaved rows (a view), the lengths from the staged arrays."""
        _, decode_lens, prefill_lens, starts, *_ = staged
        own = step_tables[:, table :: self.num_tables]  # [rows, max_blocks] int32
        nd, i32 = len(decodes), torch.int32
        return PagedBatch(
            num_decode=nd,
            decode_block_tables=own[:nd],
            decode_context_lens=decode_lens.to(i32),
            prefill_block_tables=own[nd:],
            prefill_query_starts=starts.to(i32),
            prefill_context_lens=prefill_lens.to(i32),
            max_query_len=max((s.num_new_tokens for s in prefills), default=0),
            max_decode_context_len=max((s.start + 1 for s in decodes), default=0),
        )

    def _torch_groups(
        self,
        meta: AttentionMetadata,
        decodes: list[StepRow],
        prefills: list[StepRow],
        table: int = 0,
    ) -> None:
        """TorchAttention's decode groups (padded, masked) and prefill spans, over KV table
        `table`'s blocks."""
        num_groups = max(1, min(MAX_DECODE_GROUPS, len(decodes) // MIN_DECODE_GROUP_ROWS))
        size = max(1, -(-len(decodes) // num_groups))
        for start in range(0, len(decodes), size):
            group = decodes[start : start + size]
            meta.decode_groups.append(self._decode_group(start, group, table))
        self._prefill_spans(meta, prefills, len(decodes), table)

    def _prefill_spans(self, meta: AttentionMetadata, rows: list[StepRow], at: int, t: int) -> None:
        """The prefill rows' spans over KV table `t`'s blocks, the first at flat index `at`."""
        own = [(s.start, s.num_new_tokens, s.block_ids[t :: self.num_tables]) for s in rows]
        meta.prefills += PrefillSpan.build(own, at, self.block_size, self.device)

    def _decode_group(self, start: int, rows: list[StepRow], table_index: int) -> DecodeGroup:
        bs, dev, k = self.block_size, self.device, self.num_tables
        ctx_lens = [s.start + 1 for s in rows]
        max_blocks = -(-max(ctx_lens) // bs)
        # Padding entries point at block 0; the key bias hides them.
        table = [list(s.block_ids[table_index::k][:max_blocks]) for s in rows]
        table = [t + [0] * (max_blocks - len(t)) for t in table]
        return DecodeGroup.build(
            start,
            torch.tensor(table, dtype=torch.int64, device=dev),
            torch.tensor(ctx_lens, dtype=torch.int64, device=dev),
            bs,
        )

    def execute(self, out: SchedulerOutput) -> dict[str, list[SampleResult]]:
        """Run one step. Returns the tokens every sampling row emits (tandem.engine.verify:
        one, or a verified draft's accepted tokens and the next)."""
        if out.is_empty:
            return {}
        rows = order_rows(out)
        step_rows = [StepRow.of(s) for s in rows]
        plan = StepPlan(step_rows, self._released, replay_size(step_rows, self.graphs))
        if self.followers is not None:  # the other ranks run the same step on their shards
            self.followers.send(plan)
            self._released = []
        step = self.prepare_rows(plan.rows, [s.request for s in rows])
        copies = self.rollback.copy_aside(rows) if self.rollback is not None else {}
        logits = self._logits(step, plan.graph_size)
        results = {} if logits is None else sample_scheduled(self.sampler, logits, rows)
        if copies and self.rollback is not None:  # a linear-attention state past a rejection
            self.rollback.restore(rows, copies, results)
        return results

    def follow(self, plan: StepPlan) -> None:
        """Another rank's step (tandem.engine.ranks): the same forward on this shard, its
        collectives matching the sending rank's (its graph replayed where that rank replays
        it, else eagerly); the logits are that rank's to sample."""
        for request_id in plan.released:
            self.release(request_id)
        if plan.rows:
            self._logits(self.prepare_rows(plan.rows), plan.graph_size)

    def _logits(self, step: StepInputs, graph_size: int | None) -> torch.Tensor | None:
        """Run the model over a step, replaying the captured graph of `graph_size` (the
        step's `replay_size`, decided by rank 0) or eagerly (None); the logits of its
        sampling rows (None: no row samples).

        Raises:
            RuntimeError: told to replay a graph this rank has not captured for these rows.
        """
        meta = step.meta
        num_rows, num_sampled = len(step.rows), step.last_idx.shape[0]
        graphs, paged = self.graphs, meta.paged
        if graph_size is not None:
            if (
                graphs is None
                or paged is None
                or step.num_decode != num_rows
                or graph_size_for(num_rows, graphs.sizes) != graph_size
            ):
                sizes = None if graphs is None else list(graphs.sizes)
                raise RuntimeError(
                    f"told to replay the decode graph of {graph_size} rows for a step of "
                    f"{num_rows} rows ({step.num_decode} decoding); this rank's graphs: {sizes}"
                )
            assert step.slot_blocks is not None and step.block_tables is not None
            logits = graphs.replay(
                num_rows,
                step.input_ids,
                step.positions,
                step.slot_blocks,
                meta.slot_offsets,
                step.block_tables,
                paged.decode_context_lens,
            )  # [rows, vocab], every row's last token
            if num_sampled < num_rows:
                logits = logits[step.last_idx]
            return logits if num_sampled else None
        hidden = self.model.forward(step.input_ids, step.positions, meta, self.kv_cache)
        if not num_sampled:
            return None
        return self.model.compute_logits(hidden[step.last_idx])

    # -- CUDA graphs for decode-only steps (see tandem.engine.cuda_graphs) -----------------

    def capture_decode_graphs(
        self, max_num_seqs: int, max_model_len: int, padding_block_id: int
    ) -> tuple[int, ...]:
        """Capture decode-only steps for the padded batch sizes of `capture_sizes`; later
        decode-only steps that fit replay them (`capture_graphs`). Returns the sizes."""
        plan = capture_plan(max_num_seqs, max_model_len, self.block_size, padding_block_id)
        self.capture_graphs(plan)
        return plan.sizes

    def capture_graphs(self, plan: CapturePlan) -> None:
        """Capture the decode graphs of `plan`. Needs CUDA and a backend whose launch grids
        depend only on shapes (`needs_paged_batch`). With followers they are told first and
        capture the same plan alongside (tandem.engine.ranks): the graphs' collectives are
        captured on every rank at once."""
        if not self.model.attention.needs_paged_batch:
            raise ValueError("CUDA graphs need the Triton attention backend")
        if self.followers is not None:
            self.followers.send(CaptureGraphs(plan))
        buffers = DecodeBuffers(
            plan.sizes[-1], plan.max_blocks, plan.padding_block_id, self.device, self.num_tables
        )
        graphs = DecodeGraphs(buffers, plan.sizes)
        graphs.capture(self._graph_forward)
        self.graphs = graphs

    def _graph_forward(self, inputs: DecodeInputs) -> torch.Tensor:
        """One decode-only step over static buffers: what a graph records."""
        rows, dev, k = inputs.input_ids.shape[0], self.device, self.num_tables
        metas = [
            AttentionMetadata(
                slot_block_ids=inputs.slot_block_ids[t],
                slot_offsets=inputs.slot_offsets,
                paged=PagedBatch(
                    num_decode=rows,
                    decode_block_tables=inputs.block_tables[:, t::k],
                    decode_context_lens=inputs.context_lens,
                    prefill_block_tables=torch.zeros((0, 1), dtype=torch.int32, device=dev),
                    prefill_query_starts=torch.zeros(1, dtype=torch.int32, device=dev),
                    prefill_context_lens=torch.zeros(0, dtype=torch.int32, device=dev),
                    max_query_len=0,
                    # A replay may hold any context: the split count for the longest.
                    max_decode_context_len=inputs.block_tables.shape[1] // k * self.block_size,
                ),
                kv_offset=t * self.slots,
            )
            for t in range(k)
        ]
        meta = metas[0]
        meta.tables = tuple(metas[1:])
        hidden = self.model.forward(inputs.input_ids, inputs.positions, meta, self.kv_cache)
        return self.model.compute_logits(hidden)
