"""Several choices from one OpenAI request (services/router/openai/choices.py): the prompt
list rule, choice numbering, derived seeds, labels and the merged usage. Exact, no I/O."""

from __future__ import annotations

from typing import Any

import pytest

from tandem.services.router.openai import answers
from tandem.services.router.openai import choices as choices
from tandem.services.router.openai import protocol as oai
from tandem.v1 import router_pb2 as rpb


def request(text: str, seed: int | None = None) -> rpb.GenerateRequest:
    msg = rpb.GenerateRequest(text=text)
    msg.sampling.max_tokens = 4
    if seed is not None:
        msg.sampling.seed = seed
    return msg


@pytest.mark.parametrize(
    ("value", "prompts"),
    [
        ("hi", ["hi"]),
        ([3, 4], [[3, 4]]),
        (["a", "b"], ["a", "b"]),
        ([[1], [2, 3]], [[1], [2, 3]]),
        (["a", [5]], ["a", [5]]),
    ],
)
def test_prompt_lists(value: Any, prompts: list[Any]) -> None:
    assert choices.parse_prompts(value) == prompts


@pytest.mark.parametrize(
    ("value", "says"),
    [
        ("", "must not be empty"),
        ([], "must be a non-empty string, a list of token ids, or a non-empty list of either"),
        (None, "must be a non-empty string, a list of token ids, or a non-empty list of either"),
        (["a", ""], "[1] must not be empty"),
        ([[1], [-1]], "[1] must be a non-empty string or a list of token ids >= 0"),
        ([[True]], "[0] must be a non-empty string or a list of token ids >= 0"),
        ([1, "a"], "[0] must be a non-empty string or a list of token ids >= 0"),
    ],
)
def test_prompt_list_refusals(value: Any, says: str) -> None:
    with pytest.raises(ValueError) as err:
        choices.parse_prompts(value)
    assert str(err.value) == says


def test_choices_are_numbered_prompt_major_and_keep_their_prompt() -> None:
    plans = choices.plan([request("a"), request("b")], n=3)
    assert [(p.index, p.prompt_index, p.sequence, p.request.text) for p in plans] == [
        (0, 0, 0, "a"), (1, 0, 1, "a"), (2, 0, 2, "a"),
        (3, 1, 0, "b"), (4, 1, 1, "b"), (5, 1, 2, "b"),
    ]  # fmt: skip
    # Unseeded: no seed appears (each sequence draws from the engine's generator).
    assert not any(p.request.sampling.HasField("seed") for p in plans)
    assert all(p.request.sampling.max_tokens == 4 for p in plans)


def test_seeded_sequences_get_distinct_reproducible_seeds() -> None:
    plans = choices.plan([request("a", seed=7), request("b", seed=7)], n=4)
    seeds = [p.request.sampling.seed for p in plans]
    assert seeds[0] == 7 and seeds[4] == 7  # sequence 0 answers as n=1 would
    assert len(set(seeds[:4])) == 4 and seeds[:4] == seeds[4:]  # per prompt alike
    assert seeds == [p.request.sampling.seed for p in choices.plan([request("a", 7)] * 2, 4)]
    assert all(0 <= s < 2**63 for s in seeds)
    assert choices.derive_seed(7, 1) != choices.derive_seed(8, 1)
    assert choices.derive_seed(7, 1) == choices.derive_seed(7, 1)


def test_the_base_request_is_not_changed() -> None:
    base = request("a", seed=7)
    choices.plan([base], n=3, label="L")
    assert (base.sampling.seed, base.request_id) == (7, "")


def test_labels_stay_unique_per_choice() -> None:
    plans = choices.plan([request("a"), request("b")], n=2, label="job")
    assert [p.request.request_id for p in plans] == ["job", "job#1", "job#2", "job#3"]
    assert {p.request.request_id for p in choices.plan([request("a")], 2)} == {""}


def test_n_below_one_is_a_caller_bug() -> None:
    with pytest.raises(ValueError, match="n must be >= 1, got 0"):
        choices.plan([request("a")], 0)


def test_usage_counts_each_prompt_once_and_every_completion() -> None:
    def u(prompt: int, completion: int, cached: int) -> rpb.Usage:
        return rpb.Usage(
            prompt_tokens=prompt, completion_tokens=completion, cached_prompt_tokens=cached
        )

    total = choices.usage([(0, u(10, 3, 0)), (0, u(10, 4, 8)), (1, u(6, 5, 4)), (1, u(6, 1, 4))])
    assert (total.prompt_tokens, total.completion_tokens, total.cached_prompt_tokens) == (16, 13, 4)


def test_answers_carry_their_choice_index_and_echo() -> None:
    parsed = oai.parse_completion({"prompt": "p", "n": 2, "echo": True}, "m", 10)
    answer = answers.Answer("cmpl-1", "m", False, parsed, str, 5, index=1, echo="p")
    assert answer.echo_chunk()["choices"] == [
        {"index": 1, "text": "p", "logprobs": None, "finish_reason": None}
    ]
    assert answer.chunk(rpb.Chunk(text=" x"))["choices"][0]["index"] == 1
    complete = rpb.Complete(finish_reason=rpb.FINISH_REASON_LENGTH)
    assert answer.last(complete)["choices"][0]["index"] == 1
    whole = answer.whole(complete)["choices"]
    assert whole == [{"index": 1, "text": "p x", "logprobs": None, "finish_reason": "length"}]
