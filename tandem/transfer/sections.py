"""A hand-off's typed sections: which of its blocks hold what (issue 42).

A hybrid model's request state is not only per-token KV. The blocks a hand-off names are
split into typed sections, in this order, each signed with the rest of the handle:

    attention      the prompt's KV pages: one table's cdiv(prompt, block) blocks, or with
                   several KV tables (tandem.model.layer_groups.KVLayout: sliding layers
                   apart from full ones) each table's blocks the next token reads, table by
                   table -- a sliding table only its window's; the format names the layout
    linear_state   a linear-attention model's (Qwen3-Next) per-request state after the
                   prompt: every linear layer's convolution inputs and recurrent matrices,
                   `num_bytes` of them packed into the section's blocks
    draft_kv       a draft model's KV for the prompt (speculative decoding, issue 45:
                   tandem.engine.drafting), whole draft blocks packed into the section's
                   blocks: the decode worker drafts from its first step without prefilling
                   the draft; its format names the draft checkpoint and its cache geometry

Each section names its format (the attention cache's dtype and scales; the state's dtypes and
shapes). A reader accepts a hand-off only when it has exactly the sections its own model needs,
each complete and of the reader's format (`check_sections`); anything else is refused before a
byte is read, and the request is prefilled again -- a decode from partial state would serve
wrong tokens with no error anywhere. A handle without sections (from an owner that predates
them) is one attention section: a model without linear layers reads it as before.

Pure: no torch, no engine.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum


class SectionKind(StrEnum):
    ATTENTION = "attention"
    LINEAR_STATE = "linear_state"
    DRAFT_KV = "draft_kv"


ORDER = (SectionKind.ATTENTION, SectionKind.LINEAR_STATE, SectionKind.DRAFT_KV)


@dataclass(frozen=True, slots=True)
class HandoffSection:
    """One typed run of a hand-off's blocks.

    Attributes:
        kind: a `SectionKind` value (any string on the wire; an unknown one is refused).
        format: what the bytes are, as the owner's engine names it (`check_sections`
            compares it with the reader's).
        num_blocks: the section's blocks, following the previous sections' in the handle.
        num_bytes: linear_state and draft_kv: the payload's bytes (its last block is
            padded); 0 for attention, whose size the prompt sets.
    """

    kind: str
    format: str
    num_blocks: int
    num_bytes: int = 0


class SectionRefused(ValueError):
    """A hand-off whose sections this reader cannot resume from; the message says why."""


def check_sections(
    sections: Sequence[HandoffSection],
    expected: Mapping[SectionKind, tuple[str, int]],
    num_block_ids: int,
    attention_blocks: int,
    block_bytes: int,
    needs_sections: bool = False,
) -> dict[SectionKind, range]:
    """Each section's blocks (indices into the handle's block ids), when the hand-off holds
    exactly the sections the reader needs, complete and of its format.

    Args:
        sections: the handle's (empty: its blocks are all attention pages, as `plan_read`
            checks).
        expected: kind -> (format, payload bytes; 0 for attention) for every section the
            reader's model needs; attention always.
        num_block_ids: blocks the handle names.
        attention_blocks: the pages the attention section must hold (the reader's layout
            for the prompt: `KVLayout.live_blocks`).
        block_bytes: bytes per block (both sides': their layouts were checked equal).
        needs_sections: the reader's pages are not one plain table (several KV tables), so
            a handle without sections is refused even when no state is expected.

    Raises:
        SectionRefused: a section missing, unknown, repeated, out of order, of another
            format, or truncated (fewer blocks or bytes than the reader's state has), or
            sections that do not account for the handle's blocks exactly.
    """
    if not sections:  # an owner before sections: its blocks are the prompt's KV pages
        missing = [k.value for k in expected if k is not SectionKind.ATTENTION or needs_sections]
        if missing:
            raise SectionRefused(f"the {', '.join(missing)} section is missing")
        return {SectionKind.ATTENTION: range(num_block_ids)}
    kinds = [s.kind for s in sections]
    unknown = sorted(set(kinds) - {k.value for k in SectionKind})
    if unknown:
        raise SectionRefused(f"unknown sections {unknown}")
    if len(set(kinds)) != len(kinds) or kinds != [k for k in ORDER if k in kinds]:
        raise SectionRefused(f"sections {kinds} repeat or are out of order")
    missing = [k.value for k in expected if k not in kinds]
    if missing:
        raise SectionRefused(f"the {', '.join(missing)} section is missing")
    extra = [k for k in kinds if SectionKind(k) not in expected]
    if extra:
        why = (
            " (a draft model's KV: this worker drafts without that draft model)"
            if SectionKind.DRAFT_KV in extra
            else ""
        )
        raise SectionRefused(f"sections {extra} hold state this model does not keep{why}")
    ranges: dict[SectionKind, range] = {}
    start = 0
    for s in sections:
        kind = SectionKind(s.kind)
        fmt, num_bytes = expected[kind]
        if s.format != fmt:
            raise SectionRefused(f"the {kind} section is {s.format!r}, this worker's is {fmt!r}")
        if kind is SectionKind.ATTENTION:
            need = attention_blocks
        else:
            need = -(-num_bytes // block_bytes)
            if s.num_bytes != num_bytes:
                raise SectionRefused(
                    f"the {kind} section holds {s.num_bytes} bytes, this worker's state "
                    f"is {num_bytes}"
                )
        if s.num_blocks != need:
            raise SectionRefused(f"the {kind} section has {s.num_blocks} blocks, need {need}")
        ranges[kind] = range(start, start + s.num_blocks)
        start += s.num_blocks
    if start != num_block_ids:
        raise SectionRefused(f"sections name {start} blocks, the handle {num_block_ids}")
    return ranges
