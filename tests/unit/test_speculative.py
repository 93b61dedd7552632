"""Speculative decoding (issue 45): the proposers' and the speculator's rules, exactly; the
verification rule; and engines whose greedy and seeded output is token-identical with and
without speculation, colocated and disaggregated, through prefix hits, chunked prefill,
preemption, grammars, stop strings, sliding windows and MLA."""

from __future__ import annotations

import math
import random
from collections import Counter
from collections.abc import Sequence

import pytest
import torch

from tandem.config import EngineRole, SpeculativeConfig
from tandem.engine.grammar import Constraint, ConstraintKind
from tandem.engine.request import Request, Resume
from tandem.engine.sampling import SamplingParams
from tandem.engine.verify import accepted_length
from tandem.speculative.proposers import NgramIndex, NgramProposer, SuffixProposer, vote
from tandem.speculative.speculator import (
    Speculator,
    VerifyCost,
    best_draft_length,
    expected_tokens,
    make_speculator,
)
from tandem.speculative.stats import SpecStats
from tests.unit.test_engine import disaggregated

GREEDY = SamplingParams(max_tokens=24, temperature=0.0)
SEEDED = SamplingParams(max_tokens=24, temperature=0.9, top_k=40, top_p=0.95, seed=11)


# -- proposers -------------------------------------------------------------------------------


def test_ngram_index_records_what_followed_each_ngram() -> None:
    index = NgramIndex(1, 2)
    index.extend([1, 2, 3, 1, 2, 4])
    assert index.followers([1, 2]) == [2, 5]
    assert index.followers([2]) == [2, 5]
    assert index.followers([2, 4]) == []  # ends the sequence: nothing followed it yet
    assert index.longest_match([9, 1, 2]) == (2, [2, 5])
    assert index.longest_match([9, 4]) == (0, [])


def test_ngram_proposes_what_followed_the_most_recent_longest_match() -> None:
    p = NgramProposer(1, 3)
    p.start("r", [7, 8, 9, 1, 7, 8, 5, 6, 0, 7, 8])
    # "7 8" ended at 1 (then 9) and at 5 (then 5): the most recent wins
    assert p.propose("r", 3) == [5, 6, 0]
    p.extend("r", [9])  # "7 8 9" now matches the first occurrence, 3 long
    assert p.propose("r", 2) == [1, 7]
    p.extend("r", [4])
    assert p.propose("r", 4) == []  # "9 4", "4": never seen before
    p.finish("r")
    with pytest.raises(KeyError):
        p.propose("r", 1)


def test_ngram_draft_stops_at_the_end_of_what_is_known() -> None:
    p = NgramProposer(2, 2)
    p.start("r", [1, 2, 3, 1, 2])
    assert p.propose("r", 8) == [3, 1, 2]


def test_suffix_votes_and_stops_when_the_vote_is_not_confident() -> None:
    index = NgramIndex(1, 4)
    index.extend([1, 2, 3, 1, 2, 3, 1, 2, 4, 9, 1])
    # "1" was followed by 2 three times; "1 2" by 3, 3, 4; "1 2 3" by 1, 1; then "2", 2;
    # then "1 2 3 1 2" by 3 and 4 once each: a tie goes to the most recent
    assert vote(index, [1], 4) == [2, 3, 1, 2]
    assert vote(index, [1], 6) == [2, 3, 1, 2, 4, 9]
    low = NgramIndex(1, 1)
    low.extend([0, 1, 0, 2, 0, 3, 0, 4, 0])  # "0" is followed by 4 tokens, once each
    assert vote(low, [0], 3) == []  # 1 vote of 4 is below the confidence share


def test_suffix_shares_only_within_a_named_tenant() -> None:
    text = [11, 12, 13, 14, 15]
    p = SuffixProposer(1, 3, share=True)
    p.start("a", text, "tenant-a")
    p.finish("a")  # its tokens join tenant-a's pool
    for rid, tenant in (("b", "tenant-a"), ("c", "tenant-b"), ("d", "")):
        p.start(rid, [9, 11, 12], tenant)
    assert p.propose("b", 3) == [13, 14, 15]
    assert p.propose("c", 3) == [] and p.propose("d", 3) == []
    p.start("e", text, "")
    p.finish("e")  # the empty salt is everyone's: never pooled
    assert p.propose("d", 3) == []
    unshared = SuffixProposer(1, 3)
    unshared.start("a", text, "tenant-a")
    unshared.finish("a")
    unshared.start("b", [11, 12], "tenant-a")
    assert unshared.propose("b", 3) == []


# -- the speculator's rules -------------------------------------------------------------------


def spec_request(rid: str, prompt: list[int], max_tokens: int = 100, **kw) -> Request:
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0), **kw)


def test_the_draft_length_maximises_tokens_per_step_time() -> None:
    cost = VerifyCost(fixed=0.4, per_token=0.15)
    assert expected_tokens(0.5, 3) == 1.875 and expected_tokens(0.0, 4) == 1.0
    # 0.7: 1 + .7 + .49 + .343 + .2401 = 2.7731 tokens for 2.0 steps at k = 4, the best
    assert [best_draft_length(r, 4, cost) for r in (0.3, 0.45, 0.5, 0.6, 0.7)] == [0, 0, 2, 3, 4]
    assert best_draft_length(0.95, 2, cost) == 2  # bounded by k_max
    cheap = VerifyCost(fixed=0.05, per_token=0.02)
    assert best_draft_length(0.3, 8, cheap) == 3


def test_draft_length_follows_acceptance_and_respects_the_limits() -> None:
    s = Speculator(SpeculativeConfig(method="ngram", num_speculative_tokens=3, ngram_min=1),
                   max_model_len=64, cost=VerifyCost(fixed=0.4, per_token=0.15))  # fmt: skip
    r = spec_request("r", [1, 2, 3, 4, 5, 6, 7, 1])
    assert s.rate("r") == 0.8 and s.draft(r, budget=100) == (2, 3, 4)  # the prior: try
    assert s.draft(r, budget=3) == (2, 3)  # the step's budget, the row's own token first
    s.verified("r", 3, 0, 1)  # tried 1 (the first was rejected), accepted 0
    assert s.rate("r") == pytest.approx(1.6 / 3)
    assert s.draft(r, budget=100) == (2, 3)  # k = 2 at 0.53
    s.verified("r", 2, 0, 1)  # counts (0, 0.8 + 1): rate 1.6 / 3.8 = 0.42, no k pays
    # each plain step takes the counts back toward the prior by 0.95: past 0.4747 (where
    # k = 2 pays, 1 + r + r^2 > 1.7) after 6 of them, 1.6 / (1.8 * 0.95^6 + 2) = 0.4815
    plain = 0
    while not (draft := s.draft(r, budget=100)):
        plain += 1
    assert plain == 6 and draft == (2, 3)
    s.verified("r", 2, 2, 3)
    assert s.rate("r") > 0.7 and s.draft(r, budget=100) == (2, 3, 4)
    # never past max_tokens (the target's own token comes after the draft) or the context
    assert s.draft(spec_request("m", [1, 2, 1], max_tokens=2), 100) == (2,)
    assert s.draft(spec_request("n", [1, 2, 1], max_tokens=1), 100) == ()
    assert s.draft(spec_request("c", [9] * 62), 100) == (9,)  # 62 tokens of 64: then 2 more
    assert s.draft(spec_request("d", [9] * 63), 100) == ()
    assert s.draft(spec_request("h", [1, 2, 1], hand_off=True), 100) == ()
    stats = s.stats()
    assert (stats.proposed_tokens, stats.accepted_tokens, stats.verify_rows) == (7, 2, 3)
    assert stats.emitted_tokens == 5 and stats.acceptance_length == 5 / 3
    for rid in ("r", "m", "n", "c", "d", "h"):
        s.finish(rid)
    assert all(n == 0 for n, _ in s.footprint().values())


def test_speculation_pauses_above_max_batch_and_counts_it() -> None:
    s = Speculator(SpeculativeConfig(method="suffix", max_batch=4), max_model_len=64)
    assert s.active(4) and not s.active(5) and not s.active(9)
    assert s.stats().paused_steps == 2


def test_a_grammar_cuts_the_draft_at_the_first_token_it_refuses(tiny_model_dir) -> None:
    from tandem.engine.grammar import GrammarCompiler
    from tandem.tokenizer.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(tiny_model_dir)
    grammars = GrammarCompiler((tiny_model_dir / "tokenizer.json").read_text(), 512, (1,))
    allowed = tok.encode("hello world")[1:]
    choice = Constraint(ConstraintKind.CHOICE, ("hello world",))
    s = Speculator(SpeculativeConfig(method="ngram", ngram_min=1, ngram_max=2), 512)
    for rid, text, want in (
        ("whole", allowed + [2] + allowed[:2], tuple(allowed[2:6])),
        ("cut", allowed[:3] + [7, 7] + allowed[:2], tuple(allowed[2:3])),  # drafted 3, 7, 7, 0
    ):
        r = spec_request(rid, text)
        r.matcher = grammars.matcher(choice)
        r.matcher.replay(allowed[:2])  # as if the output so far were those two
        assert s.draft(r, 100) == want, rid
        assert r.matcher.num_accepted == 2  # asking never moves it


def test_speculation_refuses_a_tensor_parallel_linear_attention_model() -> None:
    with pytest.raises(ValueError, match="linear-attention model's state is rolled back"):
        make_speculator(SpeculativeConfig(method="ngram"), 64, True, tensor_parallel_size=2)
    assert make_speculator(SpeculativeConfig(method="ngram"), 64, True) is not None
    assert make_speculator(SpeculativeConfig(), 64, True, tensor_parallel_size=2) is None


def test_accepted_length_is_the_longest_agreeing_prefix() -> None:
    assert accepted_length([5, 6, 7], [5, 6, 9, 1]) == 2
    assert accepted_length([5, 6, 7], [4, 6, 7, 1]) == 0
    assert accepted_length([5, 6], [5, 6, 3]) == 2
    assert accepted_length([], [3]) == 0


# -- engines ----------------------------------------------------------------------------------


class Oracle:
    """A test proposer that knows each request's reference continuation and drafts it,
    with every token replaced at random at rate `wrong` (so drafts are accepted fully, in
    part, or not at all, deterministically)."""

    name = "oracle"

    def __init__(self, refs: dict[tuple[int, ...], list[int]], wrong: float, seed: int = 0):
        self.refs, self.wrong, self.seed = refs, wrong, seed
        self._tokens: dict[str, list[int]] = {}

    def start(
        self, request_id: str, token_ids: Sequence[int], tenant: str = "", num_prompt: int = 0
    ) -> None:
        self._tokens[request_id] = list(token_ids)

    def extend(self, request_id: str, token_ids: Sequence[int]) -> None:
        self._tokens[request_id] += token_ids

    def propose(self, request_id: str, k: int) -> list[int]:
        tokens = self._tokens[request_id]
        for prompt, ref in self.refs.items():
            full = list(prompt) + ref
            if tokens == full[: len(tokens)]:
                rng = random.Random(f"{self.seed}-{len(tokens)}-{prompt[:3]}")
                draft = full[len(tokens) : len(tokens) + k]
                return [rng.randrange(3, 200) if rng.random() < self.wrong else t for t in draft]
        return []

    def finish(self, request_id: str) -> None:
        self._tokens.pop(request_id, None)


def make_spec_engine(factory, model_dir, method: str, oracle=None, max_batch: int = 8, **kw):
    method_name = "ngram" if method == "oracle" else method
    spec = SpeculativeConfig(method=method_name, num_speculative_tokens=4, ngram_min=1,
                             max_batch=max_batch)  # fmt: skip
    engine = factory(model_dir, speculative=spec, **kw)
    if oracle is not None:
        engine.speculator.proposer = oracle
    return engine


def prompts_with_repeats(seed: int, n: int) -> list[list[int]]:
    rng = random.Random(seed)
    shared = rng.choices(range(5, 500), k=10)
    out = []
    for i in range(n):
        body = rng.choices(range(5, 500), k=rng.randint(3, 12))
        out.append((shared if i % 2 else []) + body + body[:4] + body)  # repeats to look up
    return out


def run(engine, prompts, params):
    done = engine.generate(prompts, params)
    engine.check_integrity()
    engine.cached_prompt_tokens = sum(c.num_cached_tokens for c in done)
    return [c.token_ids for c in done], [c.logprobs for c in done]


@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_every_proposer_leaves_the_output_unchanged(tiny_model_dir, engine_factory, params):
    prompts = prompts_with_repeats(1, 6)
    ref, _ = run(engine_factory(tiny_model_dir), prompts, params)
    refs = {tuple(p): r for p, r in zip(prompts, ref, strict=True)}
    for method, wrong in (("ngram", 0), ("suffix", 0), ("oracle", 0.0), ("oracle", 0.3)):
        oracle = Oracle(refs, wrong) if method == "oracle" else None
        engine = make_spec_engine(engine_factory, tiny_model_dir, method, oracle)
        got, _ = run(engine, prompts, params)
        assert got == ref, (method, wrong)
        stats = engine.spec_stats()[0]
        if method == "oracle":
            assert stats.accepted_tokens > 0 and stats.emitted_tokens > stats.verify_rows
            if wrong == 0.0:  # every draft right: only the limits cut it
                assert stats.accepted_tokens == stats.proposed_tokens
            else:
                assert stats.accepted_tokens < stats.proposed_tokens
        assert engine.num_free_blocks() == engine.num_blocks


@pytest.mark.parametrize("method", ["ngram", "suffix", "oracle"])
def test_prefix_hits_chunked_prefill_preemption_penalties_and_logprobs(
    tiny_model_dir, engine_factory, method
):
    params = SamplingParams(max_tokens=20, temperature=0.7, seed=5, repetition_penalty=1.3,
                            frequency_penalty=0.5, logprobs=3)  # fmt: skip
    prompts = prompts_with_repeats(2, 8) * 2  # the second half hits the first's prefixes
    tight = dict(num_blocks=40, long_prefill_token_threshold=5, max_num_seqs=8)
    ref_engine = engine_factory(tiny_model_dir, **tight)
    ref, ref_lps = run(ref_engine, prompts, params)
    refs = {tuple(p): r for p, r in zip(prompts, ref, strict=True)}
    oracle = Oracle(refs, 0.25) if method == "oracle" else None
    engine = make_spec_engine(engine_factory, tiny_model_dir, method, oracle, **tight)
    got, lps = run(engine, prompts, params)
    assert got == ref
    assert engine.scheduler.num_preemptions > 0 and ref_engine.scheduler.num_preemptions > 0
    assert engine.spec_stats()[0].verify_rows > 0
    assert engine.cached_prompt_tokens > 0  # the second half hit the first's blocks
    for a, b in zip(lps, ref_lps, strict=True):
        assert len(a) == len(b)
        for (lp, top), (ref_lp, ref_top) in zip(a, b, strict=True):
            assert lp == pytest.approx(ref_lp, abs=1e-4)
            assert [t for t, _ in top] == [t for t, _ in ref_top]


@pytest.mark.parametrize("method", ["ngram", "suffix", "oracle"])
def test_a_json_schema_grammar_stays_exact(tiny_model_dir, engine_factory, method):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}},
              "required": ["a", "b"]}  # fmt: skip
    for temperature in (0.0, 0.9):
        params = SamplingParams(max_tokens=30, temperature=temperature, seed=3,
                                constraint=Constraint.json_schema(schema))  # fmt: skip
        prompts = prompts_with_repeats(3, 3)
        ref, _ = run(engine_factory(tiny_model_dir), prompts, params)
        refs = {tuple(p): r for p, r in zip(prompts, ref, strict=True)}
        for wrong in (0.0, 0.4) if method == "oracle" else (None,):
            oracle = Oracle(refs, wrong) if wrong is not None else None
            engine = make_spec_engine(engine_factory, tiny_model_dir, method, oracle)
            got, _ = run(engine, prompts, params)
            assert got == ref, (temperature, wrong)
            if oracle is not None:
                assert engine.spec_stats()[0].accepted_tokens > 0


def test_stop_strings_and_max_tokens_cut_an_accepted_draft(tiny_model_dir, engine_factory):
    engine = engine_factory(tiny_model_dir)
    prompt = prompts_with_repeats(4, 1)[0]
    [full] = engine.generate([prompt], SamplingParams(max_tokens=30, temperature=0.0))
    stop = full.text[len(full.text) // 2 : len(full.text) // 2 + 3]
    assert stop.strip()
    refs = {tuple(prompt): full.token_ids}
    for params in (
        SamplingParams(max_tokens=30, temperature=0.0, stop=(stop,)),
        SamplingParams(max_tokens=7, temperature=0.0),
    ):
        [ref] = engine_factory(tiny_model_dir).generate([prompt], params)
        spec = make_spec_engine(engine_factory, tiny_model_dir, "oracle", Oracle(refs, 0.0))
        [got] = spec.generate([prompt], params)
        assert (got.token_ids, got.text, got.finish_reason) == (
            ref.token_ids, ref.text, ref.finish_reason,
        )  # fmt: skip
        spec.check_integrity()
        assert spec.num_free_blocks() == spec.num_blocks


@pytest.mark.parametrize("method", ["ngram", "suffix", "oracle"])
def test_disaggregated_acceptance_equals_colocated(tiny_model_dir, engine_factory, method):
    prompts = prompts_with_repeats(5, 4)
    ref, _ = run(engine_factory(tiny_model_dir), prompts, GREEDY)
    refs = {tuple(p): r for p, r in zip(prompts, ref, strict=True)}
    oracle = (lambda: Oracle(refs, 0.3)) if method == "oracle" else (lambda: None)
    full = make_spec_engine(engine_factory, tiny_model_dir, method, oracle())
    colocated, _ = run(full, prompts, GREEDY)
    prefill = engine_factory(tiny_model_dir, role=EngineRole.PREFILL)
    decode = make_spec_engine(engine_factory, tiny_model_dir, method, oracle(),
                              role=EngineRole.DECODE)  # fmt: skip
    split = [disaggregated(prefill, decode, f"r{i}", p, GREEDY) for i, p in enumerate(prompts)]
    assert colocated == ref and split == ref
    assert decode.spec_stats() == full.spec_stats()
    assert full.spec_stats()[0].verify_rows > 0


@pytest.mark.parametrize("arch", ["gpt-oss", "gemma3", "deepseek-v3", "qwen3-next"])
def test_sliding_windows_latents_and_linear_states_stay_exact(hf_model, engine_factory, arch):
    """Rejected positions never move a sliding table's trim (it follows accepted tokens
    only), MLA's verify rows take its prefill path over the cached latents, and a Gated
    DeltaNet state is put back before a row with a rejected token, which is recomputed."""
    model_dir, _ = hf_model(arch)
    prompts = prompts_with_repeats(6, 3)
    prompts = [[t % 200 + 3 for t in p] for p in prompts]
    ref, _ = run(engine_factory(model_dir), prompts, GREEDY)
    refs = {tuple(p): r for p, r in zip(prompts, ref, strict=True)}
    engine = make_spec_engine(engine_factory, model_dir, "oracle", Oracle(refs, 0.3))
    for params in (GREEDY, SEEDED):
        want = ref if params is GREEDY else run(engine_factory(model_dir), prompts, params)[0]
        got, _ = run(engine, prompts, params)
        assert got == want
    stats = engine.spec_stats()[0]
    assert 0 < stats.accepted_tokens < stats.proposed_tokens
    assert engine.num_free_blocks() == engine.num_blocks
    runner = engine.runner
    assert not runner._state_slots and not runner._state_pos  # the copies freed too
    if arch == "qwen3-next":
        assert runner.rollback is not None and runner.rollback.num_restored > 0


# -- the distribution of sampled output -------------------------------------------------------


class FixedDraft:
    """Drafts `draft` when a request's tokens are exactly `after`, nothing otherwise."""

    name = "fixed"

    def __init__(self, after: list[int], draft: list[int]) -> None:
        self.after, self.draft = after, draft
        self._tokens: dict[str, list[int]] = {}

    def start(
        self, request_id: str, token_ids: Sequence[int], tenant: str = "", num_prompt: int = 0
    ) -> None:
        self._tokens[request_id] = list(token_ids)

    def extend(self, request_id: str, token_ids: Sequence[int]) -> None:
        self._tokens[request_id] += token_ids

    def propose(self, request_id: str, k: int) -> list[int]:
        return self.draft[:k] if self._tokens[request_id] == self.after else []

    def finish(self, request_id: str) -> None:
        self._tokens.pop(request_id, None)


def top_probs(engine, prompt: list[int], k: int) -> dict[int, float]:
    """The target's next-token distribution after `prompt` under top_k=k, temperature 1:
    its k most likely tokens, renormalised (from the raw logprobs)."""
    [c] = engine.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0, logprobs=k))
    top = dict(c.logprobs[0][1])
    total = sum(math.exp(v) for v in top.values())
    return {t: math.exp(v) / total for t, v in top.items()}


def chi_square_p(observed: dict, expected: dict) -> float:
    """Pearson's chi-square test's p-value, categories expecting fewer than 5 pooled."""
    small = [c for c in expected if expected[c] < 5]
    obs = [observed.get(c, 0) for c in expected if c not in small]
    exp = [expected[c] for c in expected if c not in small]
    if small:
        obs.append(sum(observed.get(c, 0) for c in small))
        exp.append(sum(expected[c] for c in small))
    stat = sum((o - e) ** 2 / e for o, e in zip(obs, exp, strict=True))
    dof = len(exp) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2), torch.tensor(stat / 2)))


def sample_pairs(engine, prompt: list[int], a: int, n: int) -> tuple[Counter, int]:
    """(x1, x2) counts over n seeded requests whose first token was `a`, and that count."""
    params = [SamplingParams(max_tokens=3, temperature=1.0, top_k=3, seed=s) for s in range(n)]
    requests = [engine.add_request(engine.spec(f"s{i}", prompt, p)) for i, p in enumerate(params)]
    while engine.has_unfinished():
        engine.step()
    outs = [r.output_token_ids for r in requests]
    kept = [o for o in outs if o[0] == a]
    return Counter((o[1], o[2]) for o in kept), len(kept)


def test_sampled_output_follows_the_target_distribution(
    tiny_model_dir, engine_factory, monkeypatch
):
    """Chi-square over seeded samples of the two tokens after the most likely first token,
    the first of them verified against a fixed draft, against the target's exact
    probabilities; a wrong acceptance rule (accept every drafted position) fails it."""
    prompt = [7, 33, 91, 140, 12]
    plain = engine_factory(tiny_model_dir)
    first = top_probs(plain, prompt, 3)
    a = max(first, key=first.__getitem__)
    second = top_probs(plain, prompt + [a], 3)
    d1 = sorted(second, key=second.__getitem__)[-2]  # a draft accepted about a third of the time
    pairs = {(x1, x2): p1 * p2 for x1, p1 in second.items()
             for x2, p2 in top_probs(plain, prompt + [a, x1], 3).items()}  # fmt: skip

    def observed(engine) -> tuple[Counter, dict]:
        engine.speculator.proposer = FixedDraft(prompt + [a], [d1])
        counts, kept = sample_pairs(engine, prompt, a, 1500)
        stats = engine.spec_stats()[0]
        assert stats.verify_rows == kept  # every kept sample verified the draft
        return counts, {c: p * kept for c, p in pairs.items()}

    def engine():
        return make_spec_engine(engine_factory, tiny_model_dir, "ngram", max_batch=128,
                                max_num_seqs=128)  # fmt: skip

    counts, expected = observed(engine())
    assert sum(counts.values()) > 300
    assert chi_square_p(counts, expected) > 1e-3
    monkeypatch.setattr("tandem.engine.verify.accepted_length", lambda draft, sampled: len(draft))
    wrong, expected = observed(engine())
    assert chi_square_p(wrong, expected) < 1e-6


def test_tensor_parallel_ranks_verify_the_same_drafts(hf_model, engine_factory):
    """Every rank runs a verify row's 1 + k positions (StepRow.num_draft): two ranks answer
    as one, drafts accepted."""
    model_dir, _ = hf_model("llama")
    prompts = [[t % 200 + 3 for t in p] for p in prompts_with_repeats(8, 3)]
    ref, _ = run(engine_factory(model_dir), prompts, GREEDY)
    refs = {tuple(p): r for p, r in zip(prompts, ref, strict=True)}
    two = make_spec_engine(engine_factory, model_dir, "oracle", Oracle(refs, 0.3),
                           tensor_parallel_size=2)  # fmt: skip
    try:
        got, _ = run(two, prompts, GREEDY)
        assert got == ref
        assert two.spec_stats()[0].accepted_tokens > 0
    finally:
        two.close()


def test_warm_up_leaves_no_drafts_counted(tiny_model_dir, engine_factory):
    """The warm-up's request (a long run of ids that repeats over the tiny vocabulary)
    drafts, but its counts are not traffic's, and nothing of it stays."""
    engine = make_spec_engine(engine_factory, tiny_model_dir, "suffix")
    proposer, drafted = engine.speculator.proposer, []
    propose = proposer.propose
    proposer.propose = lambda rid, k: drafted.append(propose(rid, k)) or drafted[-1]
    engine.warm_up()
    assert any(drafted)
    assert engine.spec_stats()[0] == SpecStats("suffix")
    assert all(n == 0 for n, _ in engine.speculator.footprint().values())


def record_starts(proposer) -> list[list[int]]:
    """The token lists `proposer.start` is given from now on."""
    starts: list[list[int]] = []
    start = proposer.start

    def recording(rid, ids, tenant="", num_prompt=0):
        starts.append(list(ids))
        start(rid, ids, tenant, num_prompt)

    proposer.start = recording
    return starts


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_a_migrated_stream_resumes_drafting_from_its_tokens(tiny_model_dir, engine_factory, method):
    """A stream moved to another speculating worker (Resume: every token so far) continues
    token-identically, seeded too: the proposer indexes the prompt and the resumed tokens
    when it first sees the request; nothing of the first worker's proposer moves."""
    prompt = prompts_with_repeats(9, 1)[0]
    for params in (GREEDY, SEEDED):
        [whole] = engine_factory(tiny_model_dir).generate([prompt], params)
        first = make_spec_engine(engine_factory, tiny_model_dir, method)
        request = first.add_request(first.spec("m", prompt, params))
        while len(request.output_token_ids) < 9:
            first.step()
        moved = list(request.output_token_ids)
        assert first.abort("m")
        second = make_spec_engine(engine_factory, tiny_model_dir, method)
        indexed = record_starts(second.speculator.proposer)
        resumed = second.add_request(second.spec("m", prompt, params), Resume(tuple(moved)))
        while second.has_unfinished():
            second.step()
        assert resumed.output_token_ids == whole.token_ids
        # its first decode step indexed the prompt, every token moved and the one token its
        # recomputing prefill sampled
        assert indexed == [prompt + moved + whole.token_ids[len(moved) : len(moved) + 1]]


def test_suffix_drafts_from_the_same_tenants_earlier_answer(tiny_model_dir, engine_factory):
    """With suffix_share a request of tenant A drafts from A's finished request (its answer
    repeated: acceptance), never from tenant B's; outputs unchanged either way."""
    spec = SpeculativeConfig(method="suffix", suffix_share=True, ngram_min=2)
    prompt = prompts_with_repeats(10, 1)[0]
    plain = engine_factory(tiny_model_dir)
    [want] = plain.generate([prompt], GREEDY)
    counts = {}
    for tenant in ("tenant-a", "tenant-b"):
        engine = engine_factory(tiny_model_dir, speculative=spec)
        engine.add_request(engine.spec("first", prompt, GREEDY, "tenant-a"))
        while engine.has_unfinished():
            engine.step()
        before = engine.spec_stats()[0].accepted_tokens
        again = engine.add_request(engine.spec("again", prompt, GREEDY, tenant))
        while engine.has_unfinished():
            engine.step()
        assert again.output_token_ids == want.token_ids
        counts[tenant] = engine.spec_stats()[0].accepted_tokens - before
    assert counts["tenant-a"] > counts["tenant-b"]
