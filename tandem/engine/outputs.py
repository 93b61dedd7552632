"""What the engine hands back: a step's output per request and a finished request from
`generate()` (tandem.engine.engine). Its load is `tandem.load.Load`."""

from __future__ import annotations

from dataclasses import dataclass, field

from tandem.engine.sampling import LogprobEntry


@dataclass(frozen=True, slots=True)
class RequestOutput:
    """What one step produced for one request."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None
    handed_off: bool = False
    stop_reason: int | str | None = None  # the stop token id or string that ended it
    num_cached_tokens: int = 0  # prompt tokens that were prefix-cache hits
    block_ids: list[int] = field(default_factory=list)  # handed off: the pinned blocks
    # handed off: how many of block_ids, at the end, hold a linear-attention state
    # (tandem.engine.state_pages); the others are the prompt's KV pages
    state_blocks: int = 0
    # (logprob, top-n) of each new token, when the request asked for logprobs
    logprobs: list[LogprobEntry] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class Completion:
    """A finished request, as returned by `generate()`."""

    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str | None
    num_cached_tokens: int
    logprobs: list[LogprobEntry]
