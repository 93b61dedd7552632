"""Continuous batching with chunked prefill, prefix caching and preemption by recompute.

Pure: `schedule()` plans a step from plain state, `update()` applies the step's sampled
tokens. No I/O, no torch, no clock reads (the engine passes `now`).

Each step spends a token budget (`max_num_batched_tokens`):
  1. running requests first, in arrival order: one token each when decoding (plus a draft
     to verify, with speculation: tandem.speculative), a chunk when prefilling; when blocks
     run out, the most recently admitted running request is
     preempted (blocks freed, recomputed later) until the current one fits;
  2. then waiting requests, while budget, `max_num_seqs` and free blocks allow, starting
     after their longest cached prefix; those whose KV is already in place (committed
     hand-offs) go first, since only running returns their blocks.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from tandem.config import SchedulerConfig
from tandem.engine.kv_manager import KVCacheManager
from tandem.engine.prefix_hash import hash_keys
from tandem.engine.request import Request, RequestStatus
from tandem.engine.sampling import SampleResult
from tandem.speculative.speculator import Speculator


def kv_tokens(request: Request) -> int:
    """Decode role: tokens of a request whose KV came from another worker (`reserve_kv`)."""
    return request.num_tokens - 1


def decoding(request: Request) -> bool:
    """Is the request decoding: all its KV computed but its last token's?"""
    return 0 < request.num_computed_tokens == request.num_tokens - 1


@dataclass(frozen=True, slots=True)
class ScheduledRequest:
    """One request's share of a step.

    Attributes:
        num_new_tokens: tokens computed this step, starting at position `start`.
        block_ids: the request's whole block table.
        sample: this chunk reaches the last known token, so the step samples the next one.
        draft: speculative tokens after the last known token, computed with it (counted in
            num_new_tokens) and verified by sampling each position.
    """

    request: Request
    start: int
    num_new_tokens: int
    block_ids: tuple[int, ...]
    sample: bool
    draft: tuple[int, ...] = ()

    @property
    def is_decode(self) -> bool:
        return self.num_new_tokens == 1 and self.start > 0

    @property
    def num_prefill_tokens(self) -> int:
        """Prompt (or recomputed) tokens this row computes: not a decode, not a draft's."""
        return 0 if self.is_decode or self.draft else self.num_new_tokens


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted_ids: list[str] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


@dataclass(frozen=True, slots=True)
class TokenEvent:
    """A request's progress after a step: its new tokens (several when a draft was
    accepted) and whether it ended."""

    request: Request
    new_token_ids: list[int]
    finished: bool


class Scheduler:
    """Plans the steps of one engine over its KV cache manager.

    Args:
        model_id: the first extra key of every block hash; a request's own `cache_salt`
            follows it (`prefix_hash.hash_keys`), so requests with different salts never
            share a cached block.
        kv_format: a scaled (FP8) cache's KV format (`kv_quant.kv_format`), hashed after
            them so that its blocks never share a hash with another format's; "" otherwise.
    """

    def __init__(
        self,
        config: SchedulerConfig,
        kv: KVCacheManager,
        max_model_len: int,
        model_id: str = "",
        kv_format: str = "",
    ) -> None:
        self.config = config
        self.kv_format = kv_format
        self.kv = kv
        self.max_model_len = max_model_len
        self.model_id = model_id
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.waiting_for_kv: dict[str, Request] = {}
        self.handed_off: dict[str, Request] = {}
        self.num_preemptions = 0  # since start: requests whose blocks were freed to recompute
        # Called with a request about to be admitted, before its prefix-cache lookup (the KV
        # tiers put the blocks they brought back for it into the cache there).
        self.before_admit: Callable[[Request], None] | None = None
        self.speculator: Speculator | None = None  # drafts for decoding requests
        # A linear-attention model's state goes back before a verify row with a rejected
        # token (tandem.engine.spec_states): the row's tokens are then recomputed.
        self.recompute_rejected = False

    # -- admission -------------------------------------------------------------------------

    def hash_request(self, request: Request) -> None:
        """Its prompt's block hashes (what `add_request` does first)."""
        keys = hash_keys(self.model_id, request.cache_salt, self.kv_format)
        request.update_block_hashes(self.kv.block_size, keys)

    def add_request(self, request: Request) -> None:
        self.hash_request(request)
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def reserve_kv(self, request: Request) -> tuple[list[int], int] | None:
        """Decode role: allocate blocks for tokens whose KV arrives from outside: every token
        but the last (`kv_tokens`: a prefill worker's hand-off covers the prompt, its first
        token following; a draining decode worker's, the prompt and the output but its last).

        Returns (block table, tokens already cached locally); the caller fills the blocks
        for positions [cached, kv_tokens) and then calls `commit_kv`. None if too few
        blocks are free (nothing changed).
        """
        # Hashed here from the request's own tokens and salt: the blocks filled from outside
        # are published to the prefix cache (commit_kv) under these hashes, never under
        # anything the KV's sender claims.
        self.hash_request(request)
        # The last token's KV is not supplied (nobody computed it), so only the blocks before
        # it may come from the local prefix cache.
        hits, num_cached = self.kv.get_computed_blocks(request, kv_tokens(request))
        num_new = kv_tokens(request) - num_cached
        if self.kv.allocate_slots(request, num_new, hits, live_only=True) is None:
            return None
        request.status = RequestStatus.WAITING_FOR_KV
        request.num_cached_tokens = num_cached
        self.waiting_for_kv[request.request_id] = request
        return self.kv.get_block_ids(request.request_id), num_cached

    def commit_kv(self, request_id: str) -> None:
        """Decode role: the KV `reserve_kv` reserved is in place; the request joins the
        batch."""
        request = self.waiting_for_kv.pop(request_id, None)
        if request is None:
            raise ValueError(f"request {request_id} is not waiting for KV")
        request.num_computed_tokens = kv_tokens(request)
        # Under the hashes reserve_kv computed from the request's own tokens and salt.
        self.kv.cache_blocks(request)
        request.status = RequestStatus.WAITING
        # It already holds its blocks: put it first so those blocks start earning.
        self.waiting.appendleft(request)

    # -- planning --------------------------------------------------------------------------

    def _chunk(self, num_remaining: int, budget: int) -> int:
        """Tokens of a request to compute this step: all that remain, within the limits."""
        num_new = min(num_remaining, budget)
        threshold = self.config.long_prefill_token_threshold
        if threshold is not None:
            num_new = min(num_new, threshold)
        return num_new

    def _schedule_one(
        self, request: Request, start: int, num_new: int, draft: tuple[int, ...] = ()
    ) -> ScheduledRequest:
        return ScheduledRequest(
            request=request,
            start=start,
            num_new_tokens=num_new,
            block_ids=tuple(self.kv.get_block_ids(request.request_id)),
            sample=start + num_new - len(draft) == request.num_tokens,
            draft=draft,
        )

    def _draft(
        self, request: Request, speculator: Speculator | None, budget: int
    ) -> tuple[int, ...]:
        """A draft to verify after the request's next token, its blocks allocated; none
        unless the request is decoding (only its last token's KV is missing)."""
        if speculator is None or not decoding(request):
            return ()
        draft = speculator.draft(request, budget)
        if draft and self.kv.allocate_slots(request, 1 + len(draft)) is None:
            return ()  # no blocks for it: decode plainly
        return draft

    def _speculating(self) -> bool:
        """Does this step draft (a speculator, and few enough decoding requests)?"""
        if self.speculator is None:
            return False
        return self.speculator.active(sum(decoding(r) for r in self.running))

    def _preempt(self, request: Request) -> None:
        self.kv.free(request.request_id)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        # First to start again, but behind the committed hand-offs at the queue's head: a
        # request holding blocks gives them back only by running, and behind one that needs
        # more blocks than are free (this one, recomputing a long context) it would wait
        # forever, and so would the queue. The queue is thus always: the requests whose KV is
        # in place (commit_kv puts them first), then the preempted, then arrivals.
        holding = 0
        while holding < len(self.waiting) and self.waiting[holding].num_computed_tokens > 0:
            holding += 1
        self.waiting.insert(holding, request)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        speculator = self.speculator if self._speculating() else None
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = self._chunk(request.num_tokens - request.num_computed_tokens, budget)
            assert num_new > 0, f"running request {request.request_id} has nothing to compute"
            draft = self._draft(request, speculator, budget)
            num_new += len(draft)
            while self.kv.allocate_slots(request, num_new) is None:
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted_ids.append(victim.request_id)
                if victim is request:
                    break
            else:
                start = request.num_computed_tokens
                out.scheduled.append(self._schedule_one(request, start, num_new, draft))
                budget -= num_new
                i += 1
                continue
            break  # the current request itself was preempted; nothing more fits

        if out.preempted_ids:
            return out  # memory is short: admit nothing new this step
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting[0]
            hits: list[int] = []
            if request.num_computed_tokens == 0:
                if self.before_admit is not None:
                    self.before_admit(request)
                hits, num_cached = self.kv.get_computed_blocks(request)
            else:
                num_cached = request.num_computed_tokens  # decode role: KV already in place
            start = num_cached
            num_new = self._chunk(request.num_tokens - start, budget)
            draft = self._draft(request, speculator, budget)  # a committed hand-off decodes
            num_new += len(draft)
            if self.kv.allocate_slots(request, num_new, hits) is None:
                break
            request.num_computed_tokens = start
            if request.num_cached_tokens is None:
                request.num_cached_tokens = num_cached
            self.waiting.popleft()
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.scheduled.append(self._schedule_one(request, start, num_new, draft))
            budget -= num_new
        return out

    # -- applying results ------------------------------------------------------------------

    def update(
        self, out: SchedulerOutput, samples: dict[str, list[SampleResult]], now: float = 0.0
    ) -> list[TokenEvent]:
        """Advance every scheduled request; append sampled tokens (a row that verified a
        draft brings its accepted tokens and the target's next one); finish stopped ones."""
        events = []
        for sched in out.scheduled:
            request = sched.request
            if request.status != RequestStatus.RUNNING:
                continue  # aborted while the step ran
            results = samples[request.request_id] if sched.sample else []
            # A draft's rejected positions hold KV that is not the request's: only the
            # accepted ones count as computed (they are overwritten later), so neither the
            # prefix cache nor a sliding table's trim ever sees the rest.
            accepted = len(results) - 1 if sched.draft else 0
            request.num_computed_tokens = sched.start + sched.num_new_tokens - len(sched.draft)
            request.num_computed_tokens += accepted
            if self.recompute_rejected and accepted < len(sched.draft):
                request.num_computed_tokens = sched.start  # its state is before the row
            if not sched.sample:
                self.kv.cache_blocks(request)
                continue
            status, new_ids = None, []
            for result in results:
                new_ids.append(result.token_id)
                request.output_token_ids.append(result.token_id)
                if request.matcher is not None:
                    # The mask allowed only tokens it accepts; a refusal leaves it finished.
                    request.matcher.accept(result.token_id)
                if request.sampling_params.logprobs is not None:
                    request.logprobs.append((result.logprob, result.top_logprobs))
                status = self._check_stop(request)
                if status is not None:
                    break  # a draft's tokens after a stop are not the request's
            if request.first_token_time is None:
                request.first_token_time = now
            if sched.draft and self.speculator is not None:
                self.speculator.verified(request.request_id, len(sched.draft), accepted,
                                         len(new_ids))  # fmt: skip
            self.hash_request(request)
            self.kv.cache_blocks(request)
            if status is not None:
                self.finish(request.request_id, status, now)
            elif request.hand_off:
                self.running.remove(request)
                request.status = RequestStatus.HANDED_OFF
                self.handed_off[request.request_id] = request
            events.append(TokenEvent(request, new_ids, status is not None))
        return events

    def _check_stop(self, request: Request) -> RequestStatus | None:
        params = request.sampling_params
        last = request.output_token_ids[-1]
        if not params.ignore_eos and last in request.eos_token_ids:
            request.stop_reason = last
            return RequestStatus.FINISHED_STOPPED
        if last in params.stop_token_ids:
            request.stop_reason = last
            return RequestStatus.FINISHED_STOPPED
        if request.matcher is not None and request.matcher.is_finished:
            # The output is complete (nothing but EOS could follow): a stop, even when it
            # is also the last token max_tokens allows.
            return RequestStatus.FINISHED_STOPPED
        if len(request.output_token_ids) >= params.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if request.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def finish(self, request_id: str, status: RequestStatus, now: float = 0.0) -> Request | None:
        """End a request anywhere in its life and free its blocks. None if unknown."""
        assert status.finished
        request = self._remove(request_id)
        if request is None:
            return None
        self.kv.free(request_id)
        request.status = status
        request.finish_time = now
        return request

    def hand_off_running(self, request_id: str) -> Request | None:
        """Decode role, draining: a decoding request (KV computed for all its tokens but the
        last) stops with its blocks pinned, handed off as a prefill worker's are (`finish`
        frees them); None when it is not decoding now (waiting, prefilling, preempted)."""
        request = next((r for r in self.running if r.request_id == request_id), None)
        if request is None or not decoding(request):
            return None
        self.running.remove(request)
        request.status = RequestStatus.HANDED_OFF
        self.handed_off[request_id] = request
        return request

    def _remove(self, request_id: str) -> Request | None:
        for i, r in enumerate(self.running):
            if r.request_id == request_id:
                return self.running.pop(i)
        for r in self.waiting:
            if r.request_id == request_id:
                self.waiting.remove(r)
                return r
        return self.waiting_for_kv.pop(request_id, None) or self.handed_off.pop(request_id, None)

    # -- introspection ---------------------------------------------------------------------

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.waiting_for_kv)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def requests(self) -> Iterable[Request]:
        yield from self.running
        yield from self.waiting
        yield from self.waiting_for_kv.values()
        yield from self.handed_off.values()

    def queued_prefill_tokens(self) -> int:
        """Tokens still to compute for requests that have not reached their first sample."""
        return sum(
            r.num_tokens - r.num_computed_tokens
            for r in list(self.waiting) + self.running
            if r.num_computed_tokens < r.num_tokens - 1
        )
