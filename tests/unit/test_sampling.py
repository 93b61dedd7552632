"""Tests for SamplingParams validation and the batched Sampler."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, cast

import pytest
import torch
from transformers.generation.logits_process import (
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from tandem.engine.request import Resume
from tandem.engine.sampling import (
    GREEDY_TEMPERATURE,
    Sampler,
    SampleResult,
    SampleRow,
    SamplingParams,
    advance_generator,
    apply_penalties,
    exponential_from_uniform,
    greedy_tokens,
    warp_logits,
)

VOCAB = 64


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _row(
    params: SamplingParams,
    prompt: Sequence[int] = (),
    output: Sequence[int] = (),
    generator: torch.Generator | None = None,
) -> SampleRow:
    return SampleRow(params, list(prompt), list(output), generator)


def _random_logits(
    rows: int, vocab: int = VOCAB, seed: int = 0, scale: float = 3.0
) -> torch.Tensor:
    # logits: [rows, vocab]
    return torch.randn(rows, vocab, generator=_gen(seed)) * scale


def _tokens(results: list[SampleResult]) -> list[int]:
    return [r.token_id for r in results]


# --------------------------------------------------------------------------- validation

BAD_VALUES: list[tuple[str, object]] = [
    ("max_tokens", 0),
    ("max_tokens", -3),
    ("max_tokens", True),
    ("max_tokens", 2.0),
    ("max_tokens", "8"),
    ("temperature", -0.1),
    ("temperature", math.nan),
    ("temperature", math.inf),
    ("temperature", True),
    ("temperature", "1.0"),
    ("top_k", 0),
    ("top_k", -1),
    ("top_k", True),
    ("top_k", 5.0),
    ("top_p", 0.0),
    ("top_p", -0.5),
    ("top_p", 1.01),
    ("top_p", math.nan),
    ("top_p", None),
    ("min_p", -0.01),
    ("min_p", 1.5),
    ("min_p", math.nan),
    ("repetition_penalty", 0.0),
    ("repetition_penalty", -1.0),
    ("repetition_penalty", math.inf),
    ("repetition_penalty", math.nan),
    ("presence_penalty", 2.01),
    ("presence_penalty", -2.5),
    ("presence_penalty", math.nan),
    ("presence_penalty", False),
    ("frequency_penalty", 3),
    ("frequency_penalty", -2.01),
    ("frequency_penalty", -math.inf),
    ("seed", -1),
    ("seed", 2**63),
    ("seed", True),
    ("seed", 1.0),
    ("stop_token_ids", (-1,)),
    ("stop_token_ids", (True,)),
    ("stop_token_ids", (1.5,)),
    ("stop_token_ids", 7),
    ("stop_token_ids", "12"),
    ("stop", ("",)),
    ("stop", (3,)),
    ("stop", "END"),
    ("stop", None),
    ("ignore_eos", 1),
    ("ignore_eos", "yes"),
    ("ignore_eos", None),
    ("logprobs", -1),
    ("logprobs", 21),
    ("logprobs", True),
    ("logprobs", 1.0),
]


@pytest.mark.parametrize(("field", "value"), BAD_VALUES)
def test_bad_values_rejected_with_field_name(field: str, value: object) -> None:
    with pytest.raises(ValueError) as info:
        SamplingParams(**{field: value})  # type: ignore[arg-type]
    assert str(info.value).startswith(field), str(info.value)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("max_tokens", 1),
        ("temperature", 0.0),
        ("temperature", 100.0),
        ("top_k", 1),
        ("top_p", 1.0),
        ("top_p", 1e-6),
        ("min_p", 0.0),
        ("min_p", 1.0),
        ("repetition_penalty", 1e-3),
        ("presence_penalty", -2.0),
        ("presence_penalty", 2.0),
        ("frequency_penalty", -2.0),
        ("frequency_penalty", 2.0),
        ("seed", 0),
        ("seed", 2**63 - 1),
        ("stop_token_ids", (0, 5)),
        ("stop", ("\n\n", "END")),
        ("ignore_eos", True),
        ("logprobs", 0),
        ("logprobs", 20),
    ],
)
def test_boundary_values_accepted(field: str, value: object) -> None:
    params = SamplingParams(**{field: value})  # type: ignore[arg-type]
    assert getattr(params, field) == value


def test_lists_become_tuples_and_ints_become_floats() -> None:
    params = SamplingParams(
        stop_token_ids=[2, 3],  # type: ignore[arg-type]
        stop=["a"],  # type: ignore[arg-type]
        temperature=1,
        top_p=1,
        presence_penalty=1,
    )
    assert params.stop_token_ids == (2, 3)
    assert params.stop == ("a",)
    assert isinstance(params.temperature, float)
    assert isinstance(params.top_p, float)
    assert isinstance(params.presence_penalty, float)
    hash(params)  # frozen and hashable once lists are converted


def test_greedy_property() -> None:
    assert SamplingParams(temperature=0.0).greedy
    assert SamplingParams(temperature=GREEDY_TEMPERATURE / 2).greedy
    assert not SamplingParams(temperature=0.5).greedy
    assert not SamplingParams().greedy


def test_validate_for_vocab() -> None:
    SamplingParams(stop_token_ids=(0, 9)).validate_for_vocab(10)
    SamplingParams().validate_for_vocab(1)
    with pytest.raises(ValueError, match=r"^stop_token_ids"):
        SamplingParams(stop_token_ids=(0, 10)).validate_for_vocab(10)
    with pytest.raises(ValueError, match=r"^vocab_size"):
        SamplingParams().validate_for_vocab(0)


# --------------------------------------------------------------------------- greedy / temperature


def test_greedy_is_argmax() -> None:
    logits = _random_logits(8)
    results = Sampler()(logits, [_row(SamplingParams(temperature=0.0))] * 8)
    assert _tokens(results) == logits.argmax(dim=-1).tolist()
    assert all(r.logprob is None and r.top_logprobs is None for r in results)


def test_greedy_rows_in_mixed_batch_are_argmax() -> None:
    logits = _random_logits(6, seed=3)
    rows = [
        _row(SamplingParams(temperature=0.0 if i % 2 == 0 else 1.0), generator=_gen(i))
        for i in range(6)
    ]
    tokens = _tokens(Sampler()(logits, rows))
    expected = logits.argmax(dim=-1).tolist()
    assert [tokens[i] for i in (0, 2, 4)] == [expected[i] for i in (0, 2, 4)]


def test_greedy_bf16_logits() -> None:
    logits = _random_logits(4).to(torch.bfloat16)
    tokens = _tokens(Sampler()(logits, [_row(SamplingParams(temperature=0.0))] * 4))
    assert tokens == logits.float().argmax(dim=-1).tolist()


def test_greedy_ties_take_the_first_token_as_argmax_does() -> None:
    """bfloat16 logits tie often (8 mantissa bits): the first maximal token, every time,
    and a NaN row picks its NaN, exactly as argmax."""
    logits = torch.zeros(4, 49152, dtype=torch.bfloat16)
    logits[0, [40000, 100, 5]] = 3.0
    logits[1, [49151, 0]] = 2.0
    logits[2, 9], logits[2, 7] = 5.0, float("nan")
    logits[3, [2000, 1000]] = float("inf")
    assert greedy_tokens(logits).tolist() == [5, 0, 7, 1000] == logits.argmax(-1).tolist()
    gen = torch.Generator().manual_seed(0)
    many = torch.randint(0, 4, (64, 1000), generator=gen).float()  # ties in every row
    assert torch.equal(greedy_tokens(many), many.argmax(-1))
    rows = [_row(SamplingParams(temperature=0.0))] * 4
    assert _tokens(Sampler()(logits, rows)) == [5, 0, 7, 1000]


def test_sampling_bf16_logits_returns_valid_tokens() -> None:
    logits = _random_logits(4).to(torch.bfloat16)
    rows = [_row(SamplingParams(top_k=3, logprobs=2), generator=_gen(i)) for i in range(4)]
    results = Sampler()(logits, rows)
    top3 = logits.float().topk(3, dim=-1).indices.tolist()
    assert all(r.token_id in top3[i] for i, r in enumerate(results))


def test_high_temperature_spreads_samples() -> None:
    logits = torch.zeros(4000, 4)  # logits: [draws, vocab]; uniform
    rows = [_row(SamplingParams(temperature=1.0))] * 4000
    counts = Counter(_tokens(Sampler(_gen(0))(logits, rows)))
    assert set(counts) == {0, 1, 2, 3}
    assert min(counts.values()) > 800  # each ~1000

    peaked = torch.tensor([[2.0, 0.0, 0.0, 0.0]]).expand(4000, 4)
    hot = Counter(
        _tokens(Sampler(_gen(1))(peaked, [_row(SamplingParams(temperature=10.0))] * 4000))
    )
    assert set(hot) == {0, 1, 2, 3}
    assert hot[0] < 0.4 * 4000  # ~0.31 at T=10 versus ~0.71 at T=1


def test_low_temperature_concentrates_on_peak() -> None:
    peaked = torch.tensor([[2.0, 0.0, 0.0, 0.0]]).expand(4000, 4)
    rows = [_row(SamplingParams(temperature=0.1))] * 4000
    counts = Counter(_tokens(Sampler(_gen(2))(peaked, rows)))
    assert counts[0] > 0.99 * 4000


def test_tiny_temperature_does_not_overflow() -> None:
    logits = torch.tensor([[1e4, -1e4, 0.0, 9999.0]])
    params = SamplingParams(temperature=2 * GREEDY_TEMPERATURE)
    assert _tokens(Sampler()(logits, [_row(params, generator=_gen(0))])) == [0]


# --------------------------------------------------------------------------- top-k / top-p / min-p


def test_top_k_1_is_greedy() -> None:
    logits = _random_logits(16, seed=4)
    rows = [_row(SamplingParams(top_k=1, temperature=2.0), generator=_gen(i)) for i in range(16)]
    assert _tokens(Sampler()(logits, rows)) == logits.argmax(dim=-1).tolist()


def test_top_k_only_yields_k_best() -> None:
    base = torch.randn(1, 50, generator=_gen(5))
    logits = base.expand(3000, 50)
    rows = [_row(SamplingParams(top_k=5))] * 3000
    seen = set(_tokens(Sampler(_gen(6))(logits, rows)))
    assert seen == set(base[0].topk(5).indices.tolist())


def _hf_mask(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """-inf mask from HF's warpers run row by row in Temperature, TopK, TopP, MinP order."""
    masks = []
    for i, p in enumerate(params):
        scores = logits[i : i + 1].clone()
        ids = cast(torch.LongTensor, torch.zeros(1, 1, dtype=torch.long))
        scores = TemperatureLogitsWarper(p.temperature)(ids, scores)
        if p.top_k is not None:
            scores = TopKLogitsWarper(p.top_k)(ids, scores)
        if p.top_p < 1.0:
            scores = TopPLogitsWarper(p.top_p)(ids, scores)
        if p.min_p > 0.0:
            scores = MinPLogitsWarper(p.min_p)(ids, scores)
        masks.append(torch.isneginf(scores))
    return torch.cat(masks)


@pytest.mark.parametrize("seed", range(5))
def test_top_p_matches_hf(seed: int) -> None:
    logits = _random_logits(12, vocab=1000, seed=seed)
    params = [SamplingParams(top_p=p) for p in (0.05, 0.1, 0.3, 0.5, 0.7, 0.8, 0.9, 0.95, 0.99)]
    params += [SamplingParams(top_p=0.9, temperature=0.7), SamplingParams(), SamplingParams()]
    mask = torch.isneginf(warp_logits(logits, params))
    assert torch.equal(mask, _hf_mask(logits, params))
    assert not mask[-1].any()  # top_p=1 keeps everything
    assert (~mask).sum(dim=-1).min() >= 1


def test_top_p_always_keeps_one_token() -> None:
    logits = torch.tensor([[10.0, 0.0, 0.0]])
    mask = torch.isneginf(warp_logits(logits, [SamplingParams(top_p=1e-6)]))
    assert mask.tolist() == [[False, True, True]]


@pytest.mark.parametrize("seed", range(3))
def test_top_k_matches_hf(seed: int) -> None:
    logits = _random_logits(6, vocab=500, seed=seed)
    logits[0, :10] = 50.0  # ten-way tie at the top: top_k=3 keeps all of them, like HF
    params = [SamplingParams(top_k=k) for k in (3, 1, 10, 499, 500, 10_000)]
    mask = torch.isneginf(warp_logits(logits, params))
    assert torch.equal(mask, _hf_mask(logits, params))
    assert (~mask).sum(dim=-1).tolist() == [10, 1, 10, 499, 500, 500]


def test_top_k_then_top_p_then_min_p_match_hf() -> None:
    logits = _random_logits(8, vocab=800, seed=11)
    params = [
        SamplingParams(top_k=50, top_p=0.8),
        SamplingParams(top_k=5, top_p=0.5, temperature=1.5),
        SamplingParams(top_p=0.9, min_p=0.05),
        SamplingParams(top_k=20, min_p=0.2, temperature=0.6),
        SamplingParams(min_p=0.1),
        SamplingParams(top_k=200),
        SamplingParams(top_k=30, top_p=0.95, min_p=0.01),
        SamplingParams(),
    ]
    assert torch.equal(torch.isneginf(warp_logits(logits, params)), _hf_mask(logits, params))


def test_min_p_allowed_set() -> None:
    logits = _random_logits(4, vocab=300, seed=12)
    for min_p in (0.01, 0.1, 0.5, 1.0):
        probs = logits.softmax(dim=-1)
        allowed = probs >= min_p * probs.amax(dim=-1, keepdim=True)
        mask = torch.isneginf(warp_logits(logits, [SamplingParams(min_p=min_p)] * 4))
        assert torch.equal(~mask, allowed)

    base = torch.tensor([[3.0, 2.5, 1.0, 0.0, -1.0]])
    allowed_ids = {0, 1}  # p/p_max: 1, 0.61, 0.14, 0.05, 0.02 against min_p=0.3
    rows = [_row(SamplingParams(min_p=0.3))] * 2000
    seen = set(_tokens(Sampler(_gen(13))(base.expand(2000, 5), rows)))
    assert seen == allowed_ids


def test_warp_logits_rejects_greedy() -> None:
    with pytest.raises(ValueError, match=r"^params"):
        warp_logits(torch.zeros(1, 4), [SamplingParams(temperature=0.0)])


# --------------------------------------------------------------------------- penalties


def test_repetition_penalty_matches_hf() -> None:
    logits = _random_logits(3, vocab=40, seed=20)
    rows = [
        _row(SamplingParams(repetition_penalty=1.3), prompt=[1, 2, 3, 3], output=[5, 1]),
        _row(SamplingParams(repetition_penalty=0.7), prompt=[7], output=[]),
        _row(SamplingParams(repetition_penalty=2.0), prompt=[], output=[0, 39, 39, 12]),
    ]
    out = apply_penalties(logits, rows)
    for i, row in enumerate(rows):
        ids = torch.tensor([list(row.prompt_token_ids) + list(row.output_token_ids)])
        processor = RepetitionPenaltyLogitsProcessor(row.params.repetition_penalty)
        expected = processor(ids, logits[i : i + 1].clone())
        torch.testing.assert_close(out[i : i + 1], expected)
    untouched = [t for t in range(40) if t not in {1, 2, 3, 5}]
    assert torch.equal(out[0, untouched], logits[0, untouched])


def test_repetition_penalty_sign_rule() -> None:
    logits = torch.tensor([[2.0, -2.0, 0.0, 4.0]])
    row = _row(SamplingParams(repetition_penalty=2.0), prompt=[0, 1], output=[2])
    assert apply_penalties(logits, [row]).tolist() == [[1.0, -4.0, 0.0, 4.0]]


def test_presence_and_frequency_penalty_formulas() -> None:
    logits = torch.tensor([[1.0, 1.0, 1.0, 1.0, 1.0]])
    # Prompt tokens do not count for OpenAI-style penalties.
    row = _row(
        SamplingParams(frequency_penalty=0.5, presence_penalty=0.25),
        prompt=[4, 4, 4],
        output=[1, 1, 1, 2],
    )
    out = apply_penalties(logits, [row])
    expected = [1.0, 1.0 - 3 * 0.5 - 0.25, 1.0 - 0.5 - 0.25, 1.0, 1.0]
    torch.testing.assert_close(out, torch.tensor([expected]))

    negative = _row(SamplingParams(frequency_penalty=-1.0, presence_penalty=-2.0), output=[0, 0])
    torch.testing.assert_close(
        apply_penalties(logits, [negative]), torch.tensor([[1.0 + 2.0 + 2.0, 1, 1, 1, 1]])
    )


def test_penalties_combined_per_row() -> None:
    logits = _random_logits(3, vocab=10, seed=21)
    rows = [
        _row(SamplingParams(repetition_penalty=1.5, frequency_penalty=1.0), [2], [3, 3]),
        _row(SamplingParams(), [1], [1]),  # no penalty: row untouched
        _row(SamplingParams(presence_penalty=1.0), [], [9]),
    ]
    out = apply_penalties(logits, rows)
    row0 = logits[0].clone()
    for t in (2, 3):
        row0[t] = row0[t] / 1.5 if row0[t] > 0 else row0[t] * 1.5
    row0[3] -= 2.0
    torch.testing.assert_close(out[0], row0)
    assert torch.equal(out[1], logits[1])
    torch.testing.assert_close(out[2, 9], logits[2, 9] - 1.0)


def test_penalties_change_greedy_choice() -> None:
    logits = torch.tensor([[5.0, 4.0, 0.0]])
    params = SamplingParams(temperature=0.0, frequency_penalty=2.0)
    assert _tokens(Sampler()(logits, [_row(params, output=[0])])) == [1]
    assert _tokens(Sampler()(logits, [_row(params, prompt=[0])])) == [0]


def test_out_of_range_history_ids_rejected() -> None:
    with pytest.raises(ValueError, match="token ids"):
        apply_penalties(torch.zeros(1, 4), [_row(SamplingParams(repetition_penalty=2.0), [4])])


# --------------------------------------------------------------------------- seeds and generators


def _run_steps(sampler: Sampler, position: int, neighbours: int, steps: int = 20) -> list[int]:
    """Sample `steps` tokens for a seed-42 row at `position` among seeded/unseeded neighbours."""
    target = _gen(42)
    others = [_gen(1000 + j) if j % 2 else None for j in range(neighbours)]
    params = SamplingParams(top_p=0.95, seed=42)
    out: list[int] = []
    for step in range(steps):
        rows = [_row(SamplingParams(temperature=0.8), generator=g) for g in others]
        rows.insert(position, _row(params, output=out, generator=target))
        # Each row sees its own logits, identical for the target across runs.
        logits = _random_logits(len(rows), seed=500 + step)
        logits[position] = _random_logits(1, seed=step)[0]
        out.append(sampler(logits, rows)[position].token_id)
    return out


def test_exponential_noise_is_exp1_and_never_zero() -> None:
    """The race's noise, -log(1 - u): Exp(1)'s mean, variance and tail (1M draws, a fixed
    seed: about 5 standard errors of room), and no zero even for u = 0."""
    gen = torch.Generator().manual_seed(7)
    x = exponential_from_uniform(torch.rand(1_000_000, generator=gen))
    assert abs(x.mean().item() - 1.0) < 5e-3 and abs(x.var().item() - 1.0) < 1e-2
    for q in (0.5, 3.0):
        assert abs((x > q).float().mean().item() - math.exp(-q)) < 3e-3
    edge = exponential_from_uniform(torch.tensor([0.0, 0.5, 1.0 - 2**-24]))
    assert edge[0] > 0 and edge[1].item() == pytest.approx(math.log(2.0))
    assert edge[2].item() == pytest.approx(24 * math.log(2.0), rel=1e-3)


def test_seed_reproducible_across_instances_and_batch_positions() -> None:
    alone = _run_steps(Sampler(), position=0, neighbours=0)
    again = _run_steps(Sampler(_gen(9)), position=0, neighbours=0)
    moved = _run_steps(Sampler(), position=3, neighbours=5)
    moved_front = _run_steps(Sampler(_gen(1)), position=0, neighbours=2)
    assert alone == again == moved == moved_front
    assert len(set(alone)) > 1  # actually sampling, not stuck on one token


def test_different_seeds_differ() -> None:
    logits = torch.zeros(1, 1000)  # uniform: collisions across 10 steps are implausible

    def draws(seed: int) -> list[int]:
        g = _gen(seed)
        return [
            _tokens(Sampler()(logits, [_row(SamplingParams(), generator=g)]))[0] for _ in range(10)
        ]

    assert draws(1) == draws(1)
    assert draws(1) != draws(2)


def test_unseeded_rows_use_default_generator() -> None:
    logits = torch.zeros(8, 1000)
    rows = [_row(SamplingParams())] * 8
    torch.manual_seed(0)
    global_state = torch.get_rng_state()
    first = _tokens(Sampler(_gen(77))(logits, rows))
    second = _tokens(Sampler(_gen(77))(logits, rows))
    assert first == second
    assert torch.equal(torch.get_rng_state(), global_state)  # the global RNG was not used
    assert _tokens(Sampler(_gen(78))(logits, rows)) != first


def test_no_default_generator_uses_global_rng() -> None:
    logits = torch.zeros(8, 1000)
    rows = [_row(SamplingParams())] * 8
    torch.manual_seed(3)
    first = _tokens(Sampler()(logits, rows))
    torch.manual_seed(3)
    assert _tokens(Sampler()(logits, rows)) == first


def test_advanced_generator_continues_the_stream() -> None:
    # A decode worker that receives 5 tokens sampled elsewhere fast-forwards its fresh
    # generator past them and then samples what the original worker would have.
    params = SamplingParams(top_k=40, seed=42)
    steps = [_random_logits(1, seed=700 + step) for step in range(8)]
    colocated, out = _gen(42), []
    for logits in steps:
        out.append(Sampler()(logits, [_row(params, output=out, generator=colocated)])[0].token_id)
    handed_off = _gen(42)
    advance_generator(handed_off, VOCAB, 5)
    rest = list(out[:5])
    for logits in steps[5:]:
        rest.append(
            Sampler()(logits, [_row(params, output=rest, generator=handed_off)])[0].token_id
        )
    assert rest == out
    assert torch.equal(handed_off.get_state(), colocated.get_state())


def test_generator_on_another_device_is_rejected() -> None:
    # Shape-only "meta" logits stand in for a GPU here: the check must fire before any draw.
    logits = torch.zeros(1, VOCAB, device="meta")
    with pytest.raises(ValueError, match="generator on cpu cannot draw noise for logits on meta"):
        Sampler()(logits, [_row(SamplingParams(), generator=_gen(0))])
    with pytest.raises(ValueError, match="generator on cpu"):
        Sampler(_gen(0))(logits, [_row(SamplingParams())])


def test_engine_generators_live_on_the_engine_device(
    tiny_model_dir: Path, engine_factory: Callable[..., Any]
) -> None:
    engine = engine_factory(tiny_model_dir)
    device = torch.device(engine.config.device)
    assert engine.kv_cache.device == device
    default = engine.runner.sampler.default_generator
    assert default is not None and default.device == device
    seeded = SamplingParams(seed=5)
    fresh = engine.make_request(engine.spec("fresh", [5, 6, 7], seeded))
    continued = engine.make_request(engine.spec("continued", [5, 6, 7], seeded), Resume((8, 9)))
    for request in (fresh, continued):
        assert request.generator is not None and request.generator.device == device


# --------------------------------------------------------------------------- logprobs


def test_logprobs_match_raw_log_softmax() -> None:
    logits = _random_logits(3, vocab=100, seed=30)
    rows = [
        _row(SamplingParams(logprobs=5, repetition_penalty=1.5, top_k=3), [1, 2], [3], _gen(0)),
        _row(SamplingParams(temperature=0.0, logprobs=20)),
        _row(SamplingParams(), generator=_gen(1)),  # did not ask
    ]
    results = Sampler()(logits, rows)
    reference = torch.log_softmax(logits.float(), dim=-1)
    for i, n in ((0, 5), (1, 20)):
        result = results[i]
        assert result.logprob == pytest.approx(reference[i, result.token_id].item(), abs=1e-6)
        assert result.top_logprobs is not None
        assert len(result.top_logprobs) == n
        values = [lp for _, lp in result.top_logprobs]
        assert values == sorted(values, reverse=True)
        top = reference[i].topk(n)
        assert [t for t, _ in result.top_logprobs] == top.indices.tolist()
        assert values == pytest.approx(top.values.tolist(), abs=1e-6)
    assert results[2].logprob is None and results[2].top_logprobs is None


def test_logprobs_zero_gives_only_sampled_logprob() -> None:
    logits = _random_logits(1, seed=31)
    (result,) = Sampler()(logits, [_row(SamplingParams(logprobs=0), generator=_gen(2))])
    assert result.top_logprobs == ()
    expected = torch.log_softmax(logits, dim=-1)[0, result.token_id].item()
    assert result.logprob == pytest.approx(expected, abs=1e-6)


def test_logprobs_capped_at_vocab() -> None:
    logits = _random_logits(1, vocab=4, seed=32)
    (result,) = Sampler()(logits, [_row(SamplingParams(temperature=0.0, logprobs=10))])
    assert result.top_logprobs is not None and len(result.top_logprobs) == 4
    assert result.token_id == result.top_logprobs[0][0]


# --------------------------------------------------------------------------- misc


def test_input_logits_not_modified() -> None:
    logits = _random_logits(4, seed=40)
    before = logits.clone()
    rows = [
        _row(SamplingParams(repetition_penalty=1.7, top_k=5, logprobs=3), [1], [2], _gen(0)),
        _row(SamplingParams(frequency_penalty=1.0, presence_penalty=0.5, top_p=0.5), [], [3]),
        _row(SamplingParams(temperature=0.0, min_p=0.2), [4], [4]),
        _row(SamplingParams(temperature=0.3, min_p=0.1, top_p=0.8)),
    ]
    Sampler()(logits, rows)
    apply_penalties(logits, rows)
    warp_logits(logits, [SamplingParams(top_k=5, top_p=0.5, min_p=0.1)] * 4)
    assert torch.equal(logits, before)


def test_bad_logits_shape_rejected() -> None:
    with pytest.raises(ValueError, match=r"^logits"):
        Sampler()(torch.zeros(2, 4), [_row(SamplingParams())])
    with pytest.raises(ValueError, match=r"^logits"):
        Sampler()(torch.zeros(4), [_row(SamplingParams())])
    with pytest.raises(ValueError, match=r"^logits"):
        Sampler()(torch.zeros(1, 4, dtype=torch.long), [_row(SamplingParams())])


def test_empty_batch() -> None:
    assert Sampler()(torch.zeros(0, 4), []) == []


def test_params_not_used_by_sampler_are_kept() -> None:
    # max_tokens, stop, stop_token_ids and ignore_eos are engine concerns: sampling ignores them.
    params = SamplingParams(max_tokens=3, stop=("x",), stop_token_ids=(1,), ignore_eos=True)
    logits = torch.tensor([[0.0, 5.0, 0.0]])
    greedy = SamplingParams(temperature=0.0, stop_token_ids=(1,), ignore_eos=True)
    assert _tokens(Sampler()(logits, [_row(greedy)])) == [1]
    assert params.max_tokens == 3 and params.ignore_eos


# --------------------------------------------------------------------------- logit_bias


def test_logit_bias_is_kept_as_sorted_pairs() -> None:
    params = SamplingParams(logit_bias={9: 1, 2: -100.0})  # type: ignore[arg-type]
    assert params.logit_bias == ((2, -100.0), (9, 1.0))
    assert isinstance(params.logit_bias[1][1], float)
    assert SamplingParams(logit_bias=[(3, 0.5)]).logit_bias == ((3, 0.5),)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("bias", "says"),
    [
        ({5: 100.5}, "logit_bias[5] must be a finite float in [-100.0, 100.0], got 100.5"),
        ({5: -101}, "logit_bias[5] must be a finite float in [-100.0, 100.0], got -101"),
        ({5: math.nan}, "logit_bias[5] must be a finite float"),
        ({5: True}, "logit_bias[5] must be a finite float in [-100.0, 100.0], got True"),
        ({-1: 1.0}, "logit_bias token ids must be ints >= 0, got -1"),
        ({"5": 1.0}, "logit_bias token ids must be ints >= 0, got '5'"),
        ("5", "logit_bias must be a tuple, got '5'"),
        ([(1, 2, 3)], "logit_bias must map token ids to floats, got (1, 2, 3)"),
    ],
)
def test_bad_logit_bias_is_refused_naming_the_value(bias: object, says: str) -> None:
    with pytest.raises(ValueError) as err:
        SamplingParams(logit_bias=bias)  # type: ignore[arg-type]
    assert str(err.value).startswith(says)


def test_logit_bias_ids_are_checked_against_the_vocabulary() -> None:
    SamplingParams(logit_bias={VOCAB - 1: 1.0}).validate_for_vocab(VOCAB)
    with pytest.raises(ValueError, match=f"must be in \\[0, {VOCAB}\\), got {VOCAB}"):
        SamplingParams(logit_bias={VOCAB: 1.0}).validate_for_vocab(VOCAB)


def test_logit_bias_bans_and_forces_tokens_in_greedy_rows() -> None:
    logits = _random_logits(3)
    best = logits.argmax(dim=-1).tolist()
    second = logits.topk(2, dim=-1).indices[:, 1].tolist()
    greedy = SamplingParams(temperature=0.0)
    rows = [
        _row(SamplingParams(temperature=0.0, logit_bias={best[0]: -100.0})),
        _row(greedy),  # an unbiased neighbour keeps its argmax
        _row(SamplingParams(temperature=0.0, logit_bias={7: 100.0})),
    ]
    assert _tokens(Sampler()(logits, rows)) == [second[0], best[1], 7]


def test_logit_bias_comes_before_temperature_and_top_k() -> None:
    logits = _random_logits(2, seed=3)
    worst = logits.argmin(dim=-1).tolist()
    # top_k=1 after a +100 bias keeps only the biased token, whatever the draw.
    rows = [
        _row(
            SamplingParams(temperature=1.5, top_k=1, logit_bias={worst[i]: 100.0}),
            generator=_gen(i),
        )
        for i in range(2)
    ]
    assert _tokens(Sampler()(logits, rows)) == worst


def test_a_banned_token_is_never_sampled_and_logprobs_stay_raw() -> None:
    logits = torch.zeros(1, VOCAB)
    logits[0, 5] = 4.0  # token 5 holds most of the mass
    params = SamplingParams(temperature=1.0, logit_bias={5: -100.0}, logprobs=1)
    sampler = Sampler(_gen(0))
    results = [sampler(logits, [_row(params)])[0] for _ in range(200)]
    assert 5 not in _tokens(results)
    raw = torch.log_softmax(logits[0], dim=-1)
    assert results[0].logprob == pytest.approx(raw[results[0].token_id].item())
    assert results[0].top_logprobs is not None and results[0].top_logprobs[0][0] == 5


def test_logit_bias_leaves_the_input_logits_alone() -> None:
    logits = _random_logits(2)
    before = logits.clone()
    Sampler()(logits, [_row(SamplingParams(temperature=0.0, logit_bias={1: 50.0}))] * 2)
    assert torch.equal(logits, before)
