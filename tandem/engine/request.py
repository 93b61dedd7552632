"""A request's state inside one engine. Counted, not phased: "in prefill" is derived."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from enum import StrEnum

import torch

from tandem.engine.grammar import GrammarMatcher
from tandem.engine.prefix_hash import ROOT_PARENT_HASH, hash_blocks
from tandem.engine.sampling import LogprobEntry, SamplingParams
from tandem.types import FinishReason


class RequestStatus(StrEnum):
    WAITING = "waiting"  # queued; holds no blocks
    WAITING_FOR_KV = "waiting_for_kv"  # decode role: holds blocks, KV being filled from outside
    RUNNING = "running"
    PREEMPTED = "preempted"  # lost its blocks; will recompute from scratch
    HANDED_OFF = "handed_off"  # prefill role: first token out, blocks pinned for transfer
    FINISHED_STOPPED = "finished_stopped"  # eos, stop token or stop string
    FINISHED_LENGTH = "finished_length"  # max_tokens or the model's context
    FINISHED_ABORTED = "finished_aborted"

    @property
    def finished(self) -> bool:
        return self in (
            RequestStatus.FINISHED_STOPPED,
            RequestStatus.FINISHED_LENGTH,
            RequestStatus.FINISHED_ABORTED,
        )


FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
}


def check_prompt(
    prompt_token_ids: Sequence[int],
    vocab_size: int,
    max_model_len: int,
    output_token_ids: Sequence[int] = (),
) -> None:
    """The prompt rules every hop applies (the router before placing, the engine before
    queueing): not empty, ids inside the vocabulary, room left in the context to generate.

    Raises:
        ValueError: naming the rule and the values.
    """
    if not prompt_token_ids:
        raise ValueError("prompt must not be empty")
    for name, seq in (("prompt", prompt_token_ids), ("output_token_ids", output_token_ids)):
        bad = [t for t in seq if not isinstance(t, int) or not 0 <= t < vocab_size]
        if bad:
            raise ValueError(f"{name} has token ids outside [0, {vocab_size}): {bad[:5]}")
    num_tokens = len(prompt_token_ids) + len(output_token_ids)
    if num_tokens >= max_model_len:
        raise ValueError(
            f"prompt has {num_tokens} tokens; the model's context (max_model_len) is "
            f"{max_model_len}, leaving no room to generate"
        )


@dataclass(frozen=True, slots=True)
class RequestSpec:
    """What a client asked for, validated once at the edge and carried unchanged through
    every hop (router -> prefill -> decode); each worker builds its `Request` from it.

    Attributes:
        request_id: unique among the requests in flight.
        prompt_token_ids: the tokenized prompt (chat template applied).
        params: sampling parameters.
        model: the model it was addressed to.
        timeout_s: time left to the client's deadline when it arrived; None = no deadline.
        cache_salt: mixed into the prompt's prefix-block hashes (`prefix_hash.hash_keys`):
            requests with different salts never share cached blocks (tenant isolation);
            "" = the shared cache.
    """

    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams = field(default_factory=SamplingParams)
    model: str = ""
    timeout_s: float | None = None
    cache_salt: str = ""

    def __post_init__(self) -> None:
        if not self.request_id:
            raise ValueError("request_id must not be empty")
        object.__setattr__(self, "prompt_token_ids", tuple(self.prompt_token_ids))

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)


@dataclass(frozen=True, slots=True)
class Resume:
    """A request that continues tokens generated elsewhere: a decode worker after a prefill
    hand-off (token 1), or after a migration (every token streamed so far).

    Attributes:
        output_token_ids: the tokens already generated; generation continues after them.
        num_emitted_chars: characters of their text the client has been sent; None = all
            of it (the text still to stream starts after them).
    """

    output_token_ids: tuple[int, ...]
    num_emitted_chars: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "output_token_ids", tuple(self.output_token_ids))


@dataclass(slots=True)
class Request:
    """One generation request.

    Attributes:
        prompt_token_ids: the prompt.
        output_token_ids: tokens generated so far (for a decode-role request, starts with
            the tokens the prefill worker already produced).
        num_computed_tokens: tokens whose KV is in this engine's cache.
        hand_off: stop after the first new token and keep the blocks (prefill role).
        cache_salt: the tenant's salt (RequestSpec.cache_salt), one of the block hashes' extra
            keys: requests with different salts never share a cached block.
        block_hashes: prefix hashes of every full block of prompt + output, under
            `prefix_hash.hash_keys(model_id, cache_salt)`.
        device: where a seeded request's generator lives; the engine passes its own, since
            sampling noise is drawn on the logits' device.
        generator: the request's own stream when it has a seed (made in __post_init__).
        matcher: a constrained request's grammar position, advanced past every output token
            (the engine makes it, replaying any tokens generated elsewhere).
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: tuple[int, ...] = ()
    arrival_time: float = 0.0
    hand_off: bool = False
    cache_salt: str = ""
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int | None = None  # prefix-cache hit when first scheduled
    num_preemptions: int = 0
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    block_hashes: list[int] = field(default_factory=list)
    logprobs: list[LogprobEntry] = field(default_factory=list)
    device: torch.device | str = "cpu"
    generator: torch.Generator | None = None
    matcher: GrammarMatcher | None = None
    first_token_time: float | None = None
    finish_time: float | None = None

    def __post_init__(self) -> None:
        if self.sampling_params.seed is not None and self.generator is None:
            generator = torch.Generator(device=self.device)
            self.generator = generator.manual_seed(self.sampling_params.seed)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_ids_slice(self, start: int, end: int) -> list[int]:
        """all_token_ids[start:end] without building the whole list."""
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p : end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - p]

    @property
    def finish_reason(self) -> str | None:
        return FINISH_REASONS.get(self.status)

    def update_block_hashes(self, block_size: int, extra_keys: tuple[str, ...]) -> None:
        """Extend block_hashes to cover every full block of prompt + output.

        Args:
            extra_keys: `prefix_hash.hash_keys(model_id, self.cache_salt)`; the same on
                every call for one request (the chain is extended, never recomputed).
        """
        num_full = self.num_tokens // block_size
        have = len(self.block_hashes)
        if num_full > have:
            parent = self.block_hashes[-1] if self.block_hashes else ROOT_PARENT_HASH
            tokens = self.token_ids_slice(have * block_size, num_full * block_size)
            self.block_hashes.extend(hash_blocks(tokens, block_size, extra_keys, parent))
