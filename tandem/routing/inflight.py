"""A router's own view of the load it has sent out and not yet seen finish.

Worker heartbeats lag (0.5 s) behind a burst of placements; without this, every request of
a burst would see the same, stale load and land on the same worker. Each placement adds its
decode request and its prompt tokens (when a prefill worker computes them); the prompt
tokens leave when the first token comes back, the decode request when the request ends.
"""

from __future__ import annotations

import dataclasses

from tandem.routing.policy import Placement, WorkerLoad


class InflightLoad:
    """Per-worker requests and prefill tokens this router has in flight."""

    def __init__(self) -> None:
        self.decode_requests: dict[str, int] = {}  # decode worker id -> unfinished requests
        self.prefill_tokens: dict[str, int] = {}  # prefill worker id -> tokens awaiting token 1

    def dispatch(self, placement: Placement, num_prompt_tokens: int) -> Dispatch:
        """Count a placed request; the returned handle takes it off again."""
        return Dispatch(self, placement, num_prompt_tokens)

    def with_inflight(self, worker: WorkerLoad) -> WorkerLoad:
        """`worker` as placement should see it: its reported load plus this router's."""
        return dataclasses.replace(
            worker,
            inflight_requests=self.decode_requests.get(worker.worker_id, 0),
            inflight_prefill_tokens=self.prefill_tokens.get(worker.worker_id, 0),
        )

    def _add(self, table: dict[str, int], worker_id: str, delta: int) -> None:
        value = table.get(worker_id, 0) + delta
        assert value >= 0, f"{worker_id}: in-flight count would go negative ({value})"
        if value:
            table[worker_id] = value
        else:
            del table[worker_id]  # departed workers leave nothing behind


class Dispatch:
    """One placed request's share of `InflightLoad`. Each step counts once, however often
    it is called, so error paths may call `finish` without tracking what already ran."""

    def __init__(self, load: InflightLoad, placement: Placement, num_prompt_tokens: int) -> None:
        self._load = load
        self._placement = placement
        self._num_tokens = num_prompt_tokens
        self.prefill_pending = placement.prefill is not None
        self.finished = False
        load._add(load.decode_requests, placement.decode.worker_id, +1)
        if placement.prefill is not None:
            load._add(load.prefill_tokens, placement.prefill.worker_id, +num_prompt_tokens)

    def prefill_done(self) -> None:
        """The prefill worker answered (or will not): its tokens are no longer queued."""
        if self.prefill_pending:
            assert self._placement.prefill is not None
            self.prefill_pending = False
            self._load._add(
                self._load.prefill_tokens, self._placement.prefill.worker_id, -self._num_tokens
            )

    def finish(self) -> None:
        """The request ended, whichever way."""
        self.prefill_done()
        if not self.finished:
            self.finished = True
            self._load._add(self._load.decode_requests, self._placement.decode.worker_id, -1)
