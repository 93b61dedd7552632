"""What the engine hands back: a step's output per request and a finished request from
`generate()` (tandem.engine.engine). Its load is `tandem.load.Load`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from tandem.engine.request import Request, RequestSpec, Resume
from tandem.engine.sampling import LogprobEntry, SamplingParams


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
    # (tandem.engine.state_pages) and then a draft model's KV (tandem.engine.drafting);
    # the others are the prompt's KV pages
    state_blocks: int = 0
    draft_blocks: int = 0
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


class Engine(Protocol):
    """What `generate` steps (tandem.engine.engine.LLMEngine, which imports this module)."""

    num_steps: int

    def spec(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        cache_salt: str = "",
    ) -> RequestSpec: ...

    def add_request(self, spec: RequestSpec, resume: Resume | None = None) -> Request: ...

    def has_unfinished(self) -> bool: ...

    def step(self) -> list[RequestOutput]: ...


def generate(
    engine: Engine, prompts: Sequence[str | Sequence[int]], params: SamplingParams | None
) -> list[Completion]:
    """`LLMEngine.generate`: run prompts to completion; output order follows `prompts`."""
    ids = [f"gen-{engine.num_steps}-{i}" for i in range(len(prompts))]
    requests = [
        engine.add_request(engine.spec(rid, p, params)) for rid, p in zip(ids, prompts, strict=True)
    ]
    texts = {rid: "" for rid in ids}
    while engine.has_unfinished():
        for o in engine.step():
            if o.request_id in texts:
                texts[o.request_id] += o.new_text
    return [
        Completion(
            request_id=r.request_id,
            prompt_token_ids=r.prompt_token_ids,
            token_ids=list(r.output_token_ids),
            text=texts[r.request_id],
            finish_reason=r.finish_reason,
            num_cached_tokens=r.num_cached_tokens or 0,
            logprobs=list(r.logprobs),
        )
        for r in requests
    ]
