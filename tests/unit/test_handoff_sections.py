"""A hand-off's typed sections (tandem.transfer.sections): a reader resumes only from exactly
the sections its model needs, each complete and of its format; the sections are signed; and a
linear-attention state packs into KV blocks and back bit for bit (tandem.engine.state_pages)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from tandem.engine.state_pages import pack_state, pages_format, unpack_state
from tandem.model.layer_groups import LayerKind, LinearAttention, group_layers, kv_layout
from tandem.model.linear_attention import LinearStates
from tandem.services.common.rpc import convert
from tandem.transfer.sections import HandoffSection, SectionRefused, check_sections
from tandem.transfer.sections import SectionKind as K
from tandem.transfer.signing import sign_handoff, verify_handoff
from tests.unit.test_signing import HANDOFF, HASHES, KEY

BS, BLOCK_BYTES = 4, 100
STATE = ("gdn.v1 recurrent=float32[2x4x8x8] conv=bfloat16[2x48x3]", 250)  # 3 blocks
EXPECTED = {K.ATTENTION: ("bfloat16", 0), K.LINEAR_STATE: STATE}
PAGES = HandoffSection("attention", "bfloat16", 3)  # a 10-token prompt
PACKED = HandoffSection("linear_state", STATE[0], 3, 250)


def check(sections, expected=EXPECTED, num_ids=6):  # type: ignore[no-untyped-def]
    return check_sections(sections, expected, num_ids, -(-10 // BS), BLOCK_BYTES)


def test_complete_sections_give_each_its_blocks() -> None:
    assert check([PAGES, PACKED]) == {K.ATTENTION: range(0, 3), K.LINEAR_STATE: range(3, 6)}
    dense = {K.ATTENTION: ("bfloat16", 0)}
    assert check([PAGES], dense, 3) == {K.ATTENTION: range(0, 3)}
    # an owner before sections: its blocks are all pages, for a model that keeps no more
    assert check([], dense, 4) == {K.ATTENTION: range(0, 4)}


@pytest.mark.parametrize(
    ("sections", "num_ids", "reason"),
    [
        ([], 3, "the linear_state section is missing"),
        ([PAGES], 3, "the linear_state section is missing"),
        ([PACKED], 3, "the attention section is missing"),
        # truncated: a block short, or fewer bytes than this worker's state
        ([PAGES, dataclasses.replace(PACKED, num_blocks=2)], 5, "has 2 blocks, need 3"),
        ([PAGES, dataclasses.replace(PACKED, num_bytes=200)], 6, "holds 200 bytes"),
        ([dataclasses.replace(PAGES, num_blocks=2), PACKED], 5, "has 2 blocks, need 3"),
        # of another format
        ([PAGES, dataclasses.replace(PACKED, format="gdn.v1 recurrent=bfloat16[2x4x8x8]")], 6,
         "the linear_state section is 'gdn.v1 recurrent=bfloat16"),
        ([dataclasses.replace(PAGES, format="float8_e4m3fn"), PACKED], 6,
         "the attention section is 'float8_e4m3fn', this worker's is 'bfloat16'"),
        # sections that do not account for the handle's blocks, or are not understood
        ([PAGES, PACKED], 7, "sections name 6 blocks, the handle 7"),
        ([PACKED, PAGES], 6, "repeat or are out of order"),
        ([PAGES, PAGES, PACKED], 9, "repeat or are out of order"),
        ([PAGES, PACKED, HandoffSection("mla_latent", "x", 1)], 7, "unknown sections"),
    ],
)  # fmt: skip
def test_a_section_missing_truncated_or_of_another_format_is_refused(
    sections, num_ids, reason
) -> None:
    with pytest.raises(SectionRefused, match=reason.replace("[", r"\[")):
        check(sections, num_ids=num_ids)


def test_several_kv_tables_need_their_pages_section_of_their_layout() -> None:
    """A sliding model's pages: each table's live blocks (here 7: a full table's 3 and
    two sliding tables' 2 each), in a section naming the layout. A handle without sections
    (an owner whose pages are one table), one of another layout, or one that sends every
    block of its sliding tables instead of their windows is refused."""
    fmt = pages_format(
        "bfloat16", kv_layout(group_layers([LayerKind.SLIDING] * 2 + [LayerKind.FULL], 5))
    )
    assert fmt == "bfloat16 slots1[f:2,s5:0,s5:1]"
    pages = HandoffSection("attention", fmt, 7)
    expected = {K.ATTENTION: (fmt, 0)}

    def check_tables(sections, num_ids=7):  # type: ignore[no-untyped-def]
        return check_sections(sections, expected, num_ids, 7, BLOCK_BYTES, needs_sections=True)

    assert check_tables([pages]) == {K.ATTENTION: range(7)}
    with pytest.raises(SectionRefused, match="the attention section is missing"):
        check_tables([])
    other = dataclasses.replace(pages, format="bfloat16 slots3[f:0.1.2]")
    with pytest.raises(SectionRefused, match="slots3"):
        check_tables([other])
    with pytest.raises(SectionRefused, match="has 9 blocks, need 7"):
        check_tables([dataclasses.replace(pages, num_blocks=9)], 9)


def test_a_state_section_for_a_model_without_linear_layers_is_refused() -> None:
    with pytest.raises(SectionRefused, match="hold state this model does not keep"):
        check([PAGES, PACKED], {K.ATTENTION: ("bfloat16", 0)})


@pytest.mark.parametrize(
    "change",
    [
        {"kind": "attention2"},
        {"format": "float32 "},
        {"num_blocks": 2},
        {"num_bytes": 249},
    ],
)
def test_every_section_field_is_signed(change) -> None:  # type: ignore[no-untyped-def]
    handoff = dataclasses.replace(HANDOFF, sections=(PAGES, PACKED))
    signed = dataclasses.replace(handoff, signature=sign_handoff(KEY, "r1", HASHES, handoff))
    assert verify_handoff(KEY, "r1", HASHES, signed)
    back = convert.handoff_from_proto(convert.handoff_to_proto(signed))
    assert back == signed and verify_handoff(KEY, "r1", HASHES, back)
    forged = dataclasses.replace(signed, sections=(PAGES, dataclasses.replace(PACKED, **change)))
    assert not verify_handoff(KEY, "r1", HASHES, forged)
    dropped = dataclasses.replace(signed, sections=(PAGES,))
    assert not verify_handoff(KEY, "r1", HASHES, dropped)


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.bfloat16, torch.float8_e4m3fn])
def test_a_state_packs_into_kv_blocks_and_back_exactly(kv_dtype: torch.dtype) -> None:
    """Odd sizes (a conv of 3 x 10 x 3 bf16 elements after 4-byte floats) in a cache of any
    dtype: the unpacked state equals the packed one bit for bit, and blocks not named are
    untouched."""
    cfg = LinearAttention(num_k_heads=1, num_v_heads=2, k_dim=3, v_dim=2, conv_kernel=4)
    src = LinearStates(cfg, 3, torch.bfloat16, torch.device("cpu"))
    dst = LinearStates(cfg, 3, torch.bfloat16, torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    src.recurrent.copy_(torch.randn(src.recurrent.shape, generator=g))
    src.conv.copy_(torch.randn(src.conv.shape, generator=g))
    kv = torch.zeros(64, 1, 2, 2, 1, 4).to(kv_dtype)  # 32-byte blocks in float32, 8 in fp8
    num = -(-(src.recurrent[5].nbytes + src.conv[5].nbytes) // (kv[0].nbytes))
    ids = torch.randperm(64, generator=g)[:num].tolist()
    pack_state(src, 5, kv, ids)
    untouched = [b for b in range(64) if b not in ids]
    assert not kv[untouched].view(torch.uint8).any()
    unpack_state(dst, 2, kv, ids)
    assert torch.equal(dst.recurrent[2], src.recurrent[5])
    assert torch.equal(dst.conv[2].view(torch.int16), src.conv[5].view(torch.int16))
    assert not dst.recurrent[5].any()  # only the named slot was written
