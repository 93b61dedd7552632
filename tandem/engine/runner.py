"""The torch boundary: turns a SchedulerOutput into tensors, runs the model, samples."""

from __future__ import annotations

import torch

from tandem.engine.sampling import Sampler, SampleResult, SampleRow
from tandem.engine.scheduler import ScheduledRequest, SchedulerOutput
from tandem.model.attention import AttentionMetadata, DecodeGroup, PrefillSpan
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
        rows, input_ids, positions, meta = self.prepare(out)
        hidden = self.model.forward(input_ids, positions, meta, self.kv_cache)
        # Logits only at each sampling row's last token.
        last_idx: list[int] = []
        sample_rows: list[SampleRow] = []
        offset = 0
        for s in rows:
            offset += s.num_new_tokens
            if s.sample:
                last_idx.append(offset - 1)
                r = s.request
                sample_rows.append(
                    SampleRow(
                        r.sampling_params, r.prompt_token_ids, r.output_token_ids, r.generator
                    )
                )
        if not last_idx:
            return {}
        logits = self.model.compute_logits(hidden[torch.tensor(last_idx, device=self.device)])
        results = self.sampler(logits, sample_rows)
        sampled = [s for s in rows if s.sample]
        return {s.request.request_id: res for s, res in zip(sampled, results, strict=True)}
