"""Several choices from one OpenAI request, as pure rules: completions' lists of prompts,
`n` sequences per prompt, the seed of each, and the usage of them all.

A request with P prompts and n sequences each has P x n choices; choice `p * n + j` is
sequence j of prompt p (OpenAI's numbering). Each choice is one GenerateRequest through the
router: sequence 0 of a prompt goes first and computes the prompt, and its siblings are sent
once it has its first token, so they find the prompt's blocks in a worker's prefix cache
instead of computing them again (tandem.services.router.openai.fanout does the I/O).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tandem.v1 import router_pb2 as rpb

MAX_CHOICES = 64  # prompts x n in one request; more is a 400 (each is a request)
_SEED_LIMIT = 2**63  # the engine's seeds (tandem.engine.sampling)

Prompt = str | list[int]


@dataclass(frozen=True, slots=True)
class ChoicePlan:
    """One choice: its index in the answer, which prompt and which of its n sequences, and
    the request that makes it."""

    index: int
    prompt_index: int
    sequence: int
    request: rpb.GenerateRequest


def parse_prompts(value: Any) -> list[Prompt]:
    """Completions' `prompt`: a string, a list of strings, a list of token ids, or a list of
    such lists. Raises ValueError (the reason; the field is `prompt`)."""
    if value == "":
        raise ValueError("must not be empty")
    if isinstance(value, str) or _is_ids(value):
        value = [value]
    if not isinstance(value, list) or not value:
        raise ValueError(
            "must be a non-empty string, a list of token ids, or a non-empty list of either"
        )
    prompts: list[Prompt] = []
    for i, item in enumerate(value):
        if isinstance(item, str):
            if not item:
                raise ValueError(f"[{i}] must not be empty")
            prompts.append(item)
        elif _is_ids(item):
            prompts.append(list(item))
        else:
            raise ValueError(f"[{i}] must be a non-empty string or a list of token ids >= 0")
    return prompts


def _is_ids(value: Any) -> bool:
    return (
        isinstance(value, list)
        and bool(value)
        and all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in value)
    )


def derive_seed(seed: int, sequence: int) -> int:
    """Sequence `sequence`'s seed for a request seeded with `seed`: sequence 0 keeps it (n=1
    answers as before), the others get distinct, reproducible seeds."""
    if sequence == 0:
        return seed
    digest = hashlib.blake2b(
        f"{seed}/{sequence}".encode(), digest_size=8, person=b"tandem.n.seed"
    ).digest()
    return int.from_bytes(digest, "little") % _SEED_LIMIT


def plan(requests: Sequence[rpb.GenerateRequest], n: int, label: str = "") -> list[ChoicePlan]:
    """The requests for `n` sequences of each prompt's request, in choice order. `label`
    (X-Request-Id) names choice 0; choice i > 0 is `label#i` (labels are unique per tenant
    among running requests)."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    choices = []
    for p, base in enumerate(requests):
        for j in range(n):
            index = p * n + j
            request = rpb.GenerateRequest()
            request.CopyFrom(base)
            if j and base.sampling.HasField("seed"):
                request.sampling.seed = derive_seed(base.sampling.seed, j)
            if label:
                request.request_id = label if index == 0 else f"{label}#{index}"
            choices.append(ChoicePlan(index, p, j, request))
    return choices


def usage(choices: Sequence[tuple[int, rpb.Usage]]) -> rpb.Usage:
    """The usage of a request's choices ((prompt index, usage) each), as OpenAI counts it:
    each prompt once (prompt and cached tokens of its first choice: the sequence that
    computed it), completion tokens of every choice."""
    total = rpb.Usage()
    seen: set[int] = set()
    for prompt_index, u in choices:
        if prompt_index not in seen:
            seen.add(prompt_index)
            total.prompt_tokens += u.prompt_tokens
            total.cached_prompt_tokens += u.cached_prompt_tokens
        total.completion_tokens += u.completion_tokens
    return total
