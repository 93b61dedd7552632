"""One proposer's running counts, as the engine reports them (metrics, benchmarks)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class SpecStats:
    """Counts since the engine started, for one proposer.

    Attributes:
        proposer: the method ("ngram", "suffix", "draft").
        proposed_tokens: drafted tokens the target verified.
        accepted_tokens: of those, the ones the target agreed with (emitted as they were).
        verify_rows: request-steps that verified a draft (one row of one step each).
        emitted_tokens: tokens those rows emitted: their accepted tokens plus the target's
            own next token, less any after a stop.
        paused_steps: steps in which speculation paused because the batch was larger than
            `SpeculativeConfig.max_batch`.
        draft_prefill_tokens: a draft model's: prompt tokens it computed on this worker (0
            on a decode worker whose hand-offs carried the draft's KV).
        draft_handoff_tokens: a draft model's: prompt tokens whose draft KV arrived in a
            hand-off's draft_kv section.
    """

    proposer: str
    proposed_tokens: int = 0
    accepted_tokens: int = 0
    verify_rows: int = 0
    emitted_tokens: int = 0
    paused_steps: int = 0
    draft_prefill_tokens: int = 0
    draft_handoff_tokens: int = 0

    @property
    def acceptance_rate(self) -> float:
        """Accepted per proposed token (0 before any draft)."""
        return self.accepted_tokens / self.proposed_tokens if self.proposed_tokens else 0.0

    @property
    def acceptance_length(self) -> float:
        """Tokens emitted per verifying row (1.0 = no draft token ever accepted)."""
        return self.emitted_tokens / self.verify_rows if self.verify_rows else 0.0
