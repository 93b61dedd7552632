"""Sampling a step whose rows may carry speculative drafts, and verifying the drafts.

A row with draft d1..dk computed k + 1 positions: its last known token and the draft. Each
position is sampled exactly as a plain decode step would sample it -- penalties over the
tokens before it (the draft's included), its grammar's mask after them, the request's own
seeded draw for that output position -- and the draft is accepted while the sampled token
equals the drafted one:

    position   0    1    2    3           draft    d1 d2 d3
    sampled    x0   x1   x2   x3          x0 = d1, x1 = d2, x2 != d3
    emitted    x0   x1   x2               accepted 2; x2 is the target's own token

For a draft that is a fixed guess (every proposer here) this is the rejection rule at its
exact: d is accepted with the target's probability p(d), and otherwise the emitted token is
drawn from p with d excluded, renormalised; so speculation changes neither the distribution
nor, for greedy and seeded requests, a single token. A seeded request's stream is rewound to
the draws its emitted tokens used, so the draws of rejected positions are drawn again.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tandem.engine.grammar import FixedMask, GrammarMatcher
from tandem.engine.sampling import Sampler, SampleResult, SampleRow, advance_generator
from tandem.engine.scheduler import ScheduledRequest


def accepted_length(draft: Sequence[int], sampled: Sequence[int]) -> int:
    """Drafted tokens accepted: the longest prefix of `draft` the target sampled too."""
    n = 0
    while n < len(draft) and sampled[n] == draft[n]:
        n += 1
    return n


def sample_scheduled(
    sampler: Sampler, logits: torch.Tensor, scheduled: Sequence[ScheduledRequest]
) -> dict[str, list[SampleResult]]:
    """The tokens each sampling row of `scheduled` emits: one for a plain row, accepted + 1
    for a row that verified a draft. `logits`: [sum of the sampling rows' 1 + len(draft)]
    rows, in order."""
    scheduled = [s for s in scheduled if s.sample]
    rows: list[SampleRow] = []
    vocab = logits.shape[1]
    for s in scheduled:
        r, draft = s.request, s.draft
        masks: list[GrammarMatcher | FixedMask | None] = [r.matcher] * (len(draft) + 1)
        if draft and r.matcher is not None:
            masks = [FixedMask(m) for m in r.matcher.masks_along(draft, vocab)]
        for j in range(len(draft) + 1):
            outputs = r.output_token_ids if j == 0 else [*r.output_token_ids, *draft[:j]]
            rows.append(
                SampleRow(r.sampling_params, r.prompt_token_ids, outputs, r.generator, masks[j])
            )
    states = [s.request.generator.get_state() if s.draft and s.request.generator else None
              for s in scheduled]  # fmt: skip
    results = sampler(logits, rows)
    out: dict[str, list[SampleResult]] = {}
    at = 0
    for s, state in zip(scheduled, states, strict=True):
        mine = results[at : at + len(s.draft) + 1]
        at += len(s.draft) + 1
        n = accepted_length(s.draft, [m.token_id for m in mine]) + 1
        out[s.request.request_id] = mine[:n]
        generator = s.request.generator
        if state is not None and generator is not None and n < len(mine):
            generator.set_state(state)  # the draws of the emitted tokens only
            advance_generator(generator, vocab, n)
    return out
