"""A linear-attention request's state packed into KV blocks, so that a hand-off moves it
with the prompt's pages (issue 42: Qwen3-Next's state travels, no recompute).

The state (every linear layer's recurrent matrices, float32, then its convolution inputs, in
the model's dtype) is `num_bytes` bytes; its section (tandem.transfer.sections) is the
ceil(num_bytes / block_bytes) blocks that follow the prompt's pages in the handle. The owner
packs them when it hands the request off (blocks taken for the request, freed with it); the
reader reserves as many, reads them with the pages, and unpacks them into the request's slot
before freeing them. The blocks are raw bytes to every transport, whatever the cache's dtype.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from tandem.model.layer_groups import KVLayout
from tandem.model.linear_attention import LinearStates
from tandem.transfer.sections import HandoffSection, SectionKind

if TYPE_CHECKING:
    from tandem.engine.kv_manager import KVCacheManager
    from tandem.engine.runner import ModelRunner


def state_format(states: LinearStates) -> str:
    """What a packed state's bytes are: two workers exchange it only when this is equal."""
    rec, conv = states.recurrent.shape[1:], states.conv.shape[1:]
    dims = "x".join
    return (
        f"gdn.v1 recurrent={str(states.recurrent.dtype).removeprefix('torch.')}"
        f"[{dims(map(str, rec))}] conv={str(states.conv.dtype).removeprefix('torch.')}"
        f"[{dims(map(str, conv))}]"
    )


def num_state_blocks(states: LinearStates, kv_cache: torch.Tensor) -> int:
    return -(-states.slot_bytes() // _rows(kv_cache).shape[1])


def pack_state(
    states: LinearStates, slot: int, kv_cache: torch.Tensor, block_ids: list[int]
) -> None:
    """Slot `slot`'s state into `block_ids` (num_state_blocks of them), the last padded."""
    payload = torch.cat(
        [
            states.recurrent[slot].reshape(-1).view(torch.uint8),
            states.conv[slot].reshape(-1).view(torch.uint8),
        ]
    )
    write_payload(kv_cache, block_ids, payload)


def unpack_state(
    states: LinearStates, slot: int, kv_cache: torch.Tensor, block_ids: list[int]
) -> None:
    """The state packed in `block_ids` into slot `slot`."""
    n_rec, n_conv = states.recurrent[slot].nbytes, states.conv[slot].nbytes
    payload = read_payload(kv_cache, block_ids, n_rec + n_conv)
    rec, conv = states.recurrent, states.conv
    rec[slot] = payload[:n_rec].view(rec.dtype).view(rec.shape[1:])
    conv[slot] = payload[n_rec:].view(conv.dtype).view(conv.shape[1:])


def write_payload(kv_cache: torch.Tensor, block_ids: list[int], payload: torch.Tensor) -> None:
    """`payload` (bytes) into the cache's blocks `block_ids`, the last one padded with zeros:
    the blocks are raw bytes to every transport, whatever the cache's dtype."""
    rows = _rows(kv_cache)
    padded = torch.zeros(len(block_ids) * rows.shape[1], dtype=torch.uint8, device=rows.device)
    padded[: payload.numel()] = payload.to(rows.device)
    rows[block_ids] = padded.view(len(block_ids), -1)


def read_payload(kv_cache: torch.Tensor, block_ids: list[int], num_bytes: int) -> torch.Tensor:
    """The first `num_bytes` bytes packed in `block_ids` (a copy)."""
    return _rows(kv_cache)[block_ids].reshape(-1)[:num_bytes].clone()


def _rows(kv_cache: torch.Tensor) -> torch.Tensor:
    """The cache as [num_blocks, block_bytes] bytes (block-major and contiguous)."""
    return kv_cache.view(kv_cache.shape[0], -1).view(torch.uint8)


class AppendedSection:
    """A hand-off section that follows the pages (a linear state, a draft model's KV) in
    blocks appended to the request's table. On the decode role, the blocks reserved for each
    request's read, until unpacked (`_unpack`: they go back) or the request is gone."""

    def __init__(self, kv: KVCacheManager) -> None:
        self.kv = kv
        self._reserved: dict[str, list[int]] = {}  # decode role: request id -> its blocks

    def _reserve(self, request_id: str, num_blocks: int) -> list[int] | None:
        """`num_blocks` more blocks on the request's table to read into; None when too few
        are free."""
        ids = self.kv.append_blocks(request_id, num_blocks)
        if ids is not None:
            self._reserved[request_id] = ids
        return ids

    def _unpack(self, request_id: str, read: Callable[[list[int]], None]) -> None:
        """`read` the blocks reserved for the request, then drop them from its table; nothing
        for a request without."""
        ids = self._reserved.pop(request_id, None)
        if ids is not None:
            read(ids)
            self.kv.drop_blocks(request_id, len(ids))

    def forget(self, request_id: str) -> None:
        """The request is gone (its blocks went back with its table)."""
        self._reserved.pop(request_id, None)

    def num_reserved(self) -> int:
        return len(self._reserved)


class StateHandoff(AppendedSection):
    """A linear-attention engine's side of a hand-off's linear_state section.

    Prefill role: `pack` puts a handed-off request's state in blocks appended to its table
    (pinned with its pages, freed with them). Decode role: `reserve` appends as many blocks
    to a reserved request's table for the read, `unpack` moves what was read into the
    request's slot and frees them.
    """

    def __init__(self, kv: KVCacheManager, runner: ModelRunner, states: LinearStates) -> None:
        super().__init__(kv)
        self.runner, self.states = runner, states
        self.format = state_format(states)
        self.num_bytes = states.slot_bytes()
        self.num_blocks = num_state_blocks(states, runner.kv_cache)

    def pack(self, request_id: str) -> int:
        """Blocks now holding the request's state, after its pages; 0 when too few are free
        (the hand-off then has no state section, and its reader prefills again)."""
        ids = self.kv.append_blocks(request_id, self.num_blocks)
        if ids is None:
            return 0
        pack_state(self.states, self.runner.state_slot(request_id), self.runner.kv_cache, ids)
        return len(ids)

    def reserve(self, request_id: str) -> list[int] | None:
        """Blocks to read a hand-off's state into; None when too few are free."""
        return self._reserve(request_id, self.num_blocks)

    def unpack(self, request_id: str, num_tokens: int) -> None:
        """The state read into the reserved blocks, after `num_tokens` prompt tokens, into
        the request's slot; the blocks go back. Nothing to do for a request without."""

        def read(ids: list[int]) -> None:
            slot = self.runner.state_slot(request_id, num_tokens)
            unpack_state(self.states, slot, self.runner.kv_cache, ids)

        self._unpack(request_id, read)


def handoff_sections(
    pages_format: str,
    num_blocks: int,
    state: StateHandoff | None,
    state_blocks: int,
    sectioned: bool = False,
    draft: HandoffSection | None = None,
) -> tuple[HandoffSection, ...]:
    """A hand-off's sections (tandem.transfer.sections) for `num_blocks` blocks whose last
    hold a packed state (`state_blocks`) and then a draft model's KV (`draft`'s): none for a
    model with one plain KV table, no linear layers and no draft (its handle signs as
    before sections existed), else the pages (in `pages_format`: `LLMEngine.pages_format`)
    and, when packed, the state and the draft's KV. `sectioned`: the pages are several KV
    tables, which always travel in a typed section."""
    if state is None and draft is None and not sectioned:
        return ()
    num_draft = draft.num_blocks if draft is not None else 0
    pages = HandoffSection(
        SectionKind.ATTENTION, pages_format, num_blocks - state_blocks - num_draft
    )
    sections = [pages]
    # no room to pack a state: its reader refuses the hand-off and prefills again
    if state is not None and state_blocks:
        sections.append(
            HandoffSection(SectionKind.LINEAR_STATE, state.format, state_blocks, state.num_bytes)
        )
    if draft is not None:
        sections.append(draft)
    return tuple(sections)


def expected_sections(
    kv_format: str, state: StateHandoff | None, draft: tuple[str, int] | None = None
) -> dict[SectionKind, tuple[str, int]]:
    """The sections a reader with this cache, state and draft model (its section's format
    and bytes for the prompt) needs (`check_sections`)."""
    expected = {SectionKind.ATTENTION: (kv_format, 0)}
    if state is not None:
        expected[SectionKind.LINEAR_STATE] = (state.format, state.num_bytes)
    if draft is not None:
        expected[SectionKind.DRAFT_KV] = draft
    return expected


def pages_format(kv_format: str, layout: KVLayout) -> str:
    """The format of a hand-off's attention pages (its section's `format`): the KV cache's
    and, with several KV tables, their layout, which reader and owner must share."""
    return f"{kv_format} {layout.describe()}" if layout.num_tables > 1 else kv_format
