"""A decode engine hands a decoding stream off to another (issue 46: a draining decode worker
moves its streams with their KV): `hand_off_running` pins the KV of the prompt and every output
token but the last; the other engine reserves as much (`reserve_kv` with the stream's tokens),
takes the blocks and continues token-identically, greedy and seeded."""

from __future__ import annotations

import pytest

from tandem.config import EngineRole, SpeculativeConfig
from tandem.engine.request import Resume
from tandem.engine.sampling import SamplingParams
from tests.unit.test_engine import copy_blocks
from tests.unit.test_speculative import GREEDY, SEEDED, prompts_with_repeats


def move(a, b, rid: str, prompt: list[int], params: SamplingParams) -> list[int]:
    """Hand `rid` off from decode engine `a` (its blocks copied as a transport would) to `b`,
    which runs it to the end; the tokens of the whole stream."""
    out = a.hand_off_running(rid)
    assert out is not None and out.handed_off
    request = a.get_request(rid)
    outputs = list(request.output_token_ids)
    assert len(out.block_ids) == -(-(len(prompt) + len(outputs) - 1) // a.kv.block_size)
    reserved = b.reserve_kv(b.spec(rid, prompt, params), Resume(tuple(outputs)))
    assert reserved is not None
    dst, cached = reserved
    first = cached // b.kv.block_size
    copy_blocks(a, out.block_ids[first : len(dst)], b, dst[first:])
    b.commit_kv(rid)
    assert a.release(rid)
    moved = b.get_request(rid)
    while b.has_unfinished():
        b.step()
    return moved.output_token_ids


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_a_decoding_stream_moves_to_another_engine_and_continues_exactly(
    tiny_model_dir, engine_factory, params
):
    prompts = prompts_with_repeats(46, 3)
    whole = [c.token_ids for c in engine_factory(tiny_model_dir).generate(prompts, params)]
    a = engine_factory(tiny_model_dir, role=EngineRole.DECODE)
    b = engine_factory(tiny_model_dir, role=EngineRole.DECODE)
    for i, prompt in enumerate(prompts):
        rid = f"s{i}"
        request = a.add_request(a.spec(rid, prompt, params))
        assert a.hand_off_running(rid) is None  # waiting: nothing computed to move yet
        while len(request.output_token_ids) < 5 + 3 * i:  # mid-stream, at another point each
            a.step()
        assert move(a, b, rid, prompt, params) == whole[i]
    for engine in (a, b):
        engine.check_integrity()
        assert engine.num_free_blocks() == engine.num_blocks


def test_an_engine_with_a_draft_model_keeps_its_streams(tiny_model_dir, engine_factory):
    """A draft model's KV is not in such a hand-off: its streams finish where they are."""
    spec = SpeculativeConfig(method="draft", draft_model=str(tiny_model_dir), max_batch=8)
    a = engine_factory(tiny_model_dir, role=EngineRole.DECODE, speculative=spec)
    request = a.add_request(a.spec("d", prompts_with_repeats(47, 1)[0], GREEDY))
    while len(request.output_token_ids) < 3:
        a.step()
    assert a.hand_off_running("d") is None
