"""The engine's side of speculation: which requests draft, how much, and what it earned.

Rules (exact unit tests in tests/unit/test_speculative.py):
- A step speculates only while it decodes at most `max_batch` requests: past that the batch
  is no longer bound by reading the weights, and verifying drafts costs more than it saves.
- A request's draft is at most its own k, which adapts to what it accepts: a fully accepted
  draft raises k by one (up to num_speculative_tokens), a partly accepted one sets it to the
  accepted length + 1. k never drafts past max_tokens or the model's context.
- A constrained request drafts only the tokens its grammar accepts (`valid_prefix`).
"""

from __future__ import annotations

from dataclasses import replace

from tandem.config import SpeculativeConfig
from tandem.engine.request import Request
from tandem.speculative.proposers import SHARED_TENANTS, Proposer, SuffixProposer, make_proposer
from tandem.speculative.stats import SpecStats


class Speculator:
    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.proposer: Proposer = make_proposer(
            config.method, config.ngram_min, config.ngram_max, config.suffix_share
        )
        self._seen: dict[str, int] = {}  # request id -> tokens the proposer has of it
        self._k: dict[str, int] = {}  # request id -> its adapted draft length
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
            self._k.get(rid, self.config.num_speculative_tokens),
            params.max_tokens - len(request.output_token_ids) - 1,
            self.max_model_len - request.num_tokens - 1,
            budget - 1,
        )
        if room <= 0 or request.hand_off:
            return ()
        seen = self._seen.get(rid)
        if seen is None:
            self.proposer.start(rid, request.all_token_ids, request.cache_salt)
        elif seen < request.num_tokens:
            self.proposer.extend(rid, request.token_ids_slice(seen, request.num_tokens))
        self._seen[rid] = request.num_tokens
        draft = self.proposer.propose(rid, room)
        if draft and request.matcher is not None:
            draft = draft[: request.matcher.valid_prefix(draft)]
        return tuple(draft)

    def verified(self, request_id: str, proposed: int, accepted: int, emitted: int) -> None:
        """A row verified `proposed` drafted tokens, accepted `accepted` and emitted
        `emitted` tokens."""
        k_max = self.config.num_speculative_tokens
        k = self._k.get(request_id, k_max)
        self._k[request_id] = min(k_max, k + 1) if accepted == proposed else accepted + 1
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
        if self._seen.pop(request_id, None) is not None:
            self.proposer.finish(request_id)
        self._k.pop(request_id, None)

    def stats(self) -> SpecStats:
        return self._stats

    def footprint(self) -> dict[str, tuple[int, int | None]]:
        """What grows with traffic here, as (entries, bound or None: per live request), for
        tandem.engine.footprint: per live request, and a shared suffix pool bounded by its
        tenants."""
        sizes: dict[str, tuple[int, int | None]] = {
            "spec_requests": (len(self._seen), None),
            "spec_draft_lengths": (len(self._k), None),
            "spec_proposer_requests": (self.proposer.num_requests(), None),
        }
        if isinstance(self.proposer, SuffixProposer) and self.proposer.share:
            sizes["spec_shared_tenants"] = (self.proposer.num_tenants(), SHARED_TENANTS)
        return sizes


def make_speculator(
    config: SpeculativeConfig, max_model_len: int, linear_attention: bool
) -> Speculator | None:
    """The engine's speculator (None: speculation off).

    Raises:
        ValueError: a model with linear-attention layers (Qwen3-Next), whose recurrent state
            cannot yet be rolled back past a rejected draft token.
    """
    if not config.enabled:
        return None
    if linear_attention:
        raise ValueError(
            f"speculative decoding ({config.method}): a linear-attention model's state cannot "
            "yet be rolled back past rejected draft tokens; serve it without --speculative"
        )
    return Speculator(config, max_model_len)
