"""The torch boundary: turns a SchedulerOutput into tensors, runs the model, samples."""

from __future__ import annotations

import torch

from tandem.engine.cuda_graphs import DecodeBuffers, DecodeGraphs, DecodeInputs, capture_sizes
from tandem.engine.sampling import Sampler, SampleResult, SampleRow
from tandem.engine.scheduler import ScheduledRequest, SchedulerOutput
from tandem.model.attention import AttentionMetadata, DecodeGroup, PagedBatch, PrefillSpan
from tandem.model.llama import LlamaModel

# Decode rows are split into groups of similar context length, each padded to its own
# longest row; a group holds at least this many rows (fewer groups = fewer kernel calls).
MIN_DECODE_GROUP_ROWS = 8
MAX_DECODE_GROUPS = 8


class ModelRunner:
    def __init__(
        self, model: LlamaModel, kv_cache: torch.Tensor, block_size: int, sampler: Sampler
    ) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.sampler = sampler
        self.device = kv_cache.device
        self.graphs: DecodeGraphs | None = None  # captured by capture_decode_graphs (CUDA)

    def prepare(
        self, out: SchedulerOutput
    ) -> tuple[list[ScheduledRequest], torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Order rows (decode first) and build input ids, positions and attention metadata."""
        # Longest context first, so each decode group is a contiguous run of rows.
        decodes = sorted((s for s in out.scheduled if s.is_decode), key=lambda s: -s.start)
        prefills = [s for s in out.scheduled if not s.is_decode]
        rows = decodes + prefills
        bs = self.block_size
        ids: list[int] = []
        positions: list[int] = []
        slot_blocks: list[int] = []
        for s in rows:
            ids += s.request.token_ids_slice(s.start, s.start + s.num_new_tokens)
            for pos in range(s.start, s.start + s.num_new_tokens):
                positions.append(pos)
                slot_blocks.append(s.block_ids[pos // bs])
        dev = self.device
        pos_t = torch.tensor(positions, dtype=torch.int64, device=dev)
        meta = AttentionMetadata(
            slot_block_ids=torch.tensor(slot_blocks, dtype=torch.int64, device=dev),
            slot_offsets=pos_t % bs,
        )
        num_groups = max(1, min(MAX_DECODE_GROUPS, len(decodes) // MIN_DECODE_GROUP_ROWS))
        size = max(1, -(-len(decodes) // num_groups))
        for start in range(0, len(decodes), size):
            group = decodes[start : start + size]
            meta.decode_groups.append(self._decode_group(start, group))
        token_start = len(decodes)
        for s in prefills:
            ctx = s.start + s.num_new_tokens
            blocks = torch.tensor(s.block_ids[: -(-ctx // bs)], dtype=torch.int64, device=dev)
            meta.prefills.append(PrefillSpan(token_start, s.num_new_tokens, ctx, blocks))
            token_start += s.num_new_tokens
        input_ids = torch.tensor(ids, dtype=torch.int64, device=dev)
        if self.model.attention.needs_paged_batch:
            meta.paged = paged_batch(decodes, prefills, bs, dev)
        return rows, input_ids, pos_t, meta

    def _decode_group(self, start: int, rows: list[ScheduledRequest]) -> DecodeGroup:
        bs, dev = self.block_size, self.device
        ctx_lens = [s.start + 1 for s in rows]
        max_blocks = -(-max(ctx_lens) // bs)
        # Padding entries point at block 0; the mask hides them.
        table = [list(s.block_ids[:max_blocks]) for s in rows]
        table = [t + [0] * (max_blocks - len(t)) for t in table]
        lens_t = torch.tensor(ctx_lens, dtype=torch.int64, device=dev)
        key_pos = torch.arange(max_blocks * bs, device=dev)
        return DecodeGroup(
            start=start,
            end=start + len(rows),
            block_tables=torch.tensor(table, dtype=torch.int64, device=dev),
            mask=(key_pos[None, :] < lens_t[:, None])[:, None, None, :],
        )

    def execute(self, out: SchedulerOutput) -> dict[str, SampleResult]:
        """Run one step. Returns the sampled token of every row that samples."""
        if out.is_empty:
            return {}
        decode_only = all(s.is_decode for s in out.scheduled)
        if decode_only and self.graphs is not None and self.graphs.can_serve(len(out.scheduled)):
            rows = list(out.scheduled)
            logits = self._replay_decode(rows)  # [rows, vocab], every row's last token
            sampled = [i for i, s in enumerate(rows) if s.sample]
            if len(sampled) < len(rows):
                logits = logits[torch.tensor(sampled, device=self.device)]
        else:
            rows, input_ids, positions, meta = self.prepare(out)
            hidden = self.model.forward(input_ids, positions, meta, self.kv_cache)
            # Logits only at each sampling row's last token.
            last_idx: list[int] = []
            offset = 0
            for s in rows:
                offset += s.num_new_tokens
                if s.sample:
                    last_idx.append(offset - 1)
            if not last_idx:
                return {}
            logits = self.model.compute_logits(hidden[torch.tensor(last_idx, device=self.device)])
        sampled_rows = [s for s in rows if s.sample]
        if not sampled_rows:
            return {}
        sample_rows = [
            SampleRow(
                s.request.sampling_params,
                s.request.prompt_token_ids,
                s.request.output_token_ids,
                s.request.generator,
            )
            for s in sampled_rows
        ]
        results = self.sampler(logits, sample_rows)
        return {s.request.request_id: res for s, res in zip(sampled_rows, results, strict=True)}

    # -- CUDA graphs for decode-only steps (see tandem.engine.cuda_graphs) -----------------

    def capture_decode_graphs(
        self, max_num_seqs: int, max_model_len: int, padding_block_id: int
    ) -> tuple[int, ...]:
        """Capture decode-only steps for the padded batch sizes of `capture_sizes`; later
        decode-only steps that fit replay them. Needs CUDA and a backend whose launch grids
        depend only on shapes (`needs_paged_batch`). Returns the captured sizes."""
        if not self.model.attention.needs_paged_batch:
            raise ValueError("CUDA graphs need the Triton attention backend")
        sizes = capture_sizes(max_num_seqs)
        max_blocks = -(-max_model_len // self.block_size)
        buffers = DecodeBuffers(sizes[-1], max_blocks, padding_block_id, self.device)
        graphs = DecodeGraphs(buffers, sizes)
        graphs.capture(self._graph_forward)
        self.graphs = graphs
        return sizes

    def _graph_forward(self, inputs: DecodeInputs) -> torch.Tensor:
        """One decode-only step over static buffers: what a graph records."""
        rows, dev = inputs.input_ids.shape[0], self.device
        meta = AttentionMetadata(
            slot_block_ids=inputs.slot_block_ids,
            slot_offsets=inputs.slot_offsets,
            paged=PagedBatch(
                num_decode=rows,
                decode_block_tables=inputs.block_tables,
                decode_context_lens=inputs.context_lens,
                prefill_block_tables=torch.zeros((0, 1), dtype=torch.int32, device=dev),
                prefill_query_starts=torch.zeros(1, dtype=torch.int32, device=dev),
                prefill_context_lens=torch.zeros(0, dtype=torch.int32, device=dev),
                max_query_len=0,
                # A replay may hold any context: the split count for the longest.
                max_decode_context_len=inputs.block_tables.shape[1] * self.block_size,
            ),
        )
        hidden = self.model.forward(inputs.input_ids, inputs.positions, meta, self.kv_cache)
        return self.model.compute_logits(hidden)

    def _replay_decode(self, rows: list[ScheduledRequest]) -> torch.Tensor:
        assert self.graphs is not None
        bs, dev = self.block_size, self.device
        paged = paged_batch(rows, [], bs, dev)
        ids = [s.request.token_ids_slice(s.start, s.start + 1)[0] for s in rows]
        positions = [s.start for s in rows]
        return self.graphs.replay(
            len(rows),
            torch.tensor(ids, dtype=torch.int64, device=dev),
            torch.tensor(positions, dtype=torch.int64, device=dev),
            torch.tensor(
                [s.block_ids[p // bs] for s, p in zip(rows, positions, strict=True)],
                dtype=torch.int64,
                device=dev,
            ),
            torch.tensor([p % bs for p in positions], dtype=torch.int64, device=dev),
            paged.decode_block_tables,
            paged.decode_context_lens,
        )


def paged_batch(
    decodes: list[ScheduledRequest],
    prefills: list[ScheduledRequest],
    block_size: int,
    device: torch.device,
) -> PagedBatch:
    """The step's rows as paged-attention kernels take them (see PagedBatch)."""

    def table(rows: list[ScheduledRequest], ctx_lens: list[int]) -> torch.Tensor:
        # Padding entries (past a row's context) are never read; 0 keeps them in range.
        width = max((-(-c // block_size) for c in ctx_lens), default=1)
        padded = [
            list(s.block_ids[: -(-c // block_size)]) + [0] * (width - -(-c // block_size))
            for s, c in zip(rows, ctx_lens, strict=True)
        ]
        return torch.tensor(padded, dtype=torch.int32, device=device).view(len(rows), width)

    decode_lens = [s.start + 1 for s in decodes]
    prefill_lens = [s.start + s.num_new_tokens for s in prefills]
    starts = [0]
    for s in prefills:
        starts.append(starts[-1] + s.num_new_tokens)
    return PagedBatch(
        num_decode=len(decodes),
        decode_block_tables=table(decodes, decode_lens),
        decode_context_lens=torch.tensor(decode_lens, dtype=torch.int32, device=device),
        prefill_block_tables=table(prefills, prefill_lens),
        prefill_query_starts=torch.tensor(starts, dtype=torch.int32, device=device),
        prefill_context_lens=torch.tensor(prefill_lens, dtype=torch.int32, device=device),
        max_query_len=max((s.num_new_tokens for s in prefills), default=0),
        max_decode_context_len=max(decode_lens, default=0),
    )
