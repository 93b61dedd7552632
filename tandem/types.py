"""Closed sets the core decides and the edge carries: one enum each, defined only here.

Values are the strings the wire, Redis payloads, metric labels and logs already use, and
each enum is a `StrEnum`, so a member compares equal to (and hashes like) its string. The
services map them to protos only in their `convert.py`.
"""

from __future__ import annotations

from enum import StrEnum


class Role(StrEnum):
    """What a worker does in a disaggregated fleet. Iterating gives the fleet's order:
    prefill first (a request meets it first), then decode."""

    PREFILL = "prefill"  # prompts to their first token; the KV is handed to a decode worker
    DECODE = "decode"  # the rest of the tokens, from pulled KV or its own prefill

    @property
    def rank(self) -> int:
        """Position in the fleet's order (prefill 0, decode 1): a sort key."""
        return _ROLE_RANK[self]


_ROLE_RANK = {role: i for i, role in enumerate(Role)}


class FinishReason(StrEnum):
    """Why a request stopped producing tokens (vLLM's `RequestFinishedReason`)."""

    STOP = "stop"  # eos, a stop token or a stop string
    LENGTH = "length"  # max_tokens or the model's context
    ABORT = "abort"  # cancelled by the client, the router or a deadline


class KVOutcome(StrEnum):
    """How a decode worker's pull of a KV hand-off ended (metric label and trace value)."""

    COMMITTED = "committed"  # read and the lease confirmed: the request joined the batch
    LAPSED = "lapsed"  # read, but the lease ended before the confirm: the copy is dropped
    FAILED = "failed"  # the read or the confirm call failed
    REFUSED = "refused"  # the hand-off was refused before any read (invalid, forged, no room)
    RECOMPUTED = "recomputed"  # traces only: not committed, so the prompt was prefilled here
