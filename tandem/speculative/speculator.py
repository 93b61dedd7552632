"""The engine's side of speculation: which requests draft, how much, and what it earned.

Rules (exact unit tests in tests/unit/test_speculative.py):
- A step speculates only while it decodes at most `max_batch` requests: past that the batch
  is no longer bound by reading the weights, and verifying drafts costs more than it saves.
- A request drafts the k that maximises its expected tokens per unit of step time, from its
  own acceptance rate a (a smoothed count of drafted tokens accepted, per token tried) and
  what verifying k tokens costs on the device (`VerifyCost`): a draft of k yields
  1 + a + ... + a^k tokens for a step costing 1 + fixed + per_token * k decode steps. No
  k beats a plain step (a low rate): no draft, and the rate drifts back to its prior with
  every plain step, so the request probes again later. k is at most num_speculative_tokens
  and never drafts past max_tokens or the model's context.
- Without `adaptive` every request drafts num_speculative_tokens (within the limits).
- A constrained request drafts only the tokens its grammar accepts (`valid_prefix`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from tandem.config import SpeculativeConfig
from tandem.speculative.proposers import SHARED_TENANTS, Proposer, SuffixProposer, make_proposer
from tandem.speculative.stats import SpecStats

if TYPE_CHECKING:  # the engine package imports this module (its scheduler)
    from tandem.engine.request import Request


@dataclass(frozen=True, slots=True)
class VerifyCost:
    """A step verifying k drafted tokens after a row's own token costs 1 + fixed +
    per_token * k plain decode steps."""

    fixed: float
    per_token: float


# Measured on a 2-core AVX2 CPU, SmolLM2-135M in float32, one request at a 500-token context
# (`bench_speculative.py cost`, BENCHMARKS.md issue 45): a verify step took 1.43, 1.70, 2.28
# and 2.24 decode steps at k = 1..4 (MKL's GEMMs of 2-8 rows run far below the FMA peak).
CPU_COST = VerifyCost(fixed=0.2, per_token=0.27)
# A GPU's decode step is bound by reading the weights: a few more rows cost next to nothing
# (an estimate, not measured here: no GPU was lent for issue 45).
GPU_COST = VerifyCost(fixed=0.05, per_token=0.02)
PRIOR_RATE = 0.8  # a new request's acceptance rate: try drafting
PRIOR_WEIGHT = 2.0  # tokens' worth of belief in the prior
DECAY = 0.8  # per verify, the weight of a request's earlier counts
PLAIN_DECAY = 0.95  # per plain step, the same: a request that stopped drafting tries again


def expected_tokens(rate: float, k: int) -> float:
    """Tokens a draft of k yields (the row's own included) at per-token acceptance `rate`."""
    return sum(rate**i for i in range(k + 1))


def best_draft_length(rate: float, k_max: int, cost: VerifyCost) -> int:
    """The k in 1..k_max with the most tokens per unit of step time; 0 when none beats a
    plain decode step (1 token per 1)."""
    best, best_gain = 0, 1.0
    for k in range(1, k_max + 1):
        gain = expected_tokens(rate, k) / (1 + cost.fixed + cost.per_token * k)
        if gain > best_gain:
            best, best_gain = k, gain
    return best


class Speculator:
    def __init__(
        self,
        config: SpeculativeConfig,
        max_model_len: int,
        cost: VerifyCost = CPU_COST,
        proposer: Proposer | None = None,
    ) -> None:
        """`proposer`: one that runs a model (tandem.engine.drafting), built by the engine;
        None: the method's own (tandem.speculative.proposers)."""
        self.config = config
        self.max_model_len = max_model_len
        self.cost = cost
        self.proposer: Proposer = proposer or make_proposer(
            config.method, config.ngram_min, config.ngram_max, config.suffix_share
        )
        self._seen: dict[str, int] = {}  # request id -> tokens the proposer has of it
        # request id -> (accepted, tried): drafted tokens, decayed (see `rate`)
        self._counts: dict[str, tuple[float, float]] = {}
        self._stats = SpecStats(config.method)

    def active(self, num_decoding: int) -> bool:
        """Does a step that decodes `num_decoding` requests speculate?"""
        if num_decoding <= self.config.max_batch:
            return True
        self._stats = replace(self._stats, paused_steps=self._stats.paused_steps + 1)
        return False

    def draft(self, request: Request, budget: int) -> tuple[int, ...]:
        """Tokens to verify after the request's last token this step (maybe none); `budget`:
        the step's tokens left, the request's own token included."""
        rid, params = request.request_id, request.sampling_params
        room = min(
            self.config.num_speculative_tokens,
            params.max_tokens - len(request.output_token_ids) - 1,
            self.max_model_len - request.num_tokens - 1,
            budget - 1,
        )
        if room <= 0 or request.hand_off:
            return ()
        seen = self._seen.get(rid)
        if seen is None:
            self.proposer.start(
                rid, request.all_token_ids, request.cache_salt, request.num_prompt_tokens
            )
        elif seen < request.num_tokens:
            self.proposer.extend(rid, request.token_ids_slice(seen, request.num_tokens))
        self._seen[rid] = request.num_tokens
        k = best_draft_length(self.rate(rid), room, self.cost) if self.config.adaptive else room
        if k == 0:
            accepted, tried = self._counts.get(rid, (0.0, 0.0))
            self._counts[rid] = (accepted * PLAIN_DECAY, tried * PLAIN_DECAY)  # toward the prior
            return ()
        draft = self.proposer.propose(rid, k)
        if draft and request.matcher is not None:
            draft = draft[: request.matcher.valid_prefix(draft)]
        return tuple(draft)

    def verified(self, request_id: str, proposed: int, accepted: int, emitted: int) -> None:
        """A row verified `proposed` drafted tokens, accepted `accepted` and emitted
        `emitted` tokens."""
        # Tokens tried: those accepted, and the first rejected one (the rest were never
        # reached): per-token acceptance is then accepted / tried.
        tried = accepted + (accepted < proposed)
        was_accepted, was_tried = self._counts.get(request_id, (0.0, 0.0))
        self._counts[request_id] = (was_accepted * DECAY + accepted, was_tried * DECAY + tried)
        s = self._stats
        self._stats = replace(
            s,
            proposed_tokens=s.proposed_tokens + proposed,
            accepted_tokens=s.accepted_tokens + accepted,
            verify_rows=s.verify_rows + 1,
            emitted_tokens=s.emitted_tokens + emitted,
        )

    def finish(self, request_id: str) -> None:
        """The request is gone: forget it (a shared suffix index keeps its tokens)."""
        self._seen.pop(request_id, None)
        self.proposer.finish(request_id)  # a draft model may hold KV of a request never drafted
        self._counts.pop(request_id, None)

    def rate(self, request_id: str) -> float:
        """The request's per-token acceptance rate, its counts smoothed by the prior."""
        accepted, tried = self._counts.get(request_id, (0.0, 0.0))
        return (accepted + PRIOR_RATE * PRIOR_WEIGHT) / (tried + PRIOR_WEIGHT)

    def stats(self) -> SpecStats:
        """The counts, with a draft model's prompt tokens (`DraftProposer`'s counters)."""
        return replace(
            self._stats,
            draft_prefill_tokens=getattr(self.proposer, "prefill_tokens", 0),
            draft_handoff_tokens=getattr(self.proposer, "handoff_tokens", 0),
        )

    def reset_stats(self) -> None:
        """Count from zero (after the engine's warm-up)."""
        self._stats = SpecStats(self.config.method)
        for counter in ("prefill_tokens", "handoff_tokens"):  # a draft model's
            if hasattr(self.proposer, counter):
                setattr(self.proposer, counter, 0)

    def footprint(self) -> dict[str, tuple[int, int | None]]:
        """What grows with traffic here, as (entries, bound or None: per live request), for
        tandem.engine.footprint: per live request, and a shared suffix pool bounded by its
        tenants."""
        sizes: dict[str, tuple[int, int | None]] = {
            "spec_requests": (len(self._seen), None),
            "spec_acceptance_counts": (len(self._counts), None),
            "spec_proposer_requests": (self.proposer.num_requests(), None),
        }
        if isinstance(self.proposer, SuffixProposer) and self.proposer.share:
            sizes["spec_shared_tenants"] = (self.proposer.num_tenants(), SHARED_TENANTS)
        return sizes


def make_speculator(
    config: SpeculativeConfig,
    max_model_len: int,
    linear_attention: bool,
    device: str = "cpu",
    tensor_parallel_size: int = 1,
    proposer: Proposer | None = None,
    draft_cost: float = 0.0,
) -> Speculator | None:
    """The engine's speculator (None: speculation off). `proposer`: a draft model's
    (tandem.engine.drafting), whose forward for each drafted token costs `draft_cost` plain
    decode steps (its weights' bytes over the target's: both are bound by reading them).

    Raises:
        ValueError: a model with linear-attention layers (Qwen3-Next) split over tensor-
            parallel ranks: every rank would have to put its state back after a rejected
            draft token (tandem.engine.spec_states does it on one rank).
    """
    if not config.enabled:
        return None
    if linear_attention and tensor_parallel_size > 1:
        raise ValueError(
            f"speculative decoding ({config.method}): a linear-attention model's state is "
            "rolled back past rejected draft tokens on one rank only; serve it without "
            "--speculative or with --tensor-parallel-size 1"
        )
    cost = CPU_COST if device.startswith("cpu") else GPU_COST
    cost = replace(cost, per_token=cost.per_token + draft_cost)
    return Speculator(config, max_model_len, cost, proposer)
