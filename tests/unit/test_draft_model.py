"""Speculative decoding with a draft model (issue 45): a smaller model sharing the target's
tokenizer drafts greedily from its own paged KV; output stays token-identical to plain
decoding, colocated and disaggregated; the prefill worker hands the draft's KV over in a
typed, signed section so the decode worker never prefills the draft; a draft that cannot
serve the target is refused with the reason."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch

from tandem.config import EngineRole, SpeculativeConfig
from tandem.engine.drafting import DraftProposer, check_draft, fingerprint
from tandem.engine.grammar import Constraint
from tandem.engine.request import Resume
from tandem.engine.sampling import SamplingParams
from tandem.engine.state_pages import expected_sections, handoff_sections
from tandem.model.config import ModelConfig
from tandem.transfer.sections import HandoffSection, SectionKind, SectionRefused, check_sections
from tandem.weights.tiny import get_preset, make_tiny_model
from tests.unit.test_engine import copy_blocks
from tests.unit.test_speculative import GREEDY, SEEDED, prompts_with_repeats, run


@pytest.fixture(scope="module")
def other_draft(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A one-layer model with the tiny preset's tokenizer and other weights: a draft whose
    guesses the target mostly rejects."""
    small = dataclasses.replace(get_preset("tiny"), num_hidden_layers=1)
    return make_tiny_model(tmp_path_factory.mktemp("draft"), preset=small, seed=1)


def draft_engine(factory, target: Path, draft: Path, **kw):
    # adaptive=False: draft k tokens every step (on a CPU the cost rule would not draft
    # with a draft as costly as these tiny targets)
    spec = SpeculativeConfig(method="draft", draft_model=str(draft), num_speculative_tokens=3,
                             max_batch=8, adaptive=False)  # fmt: skip
    return factory(target, speculative=spec, **kw)


def hand_off(prefill, decode, rid: str, prompt: list[int], params: SamplingParams) -> list[int]:
    """Prefill on one engine, decode on another: the pages and the draft_kv section copied
    as a transport would, into the blocks the decode engine reserved for each."""
    prefill.add_request(prefill.spec(rid, prompt, params))
    while not (outs := [o for o in prefill.step() if o.request_id == rid]):
        pass
    [out] = outs
    assert out.handed_off and out.draft_blocks > 0
    src = prefill.block_table(rid)
    pages = len(src) - out.draft_blocks
    dst, num_cached = decode.reserve_kv(decode.spec(rid, prompt, params), Resume(out.new_token_ids))
    first = num_cached // decode.kv.block_size
    copy_blocks(prefill, src[first:pages], decode, dst[first:])
    into = decode.reserve_section(rid, SectionKind.DRAFT_KV)
    copy_blocks(prefill, src[pages:], decode, into)
    decode.commit_kv(rid)
    request = decode.get_request(rid)
    assert prefill.release(rid)
    while decode.has_unfinished():
        decode.step()
    return request.output_token_ids


def all_free(engine) -> bool:
    proposer = engine.speculator.proposer
    pool = proposer.kv_cache.shape[0]
    return (
        engine.num_free_blocks() == engine.num_blocks
        and proposer.num_requests() == 0
        and len(proposer._free) == pool
    )


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_a_draft_model_leaves_the_output_unchanged_colocated_and_disaggregated(
    tiny_model_dir, other_draft, engine_factory, params
):
    prompts = prompts_with_repeats(21, 4)
    ref, _ = run(engine_factory(tiny_model_dir), prompts, params)
    for draft in (tiny_model_dir, other_draft):  # the target itself: every greedy guess right
        full = draft_engine(engine_factory, tiny_model_dir, draft)
        got, _ = run(full, prompts, params)
        assert got == ref
        stats = full.spec_stats()[0]
        assert stats.proposer == "draft" and stats.verify_rows > 0
        if draft == tiny_model_dir and params is GREEDY:
            assert stats.accepted_tokens == stats.proposed_tokens
        elif draft == other_draft:
            assert stats.accepted_tokens < stats.proposed_tokens
        assert stats.draft_prefill_tokens == sum(map(len, prompts))
        assert all_free(full)
        prefill = draft_engine(engine_factory, tiny_model_dir, draft, role=EngineRole.PREFILL)
        decode = draft_engine(engine_factory, tiny_model_dir, draft, role=EngineRole.DECODE)
        split = [hand_off(prefill, decode, f"r{i}", p, params) for i, p in enumerate(prompts)]
        assert split == ref
        d = decode.spec_stats()[0]
        # decode drafted exactly as the colocated engine, from the handed-over draft KV
        assert dataclasses.replace(d, draft_prefill_tokens=0, draft_handoff_tokens=0) == (
            dataclasses.replace(stats, draft_prefill_tokens=0)
        )
        assert d.draft_prefill_tokens == 0
        assert d.draft_handoff_tokens == sum(map(len, prompts))
        assert prefill.spec_stats()[0].draft_prefill_tokens == sum(map(len, prompts))
        assert all_free(prefill) and all_free(decode)


def test_prefix_hits_chunked_prefill_preemption_and_grammars_stay_exact(
    tiny_model_dir, other_draft, engine_factory
):
    tight = dict(num_blocks=40, long_prefill_token_threshold=5, max_num_seqs=8)
    prompts = prompts_with_repeats(22, 8) * 2
    params = SamplingParams(max_tokens=20, temperature=0.7, seed=5, repetition_penalty=1.3)
    ref, _ = run(engine_factory(tiny_model_dir, **tight), prompts, params)
    engine = draft_engine(engine_factory, tiny_model_dir, tiny_model_dir, **tight)
    assert engine.speculator.proposer.kv_cache.shape[0] == 40  # no more than the target's
    got, _ = run(engine, prompts, params)
    assert got == ref
    assert engine.scheduler.num_preemptions > 0 and engine.cached_prompt_tokens > 0
    assert all_free(engine)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    constrained = SamplingParams(max_tokens=20, temperature=0.0,
                                 constraint=Constraint.json_schema(schema))  # fmt: skip
    ref, _ = run(engine_factory(tiny_model_dir), prompts[:3], constrained)
    for draft in (tiny_model_dir, other_draft):
        engine = draft_engine(engine_factory, tiny_model_dir, draft)
        got, _ = run(engine, prompts[:3], constrained)
        assert got == ref


def make_proposer(model_dir: Path, num_blocks: int, block_size: int = 4) -> DraftProposer:
    from tandem.engine.kv_cache import allocate_kv_cache
    from tandem.model.triton_attention import make_attention
    from tandem.weights.loader import load_model

    model = load_model(model_dir, "float32", "cpu", attention=make_attention("torch", "cpu"))
    cache = allocate_kv_cache(model.config, num_blocks, block_size, torch.float32,
                              torch.device("cpu"))  # fmt: skip
    return DraftProposer(model, cache, block_size, max_len=512, chunk=8, fmt="f")


def test_the_pool_takes_the_least_recent_requests_blocks_and_it_catches_up(tiny_model_dir):
    a, b = [5, 9, 13, 17, 21, 25, 29, 33, 37, 41], [7, 11, 15, 19, 23, 27, 31]
    fresh = make_proposer(tiny_model_dir, 16)
    fresh.start("a", a, "", len(a))
    want = fresh.propose("a", 3)
    pool = make_proposer(tiny_model_dir, 4)  # 16 positions: one request at a time
    pool.start("a", a, "", len(a))
    assert pool.propose("a", 3) == want and pool.prefill_tokens == len(a)
    pool.extend("a", [want[0], 99])  # one draft token accepted, then the target's own
    assert pool._written["a"] == a + want[:2]
    pool.start("b", b, "", len(b))
    assert len(pool.propose("b", 3)) == 3  # took a's blocks
    assert pool._written["a"] == [] and "a" not in pool._tables
    assert pool.propose("a", 3) == fresh_after(tiny_model_dir, a + [want[0], 99])
    assert pool.prefill_tokens == 2 * len(a) + len(b)  # a caught up from its first token
    assert pool.propose("a", 9) == []  # 12 + 8 positions: more than the whole pool
    pool.finish("a")
    pool.finish("b")
    assert len(pool._free) == 4 and pool.num_requests() == 0


def fresh_after(model_dir: Path, tokens: list[int]) -> list[int]:
    p = make_proposer(model_dir, 16)
    p.start("x", tokens, "", 0)
    return p.propose("x", 3)


def test_after_a_verify_only_the_rejected_positions_are_computed_again(tiny_model_dir):
    p = make_proposer(tiny_model_dir, 16)
    tokens = [5, 9, 13, 17, 21, 25]
    p.start("r", tokens, "", len(tokens))
    d = p.propose("r", 3)
    calls: list[tuple[int, int]] = []
    forward = p._forward

    def counting(rid, start, ids, table, sample):
        calls.append((start, len(ids)))
        return forward(rid, start, ids, table, sample)

    p._forward = counting  # type: ignore[method-assign]
    p.extend("r", [d[0], 7])  # d[0] accepted, d[1] rejected for 7
    assert p.propose("r", 2) == fresh_after_k(tiny_model_dir, tokens + [d[0], 7], 2)
    # d[0]'s KV (position 6) was kept; position 7 (d[1]'s slot) recomputed with 7, then 1 more
    assert calls == [(7, 1), (8, 1)]


def fresh_after_k(model_dir: Path, tokens: list[int], k: int) -> list[int]:
    p = make_proposer(model_dir, 16)
    p.start("x", tokens, "", 0)
    return p.propose("x", k)


# -- what may draft for what -------------------------------------------------------------------


def test_a_draft_must_share_the_targets_vocabulary_and_tokenizer(
    tiny_model_dir, other_draft, tmp_path
):
    target = ModelConfig.from_dir(tiny_model_dir)
    check_draft(target, tiny_model_dir, ModelConfig.from_dir(other_draft), other_draft, 1)
    wide = dataclasses.replace(get_preset("tiny"), vocab_size=640)
    bigger = make_tiny_model(tmp_path / "big", preset=wide, seed=0)
    with pytest.raises(ValueError, match="vocabulary of"):
        check_draft(target, tiny_model_dir, ModelConfig.from_dir(bigger), bigger, 1)
    renamed = tmp_path / "renamed"
    renamed.mkdir()
    for f in other_draft.iterdir():
        (renamed / f.name).write_bytes(f.read_bytes())
    tok = json.loads((renamed / "tokenizer.json").read_text())
    vocab = tok["model"]["vocab"]
    a, b = list(vocab)[100:102]
    vocab[a], vocab[b] = vocab[b], vocab[a]  # two ids swapped: other text, same size
    (renamed / "tokenizer.json").write_text(json.dumps(tok))
    with pytest.raises(ValueError, match="tokenizer differs"):
        check_draft(target, tiny_model_dir, ModelConfig.from_dir(renamed), renamed, 1)
    (renamed / "tokenizer.json").unlink()
    with pytest.raises(ValueError, match="no tokenizer.json"):
        check_draft(target, tiny_model_dir, ModelConfig.from_dir(renamed), renamed, 1)
    with pytest.raises(ValueError, match="single-rank"):
        check_draft(target, tiny_model_dir, ModelConfig.from_dir(other_draft), other_draft, 2)


def test_the_fingerprint_tells_checkpoints_apart(tiny_model_dir, other_draft, tmp_path):
    assert fingerprint(tiny_model_dir) != fingerprint(other_draft)
    again = make_tiny_model(tmp_path / "again", preset="tiny", seed=0)
    assert fingerprint(again) == fingerprint(tiny_model_dir)  # the same bytes


def test_the_config_needs_a_draft_model_exactly_with_method_draft() -> None:
    with pytest.raises(ValueError, match="needs a draft model"):
        SpeculativeConfig(method="draft")
    with pytest.raises(ValueError, match="needs --speculative draft"):
        SpeculativeConfig(method="ngram", draft_model="/models/draft")
    assert SpeculativeConfig(method="draft", draft_model="/d").enabled


# -- the draft_kv section ----------------------------------------------------------------------


def test_the_draft_section_follows_the_pages_and_is_checked_like_the_others() -> None:
    draft = HandoffSection(SectionKind.DRAFT_KV, "draft.v1 abc float32 2x2x16", 2, 1500)
    sections = handoff_sections("float32", 5, None, 0, draft=draft)
    assert [(s.kind, s.num_blocks) for s in sections] == [("attention", 3), ("draft_kv", 2)]
    expected = expected_sections("float32", None, ("draft.v1 abc float32 2x2x16", 1500))
    ranges = check_sections(sections, expected, 5, 3, 1024)
    assert ranges == {SectionKind.ATTENTION: range(0, 3), SectionKind.DRAFT_KV: range(3, 5)}
    # the reader's draft differs, its section is missing, cut short, or the reader has none
    other = expected_sections("float32", None, ("draft.v1 def float32 2x2x16", 1500))
    with pytest.raises(SectionRefused, match="draft_kv section is 'draft.v1 abc"):
        check_sections(sections, other, 5, 3, 1024)
    with pytest.raises(SectionRefused, match="draft_kv section is missing"):
        check_sections(handoff_sections("float32", 3, None, 0, True), expected, 3, 3, 1024)
    with pytest.raises(SectionRefused, match="draft_kv section is missing"):
        check_sections((), expected, 3, 3, 1024)
    short = dataclasses.replace(draft, num_blocks=1)
    with pytest.raises(SectionRefused, match="draft_kv section has 1 blocks, need 2"):
        check_sections(handoff_sections("float32", 4, None, 0, draft=short), expected, 4, 3, 1024)
    with pytest.raises(SectionRefused, match="drafts without that draft model"):
        check_sections(sections, expected_sections("float32", None), 5, 3, 1024)
