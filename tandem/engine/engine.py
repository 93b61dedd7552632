"""The engine: tokenizer + model + KV cache + scheduler + sampler, stepped by the caller.

One engine serves one role (`EngineConfig.role`):
  full     add_request(spec) ... step() until finished
  prefill  add_request() runs to the first token, then the request is HANDED_OFF with its
           blocks pinned; `block_table()` names them; `release()` frees them.
  decode   reserve_kv(spec, resume) allocates blocks for an externally computed prompt; the caller
           fills them (`kv_cache`), then commit_kv() joins the request to the batch.
Any role also serves plain full requests (conditional disaggregation sends short prompts
straight to decode).
"""

from __future__ import annotations

import logging
import os
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from tandem.config import EngineConfig, EngineRole
from tandem.engine.block_pool import KVEvent
from tandem.engine.device import use_device
from tandem.engine.drafting import DraftHandoff, load_draft
from tandem.engine.grammar import GrammarCompiler
from tandem.engine.kv_cache import shared_kv_dir
from tandem.engine.kv_manager import KVCacheManager
from tandem.engine.loading import (
    check_tensor_parallel,
    load_model_and_cache,
    shard_for,
    wants_decode_graphs,
)
from tandem.engine.outputs import Completion, RequestOutput, generate
from tandem.engine.prefix_hash import DISK_TIER, HOST_TIER
from tandem.engine.ranks import Followers, exit_on_rank_death, free_address, threads_per_rank
from tandem.engine.request import Request, RequestSpec, RequestStatus, Resume, check_prompt
from tandem.engine.runner import ModelRunner
from tandem.engine.sampling import LogprobEntry, Sampler, SamplingParams, advance_generator
from tandem.engine.scheduler import Scheduler
from tandem.engine.spec_states import StateRollback
from tandem.engine.state_checkpoints import StateCheckpoints
from tandem.engine.state_pages import StateHandoff, pages_format
from tandem.engine.texts import RequestTexts
from tandem.engine.tiering import make_tiers
from tandem.engine.warmup import WARMUP_REQUEST_ID, warm_up
from tandem.load import Load
from tandem.model.config import ModelConfig
from tandem.parallel.group import TPGroup
from tandem.quant.kv import KVScales
from tandem.speculative.speculator import make_speculator
from tandem.speculative.stats import SpecStats
from tandem.tiers.stats import TierStats
from tandem.tokenizer.tokenizer import Tokenizer
from tandem.transfer.sections import SectionKind
from tandem.weights.loader import ProgressFn

# RequestOutput and Completion live in tandem.engine.outputs and are named here too (what a
# step and generate() return); wants_decode_graphs for tests (tandem.engine.loading)
__all__ = ["WARMUP_REQUEST_ID", "Completion", "LLMEngine", "RequestOutput", "wants_decode_graphs"]

log = logging.getLogger(__name__)


class LLMEngine:
    def __init__(
        self,
        config: EngineConfig,
        clock: Callable[[], float] = time.monotonic,
        progress: ProgressFn | None = None,
        on_rank_exit: Callable[[int, int | None], None] = exit_on_rank_death,
    ) -> None:
        """`on_rank_exit(rank, status)`: a tensor-parallel rank's process ended (from a
        watcher thread); the default ends this process too (tandem.engine.ranks)."""
        self.config = config
        self.clock = clock
        use_device(config.device)  # before the first CUDA allocation or kernel
        if config.num_threads is not None or config.tensor_parallel_size > 1:
            torch.set_num_threads(threads_per_rank(config))
        model_dir = Path(config.model_dir)
        self.model_id = config.model_id or model_dir.name
        sched_cfg = config.scheduler
        # Tensor parallelism: ranks 1..N-1 are processes of our own (tandem.engine.ranks),
        # started first so that they load their shards while this rank loads its own.
        self.followers: Followers | None = None
        self.tp: TPGroup | None = None
        kv_share = ""
        if config.tensor_parallel_size > 1:
            # Refused here, not by N ranks failing at once.
            check_tensor_parallel(ModelConfig.from_dir(model_dir), config)
            address = free_address()
            if torch.device(config.device).type == "cpu":
                # The ranks' caches in shared files rank 0 maps: its transport hands off
                # every rank's heads (tandem.engine.loading, tandem.transfer).
                kv_share = os.path.join(shared_kv_dir(), f"tandem-kv-{uuid.uuid4().hex}")
            self.followers = Followers(config, address, on_rank_exit, kv_share)
        try:
            if self.followers is not None:
                shard = shard_for(config, 0)
                self.tp = TPGroup.init(shard, address, config.device, config.tp_shared_memory)
            # a draft model and its cache first: on a GPU the target's cache is sized after
            draft = load_draft(config) if config.speculative.method == "draft" else None
            loaded = load_model_and_cache(config, self.tp, progress, kv_share)
        except BaseException:
            self.close()
            raise
        self.model = loaded.model  # this rank's shard: its config holds its heads
        self.weight_bytes = self.model.weights.num_bytes()  # quantized matrices as stored
        mcfg = self.model.config
        self.tokenizer: Tokenizer | None = (
            Tokenizer.from_dir(model_dir) if (model_dir / "tokenizer.json").is_file() else None
        )
        eos = set(mcfg.eos_token_ids)
        if self.tokenizer is not None:
            eos.update(self.tokenizer.eos_token_ids)
        self.eos_token_ids = tuple(sorted(eos))
        # Constrained decoding: grammars compiled on this (the engine's) thread, once each.
        self.grammars: GrammarCompiler | None = None
        if self.tokenizer is not None and self.eos_token_ids:
            self.grammars = GrammarCompiler(
                (model_dir / "tokenizer.json").read_text(), mcfg.vocab_size, self.eos_token_ids
            )
        self.kv_scales: KVScales | None = loaded.kv_scales
        # What the registry advertises and, for a scaled cache, what the prefix hashes add.
        self.kv_format = loaded.kv_format
        self.kv_hash_format = self.kv_format if self.kv_scales is not None else ""
        self.pages_format = pages_format(self.kv_format, mcfg.kv_layout)  # a hand-off's pages
        block_size = config.cache.block_size
        self.num_blocks = loaded.num_blocks
        self.max_model_len = loaded.max_model_len
        self._graphs_wanted = loaded.graphs_wanted
        self.kv_cache = loaded.kv_cache
        # Every rank's cache and its first KV head, mapped here (a tensor-parallel worker on
        # a CPU); empty otherwise: then only a single-rank engine's cache can be handed off.
        self.rank_kv = loaded.rank_kv
        # A linear-attention model's (Qwen3-Next) state is not in the KV cache: a cached
        # prefix resumes it from a state checkpoint (tandem.engine.state_checkpoints).
        caching, ckpts = config.cache.enable_prefix_caching, self.model.linear_checkpoints
        checkpoints = StateCheckpoints(ckpts.num_slots) if caching and ckpts else None
        self.kv = KVCacheManager(self.num_blocks, block_size, caching, False,
                                 mcfg.layer_groups, checkpoints, mcfg.kv_layout)  # fmt: skip
        self.scheduler = Scheduler(
            sched_cfg, self.kv, self.max_model_len, self.model_id, self.kv_hash_format
        )
        linear = self.model.linear_states is not None
        draft_cost = draft.model.weights.num_bytes() / self.weight_bytes if draft else 0.0
        self.speculator = make_speculator(config.speculative, self.max_model_len, linear,
                                          config.device, config.tensor_parallel_size,
                                          draft, draft_cost)  # fmt: skip
        self.scheduler.speculator = self.speculator
        # a draft model's KV travels in a hand-off's draft_kv section (tandem.engine.drafting)
        self.draft_handoff = DraftHandoff(self.kv, self.kv_cache, draft) if draft else None
        self.draft_format = draft.format if draft else ""  # what the registry advertises
        self.scheduler.recompute_rejected = linear and self.speculator is not None
        # Sampling noise is drawn on the logits' device, so the generators live there too.
        sampler = Sampler(torch.Generator(device=config.device).manual_seed(config.seed))
        self.runner = ModelRunner(
            self.model, self.kv_cache, block_size, sampler, self.max_model_len, self.followers,
            self.kv,
        )  # fmt: skip
        # a linear-attention model's state travels in a hand-off's blocks (state_pages), and
        # is put back past a rejected draft token (spec_states)
        states = self.model.linear_states
        if states is not None and self.scheduler.recompute_rejected:
            self.runner.rollback = StateRollback(states, self.runner)
        self.state_handoff = StateHandoff(self.kv, self.runner, states) if states else None
        # KV tiers behind the prefix cache (tandem.tiers), when the cache config asks
        caches = self.rank_kv or ((self.kv_cache, 0),)
        self.tiers = make_tiers(config, self.kv, self.scheduler, caches, self.model_id,
                                self.kv_format, model_dir)  # fmt: skip
        self._requests: dict[str, Request] = {}
        self._texts = RequestTexts(self.tokenizer)
        self.num_steps = 0
        self.num_tokens_computed = 0  # prompt + generated tokens run through the model
        self.last_step_prefill_tokens = 0  # prompt tokens (prefill chunks) of the last step
        self.warmup_prefill_tokens_per_s = 0.0  # measured by warm_up()

    def warm_up(self) -> None:
        """Run the steps, compilations and captures the first requests would otherwise pay
        for (tandem.engine.warmup); leaves no trace. Makes the engine's device current in
        the calling thread, which should be the one that steps the engine."""
        warm_up(self)

    # -- requests --------------------------------------------------------------------------

    def tokenize(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise ValueError(f"model {self.model_id} has no tokenizer.json; send token ids")
        return self.tokenizer.encode(text)

    def spec(
        self,
        request_id: str,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        cache_salt: str = "",
    ) -> RequestSpec:
        """A `RequestSpec` for offline use: a text prompt is tokenized here."""
        ids = (self.tokenize(prompt) if prompt else []) if isinstance(prompt, str) else prompt
        return RequestSpec(
            request_id, tuple(ids), params or SamplingParams(), cache_salt=cache_salt
        )

    def make_request(self, spec: RequestSpec, resume: Resume | None = None) -> Request:
        """Validate and build a request (not yet queued). `spec.cache_salt` joins the model
        id in its block hashes (`prefix_hash.hash_keys`): only requests with the same salt
        share cached blocks. `resume`: it continues tokens generated elsewhere.

        Raises:
            ValueError: empty or over-long prompt, token ids outside the vocabulary, a
                duplicate request id, stop strings without a tokenizer, a request that
                could never fit the KV cache, a constraint that does not compile or that
                the resumed tokens break.
        """
        params, outputs = spec.params, resume.output_token_ids if resume else ()
        if spec.request_id in self._requests:
            raise ValueError(f"request_id {spec.request_id!r} is already in use")
        vocab = self.model.config.vocab_size
        check_prompt(spec.prompt_token_ids, vocab, self.max_model_len, outputs)
        params.validate_for_vocab(vocab)
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer; this model has none")
        # Any request fits the cache alone: startup capped max_model_len to the cache
        # (memory.fit_context), and generation stops at max_model_len.
        assert self.max_model_len <= self.num_blocks * self.kv.block_size
        request = Request(
            request_id=spec.request_id,
            prompt_token_ids=list(spec.prompt_token_ids),
            sampling_params=params,
            eos_token_ids=self.eos_token_ids,
            arrival_time=self.clock(),
            hand_off=self.config.role == EngineRole.PREFILL and not outputs,
            output_token_ids=list(outputs),
            cache_salt=spec.cache_salt,
            device=self.config.device,
        )
        if params.constraint is not None:
            if self.grammars is None:
                raise ValueError("constraint: needs a tokenizer and EOS token; the model lacks one")
            # Compiled here, on the engine thread (a cache hit after the first time), and
            # resumed past the tokens generated elsewhere: a decode worker after a hand-off
            # or a migration continues the grammar exactly where the other worker left it.
            request.matcher = self.grammars.matcher(params.constraint)
            request.matcher.replay(outputs)
        if outputs and request.generator is not None and not params.greedy:
            # Continue the seeded stream where the worker that sampled those tokens left it.
            advance_generator(request.generator, vocab, len(outputs))
        return request

    def add_request(self, spec: RequestSpec, resume: Resume | None = None) -> Request:
        """Queue a request. Raises ValueError on bad input (see make_request).

        `resume`: tokens already generated elsewhere (a decode worker that recomputes a
        handed-off prompt, or continues a migrated stream); generation continues after them.
        """
        request = self.make_request(spec, resume)
        self._track(request, resume)
        if self.tiers is not None:  # a prefix a lower tier holds is brought back first
            self.scheduler.hash_request(request)
            if self.tiers.park(request):
                return request
        self.scheduler.add_request(request)
        return request

    def _track(self, request: Request, resume: Resume | None) -> None:
        self._requests[request.request_id] = request
        self._texts.track(request, resume.num_emitted_chars if resume else None)

    def abort(self, request_id: str) -> bool:
        """Stop a request wherever it is and free its blocks. False if unknown."""
        request = self.scheduler.finish(request_id, RequestStatus.FINISHED_ABORTED, self.clock())
        if request is None and self.tiers is not None:
            request = self.tiers.abort(request_id)  # waiting for its blocks from a tier
        self._forget(request_id)
        return request is not None

    def _forget(self, request_id: str) -> None:
        if self.speculator is not None:
            self.speculator.finish(request_id)
        for handoff in (self.state_handoff, self.draft_handoff):
            if handoff is not None:
                handoff.forget(request_id)
        self.runner.release(request_id)
        self._requests.pop(request_id, None)
        self._texts.forget(request_id)

    # -- disaggregation hooks --------------------------------------------------------------

    def block_table(self, request_id: str) -> list[int]:
        """Blocks holding a request's KV, in token order (its tables interleaved)."""
        return list(self.kv.get_block_ids(request_id))

    def release(self, request_id: str) -> bool:
        """Prefill role: the decode side has the KV; free the pinned blocks."""
        request = self.scheduler.finish(request_id, RequestStatus.FINISHED_STOPPED, self.clock())
        self._forget(request_id)
        return request is not None

    def reserve_kv(self, spec: RequestSpec, resume: Resume) -> tuple[list[int], int] | None:
        """Decode role: blocks for KV computed elsewhere, of every token but the last: the
        prompt after a prefill worker's hand-off (`resume`: its first token), the prompt and
        output after a draining decode worker's. They join this engine's prefix cache (at
        commit_kv) under hashes computed here from the tokens and `spec.cache_salt`.

        Returns (block table, tokens already cached here: fill KV from there on) or None
        when the cache is full right now.
        """
        if not resume.output_token_ids:
            raise ValueError("output_token_ids must hold the prefill worker's first token")
        request = self.make_request(spec, resume)
        reserved = self.scheduler.reserve_kv(request)
        if reserved is not None:
            self._track(request, resume)
        return reserved

    def commit_kv(self, request_id: str) -> None:
        """Decode role: the prompt's KV (and a linear-attention state, read into the blocks
        `state_handoff.reserve` gave) is in place; the request joins the batch."""
        request = self._requests.get(request_id)
        if self.state_handoff is not None and request is not None:
            self.state_handoff.unpack(request_id, request.num_prompt_tokens)
        if self.draft_handoff is not None and request is not None:
            self.draft_handoff.unpack(request_id, request.prompt_token_ids)
        self.scheduler.commit_kv(request_id)

    def reserve_section(self, request_id: str, kind: SectionKind) -> list[int] | None:
        """Decode role: blocks after the reserved pages to read a hand-off's `kind` section
        into (a linear state, a draft model's KV); None when too few are free."""
        if kind is SectionKind.DRAFT_KV and self.draft_handoff is not None:
            num_prompt = self._requests[request_id].num_prompt_tokens
            return self.draft_handoff.reserve(request_id, num_prompt)
        assert kind is SectionKind.LINEAR_STATE and self.state_handoff is not None, kind
        return self.state_handoff.reserve(request_id)

    # -- stepping --------------------------------------------------------------------------

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or bool(self.tiers and self.tiers.num_parked)

    def step(self) -> list[RequestOutput]:
        """Schedule, run the model once, sample, and report each request's progress."""
        if self.tiers is not None:
            if self.tiers.num_parked and not self.scheduler.has_work():
                self.tiers.wait(0.005)  # nothing else to run: the tier's read is next
            for request in self.tiers.ready():
                self.scheduler.add_request(request)
        out = self.scheduler.schedule()
        self.last_step_prefill_tokens = sum(s.num_prefill_tokens for s in out.scheduled)
        if out.is_empty:
            return []
        samples = self.runner.execute(out)
        now = self.clock()
        self.num_steps += 1
        self.num_tokens_computed += out.num_batched_tokens
        outputs = []
        for ev in self.scheduler.update(out, samples, now):
            request = ev.request
            rid = request.request_id
            new_ids, text = self._detokenize(request, ev.new_token_ids, now)
            lps = request.logprobs[-len(new_ids) :] if new_ids and request.logprobs else []
            if request.status == RequestStatus.HANDED_OFF:
                outputs.append(self._handed_off(request, new_ids, text, lps))
                continue
            finished = request.status.finished
            outputs.append(
                RequestOutput(
                    request_id=rid,
                    new_token_ids=new_ids,
                    new_text=text,
                    finished=finished,
                    finish_reason=request.finish_reason,
                    stop_reason=request.stop_reason,
                    num_cached_tokens=request.num_cached_tokens or 0,
                    logprobs=lps,
                )
            )
            if finished:
                self._forget(rid)
        return outputs

    def _handed_off(
        self, request: Request, new_ids: list[int], text: str, lps: list[LogprobEntry]
    ) -> RequestOutput:
        """A handed-off request's output: its pinned blocks (each KV table's the next token
        reads), then a linear-attention state's and a draft model's, packed now."""
        rid, prompt = request.request_id, request.prompt_token_ids
        packed = self.state_handoff.pack(rid) if self.state_handoff else 0
        drafted = self.draft_handoff.pack(rid, prompt) if self.draft_handoff else 0
        return RequestOutput(
            request_id=rid, new_token_ids=new_ids, new_text=text, finished=False,
            finish_reason=None, handed_off=True, num_cached_tokens=request.num_cached_tokens or 0,
            state_blocks=packed, draft_blocks=drafted, logprobs=lps,
            block_ids=self.kv.handoff_blocks(rid, request.num_computed_tokens),
        )  # fmt: skip

    def hand_off_running(self, request_id: str) -> RequestOutput | None:
        """Decode role, draining: a decoding request stops with its KV pinned, handed off for
        another decode worker to continue (`release` frees it). None: not decoding now, or its
        engine keeps state such a hand-off lacks (a linear state, a draft model's KV)."""
        if self.state_handoff is not None or self.draft_handoff is not None:
            return None
        request = self.scheduler.hand_off_running(request_id)
        return None if request is None else self._handed_off(request, [], "", [])

    def _detokenize(
        self, request: Request, new_ids: list[int], now: float
    ) -> tuple[list[int], str]:
        """The new tokens that stand and their text delta; a stop string ends the request
        at the token that completes it."""
        new_ids, text, stop = self._texts.add(request, new_ids)
        if stop is not None:
            request.stop_reason = stop
            if request.status.finished:
                request.status = RequestStatus.FINISHED_STOPPED  # the stop came first
            else:
                self.scheduler.finish(request.request_id, RequestStatus.FINISHED_STOPPED, now)
        return new_ids, text

    def generate(
        self, prompts: Sequence[str | Sequence[int]], params: SamplingParams | None = None
    ) -> list[Completion]:
        """Run prompts to completion (offline use). Output order follows `prompts`."""
        return generate(self, prompts, params)

    def close(self) -> None:
        """Stop the other ranks of a tensor-parallel engine (nothing at one rank). The engine
        runs no step afterwards."""
        if self.followers is not None:
            self.followers.close()
            self.followers = None
        tiers, self.tiers = getattr(self, "tiers", None), None
        if tiers is not None:
            tiers.close()
        if self.tp is not None:
            self.tp.close()
            self.tp = None

    # -- introspection ---------------------------------------------------------------------

    def check_integrity(self) -> None:
        self.kv.check_integrity()
        held = set(self.kv.block_tables)
        live = {r.request_id for r in self.scheduler.requests()}
        assert held <= live, f"blocks held by finished requests: {sorted(held - live)}"
        tables = self.runner.block_tables
        rows = set() if tables is None else tables.request_ids()
        assert rows <= live, f"block table rows held by finished requests: {sorted(rows - live)}"

    def num_free_blocks(self) -> int:
        return self.kv.num_free_blocks

    def enable_kv_events(self) -> None:
        """Record prefix-cache events for `take_kv_events` (with tiers, their marks too)."""
        self.kv.enable_events()
        if self.tiers is not None:
            self.tiers.enable_events(self.kv.cached_hashes())

    def take_kv_events(self) -> list[KVEvent]:
        events = self.kv.take_events()
        return events if self.tiers is None else self.tiers.events(events)

    def cached_block_hashes(self) -> list[int]:
        hashes = self.kv.cached_hashes()
        return hashes if self.tiers is None else hashes + self.tiers.mark_hashes(hashes)

    def tier_stats(self) -> list[TierStats]:
        """Each KV tier's figures (tandem.tiers.stats); empty without tiers."""
        return [] if self.tiers is None else self.tiers.stats()

    def spec_stats(self) -> list[SpecStats]:
        """Each speculative proposer's counts (tandem.speculative.stats); empty if off."""
        return [] if self.speculator is None else [self.speculator.stats()]

    def stats(self) -> Load:
        """The counts of this engine's load (its rates are the worker's to add)."""
        sched, tiers = self.scheduler, self.tiers
        parked = tiers.num_parked if tiers else 0
        return Load(
            num_running=len(sched.running),
            num_waiting=len(sched.waiting) + len(sched.waiting_for_kv) + parked,
            num_handed_off=len(sched.handed_off),
            queued_prefill_tokens=sched.queued_prefill_tokens(),
            num_blocks=self.num_blocks,
            num_free_blocks=self.kv.num_free_blocks,
            num_preemptions=sched.num_preemptions,
            host_onload_tokens_per_s=tiers.onload_tokens_per_s(HOST_TIER) if tiers else 0.0,
            disk_onload_tokens_per_s=tiers.onload_tokens_per_s(DISK_TIER) if tiers else 0.0,
            **(tiers.load_counts() if tiers else {}),
        )

    def get_request(self, request_id: str) -> Request | None:
        return self._requests.get(request_id)

    def has_request(self, request_id: str) -> bool:
        """Does the engine hold the request (queued, running, handed off, awaiting KV)?
        One dict lookup: safe to ask from another thread, as a hint."""
        return request_id in self._requests
