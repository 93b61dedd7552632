"""A linear-attention model's recurrent state around speculative verify rows.

A verify row runs its last known token and its draft through every layer, so a Gated
DeltaNet layer's state ends after the whole draft. Where a draft is not wholly accepted the
state must end after the accepted tokens instead, and no checkpoint holds it there (they are
taken at block boundaries). So each verify row's state slot is copied aside before the step;
a row with a rejected token gets the copy back (its state is then before the row) and the
scheduler counts the row's tokens as not computed (`Scheduler.recompute_rejected`): the next
step recomputes the accepted ones and samples after them, exactly as a plain run would.

    step N    [t d1 d2 d3]  state before -> copy;  accepted d1 only
              state <- copy (after t's predecessor); computed = start
    step N+1  [t d1 x]      recomputed, sampled after x (plain prefill chunk)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from tandem.engine.sampling import SampleResult
from tandem.engine.scheduler import ScheduledRequest
from tandem.model.linear_attention import LinearStates

# A verify row's copy is held in a state slot under this prefix + the request id.
_COPY = "\0draft-state:"


class StateSlots(Protocol):
    """Who assigns the requests' state slots (the runner: `ModelRunner.state_slot`)."""

    def state_slot(self, request_id: str, num_tokens: int | None = None) -> int: ...

    def release(self, request_id: str) -> None: ...


class StateRollback:
    def __init__(self, states: LinearStates, slots: StateSlots) -> None:
        self.states, self.runner = states, slots
        self.num_restored = 0  # rows whose state was put back (a rejected draft token)

    def copy_aside(self, rows: Sequence[ScheduledRequest]) -> dict[str, int]:
        """Copy each verify row's state slot aside (after the step's inputs restored any
        checkpoint into it, before its forward): request id -> the copy's slot."""
        states, runner = self.states, self.runner
        copies = {
            s.request.request_id: runner.state_slot(_COPY + s.request.request_id)
            for s in rows
            if s.draft
        }
        slots = [runner.state_slot(rid) for rid in copies]
        states.copy_slots(states, slots, list(copies.values()))
        return copies

    def restore(
        self,
        rows: Sequence[ScheduledRequest],
        copies: dict[str, int],
        results: dict[str, list[SampleResult]],
    ) -> None:
        """Give the rows whose drafts were not wholly accepted their states back (from
        before the row) and free every copy."""
        states, runner = self.states, self.runner
        src, dst = [], []
        for s in rows:
            rid = s.request.request_id
            if rid in copies and len(results.get(rid, ())) < 1 + len(s.draft):
                src.append(copies[rid])
                dst.append(runner.state_slot(rid, s.start))  # its state is before the row
        states.copy_slots(states, src, dst)
        self.num_restored += len(src)
        for rid in copies:
            runner.release(_COPY + rid)
