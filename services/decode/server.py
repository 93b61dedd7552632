"""Decode worker: the engine in decode role behind the DecodeWorker gRPC service.

With a KV hand-off, Decode reserves local blocks, pulls the prompt's KV from the prefill
worker (`tandem.transfer.plan_read`: only blocks it does not cache itself; NIXL READ,
contiguous runs coalesced; with tensor-parallel ranks on either side, each of this worker's
rank caches gets its KV heads from the prefill ranks holding them, `KVTransport.read`), then
confirms the lease. Only a confirmed lease proves the
blocks were pinned for the whole read; anything else (lapsed lease, dead prefill worker,
failed read) discards the copy: fail closed. The router's request says what follows: with
`report_kv_failure` the stream ends with `kv_failed` and the router prefills again on another
prefill worker (tandem.routing.recovery); without, the prompt is recomputed here. A handle whose KV
layout (dtype, block geometry) differs from this worker's cache is not a transient failure
but a misconfigured deployment: the call ends with FAILED_PRECONDITION naming the fields, before
any block is reserved or read. Without a hand-off, the prompt is prefilled here (conditional
disaggregation). A model with linear-attention layers (Qwen3-Next) keeps per-request state that
no KV page holds: its hand-off carries that state in a typed section of its own
(`tandem.transfer.sections`), read with the pages into blocks reserved for it and moved into the
request's slot at commit; with a draft model (speculative decoding) the draft's KV for the
prompt travels the same way, into this worker's draft cache (`tandem.engine.drafting`), so the
draft is never prefilled here. A hand-off without exactly the sections this worker's model needs,
each complete and of its format, is declined before anything is reserved (its lease released)
and prefilled again -- here, or elsewhere when the router asked for `report_kv_failure` --
never decoded from partial state.

A hand-off is trusted only as far as it is proven, before anything is reserved, read or
dialled: its signature (with a cluster secret, `tandem.transfer.signing`) must hold for this
call's request id and for the hashes this worker computes from the request's own tokens and
cache salt, and (with Redis) its owner must be a prefill worker the registry knows (or knew
moments ago) at that address and incarnation. Otherwise the call ends with PERMISSION_DENIED:
not a transient failure to recover around. Pulled blocks join this worker's prefix cache only
under hashes it computed itself (`LLMEngine.reserve_kv`).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import AsyncIterator
from functools import partial

import grpc

from tandem import wire
from tandem.config import EngineRole
from tandem.engine.engine import LLMEngine, RequestOutput
from tandem.engine.prefix_hash import hash_keys
from tandem.engine.request import RequestSpec, Resume
from tandem.engine.state_pages import expected_sections
from tandem.load import Load
from tandem.services.common.observe import tracing
from tandem.services.common.redis.registry import Registry, WorkerInfo, WorkerWatcher
from tandem.services.common.rpc import convert
from tandem.services.common.rpc.errors import (
    ServiceError,
    failed_precondition,
    invalid_argument,
    resource_exhausted,
    rpc,
)
from tandem.services.common.worker.engine_loop import output_batches
from tandem.services.common.worker.kv_pull import Pulled
from tandem.services.common.worker.kv_reader import KVReader, ReadDone
from tandem.services.common.worker.owner import KVOwner
from tandem.services.decode.roster import PrefillRoster
from tandem.transfer import (
    KVHandoff,
    LayoutMismatch,
    TransferError,
    check_compatible,
    plan_read,
    prompt_hashes,
    verify_handoff,
)
from tandem.transfer.plan import ReadPlan
from tandem.transfer.sections import SectionKind, SectionRefused, check_sections
from tandem.types import KVOutcome, Role
from tandem.v1 import worker_pb2 as wpb
from tandem.v1 import worker_pb2_grpc as wgrpc

log = logging.getLogger(__name__)


def handoff_tokens(spec: RequestSpec, resume: Resume) -> list[int]:
    """The tokens whose KV a hand-off to this request holds: all but its last (a prefill
    worker's: the prompt, its first token following; a draining decode worker's: the prompt
    and the output streamed so far but its last token)."""
    return list(spec.prompt_token_ids) + list(resume.output_token_ids[:-1])


def _reserve_section(engine: LLMEngine, rid: str, kind: SectionKind) -> list[int] | None:
    return engine.reserve_section(rid, kind)


def permission_denied(message: str) -> ServiceError:
    return ServiceError(grpc.StatusCode.PERMISSION_DENIED, message)


class DecodeServer(KVOwner, wgrpc.DecodeWorkerServicer):
    role = EngineRole.DECODE
    service_names = ("tandem.v1.DecodeWorker",)

    def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        self._reader = KVReader(self.transport, self.config.engine.device)
        self._channels: dict[str, grpc.aio.Channel] = {}
        self.num_recomputed = 0
        # A handle stays usable for the owner's lease (lease_ttl_s, the same flag on both
        # roles): keep departed owners known well past that.
        self._roster = PrefillRoster(retain_s=max(60.0, 2 * self.config.lease_ttl_s))
        self._watcher: WorkerWatcher | None = None
        self._watch_registry: Registry | None = None

    def add_servicers(self, server: grpc.aio.Server) -> None:
        wgrpc.add_DecodeWorkerServicer_to_server(self, server)

    def info(self, s: Load | None = None) -> WorkerInfo:
        """The registry record, saying this worker continues moved streams."""
        return dataclasses.replace(super().info(s), accepts_moved=True)

    async def start(self) -> None:
        if self.config.redis_url:
            # Before the worker is ready: the first hand-off already meets a populated view.
            self._watch_registry = Registry(self.config.redis_url, self.config.registry_ttl_s)
            self._watcher = WorkerWatcher(
                self._watch_registry, self.config.heartbeat_interval_s, self._roster.update
            )
            await self._watcher.start()
        else:
            log.warning(
                "no redis_url: KV hand-offs are not checked against registered prefill workers"
            )
        await super().start()

    async def stop(self) -> None:
        if self._watcher is not None:
            await self._watcher.stop()
        if self._watch_registry is not None:
            await self._watch_registry.close()
        for ch in self._channels.values():
            await ch.close()
        await super().stop()
        self._reader.close()

    def _owner_stub(self, handoff: KVHandoff) -> wgrpc.PrefillWorkerStub | wgrpc.DecodeWorkerStub:
        """Where a hand-off's lease is confirmed: its owner, a prefill worker or a draining
        decode worker (both serve ReleaseKv)."""
        address = handoff.owner_address
        ch = self._channels.get(address)
        if ch is None:
            from tandem.services.common.security import internal_channel

            ch = self._channels[address] = internal_channel(address, self.config.auth)
        role = self._roster.role(handoff.remote.agent_name, address, handoff.epoch)
        return wgrpc.DecodeWorkerStub(ch) if role == Role.DECODE else wgrpc.PrefillWorkerStub(ch)

    # -- RPCs ------------------------------------------------------------------------------

    @rpc
    async def Decode(
        self, request: wpb.DecodeRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[wpb.DecodeResponse]:
        spec, stream = self.admit(request, context)
        rid = spec.request_id
        num_output_tokens = 0  # generated by this call
        complete = wpb.DecodeComplete()
        with self.serving("tandem.decode", spec, context) as call:
            span = call.span
            try:
                decode = convert.decode_from_proto(request, spec)
            except convert.BadHandoff as exc:
                # Built by the prefill worker, not the client: a deployment problem.
                raise failed_precondition(f"kv.{exc}") from None
            except ValueError as exc:
                raise invalid_argument(str(exc)) from None
            handoff = decode.handoff
            # whose KV a hand-off holds: the prompt, and for a moved stream its output too
            tokens = handoff_tokens(spec, decode.resume)
            sections = None if handoff is None else self._read_sections(tokens, handoff)
            if handoff is not None and isinstance(sections, str):
                # Not every group's state is in it: never decode from part of it.
                await self._decline_kv(spec, tokens, handoff, sections, span)
                self.metrics.kv_transfer(KVOutcome.REFUSED)
                if decode.report_kv_failure:
                    failed = wpb.KvFailed(reason=sections)
                    yield wpb.DecodeResponse(request_id=rid, kv_failed=failed)
                    return
                self.num_recomputed += 1
                self.metrics.recomputed.inc()
                complete.recomputed = True
                await self.add_request(spec, decode.resume)
            elif handoff is not None and isinstance(sections, dict):
                with tracing.span(
                    "tandem.kv_transfer",
                    span,
                    error_attributes={"tandem.kv.outcome": KVOutcome.REFUSED.value},
                ) as kv_span:
                    try:
                        pulled = await self._pull_kv(
                            spec, decode.resume, tokens, handoff, sections, kv_span
                        )
                    except ServiceError:
                        self.metrics.kv_transfer(KVOutcome.REFUSED)
                        raise
                    self.metrics.kv_pulled(pulled, len(tokens))
                    tracing.kv_result(
                        kv_span, pulled, handoff.lease_id, not decode.report_kv_failure
                    )
                complete.kv_transfer_ms = pulled.transfer_ms
                complete.kv_transfer_bytes = pulled.num_bytes
                if not pulled.committed:
                    if decode.report_kv_failure:
                        # The router prefills again elsewhere; our reserved blocks are free.
                        yield wpb.DecodeResponse(
                            request_id=rid, kv_failed=wpb.KvFailed(reason=pulled.failure)
                        )
                        return
                    self.num_recomputed += 1
                    self.metrics.recomputed.inc()
                    complete.recomputed = True
                    await self.add_request(spec, decode.resume)
            else:
                await self.add_request(spec, decode.resume)
            t_joined = time.perf_counter()
            async for batch in output_batches(stream, self.config.progress_interval_s):
                if not batch:  # waiting in the queue or preempted: still alive
                    progress = convert.progress_to_proto(self.loop.progress(rid))
                    yield wpb.DecodeResponse(request_id=rid, progress=progress)
                    continue
                if num_output_tokens == 0:
                    tracing.engine_phases(
                        span,
                        "tandem.decode.queue",
                        "tandem.decode.first_step",
                        t_joined,
                        self.loop.last_step_s,
                    )
                chunk = convert.chunk_to_proto(batch)
                num_output_tokens += len(chunk.token_ids)
                if chunk.token_ids or chunk.text:
                    yield wpb.DecodeResponse(request_id=rid, chunk=chunk)
                last = batch[-1]
                if last.handed_off:  # draining: the stream moves (`drain_step`)
                    call.keep_request = True  # the lease frees the blocks
                    yield wpb.DecodeResponse(request_id=rid, moved=self._moved(spec, last, span))
                    return
                if last.finished:
                    # Prompt tokens this worker found in its own prefix cache (with pulled KV,
                    # the part it did not need to read; without, the part it did not prefill).
                    complete.num_cached_tokens = last.num_cached_tokens
                    complete.finish_reason = wire.finish_reason_to_proto(last.finish_reason)
                    complete.stop_reason = convert.stop_reason_to_proto(last.stop_reason)
                    span.set_attribute("tandem.output_tokens", num_output_tokens)
                    yield wpb.DecodeResponse(request_id=rid, complete=complete)

    def _moved(self, spec: RequestSpec, out: RequestOutput, span: tracing.Span) -> wpb.KvMoved:
        """The hand-off of a stream this draining worker stopped: its pinned blocks, leased
        and signed for another decode worker to continue from."""
        request = self.engine.get_request(spec.request_id)
        assert request is not None  # handed off: the engine holds it until released
        tokens = request.all_token_ids[: request.num_computed_tokens]
        return wpb.KvMoved(kv=self.hand_off(spec, tokens, out.block_ids, (), span))

    async def drain_step(self) -> int:
        """While another decode worker is live, the streams decoding here move to it (their KV
        handed off, `DecodeResponse.moved`; the router re-places them); without one they
        finish here within drain_timeout_s."""
        if self._roster.live_decode_workers(exclude=self.worker_id):
            running = await self.loop.call(lambda e: [r.request_id for r in e.scheduler.running])
            for rid in running:
                if self.loop.has_stream(rid):  # a Decode call open here
                    await self.loop.hand_off(rid)
        return await super().drain_step()

    async def _pull_kv(
        self,
        spec: RequestSpec,
        resume: Resume,
        tokens: list[int],
        handoff: KVHandoff,
        sections: dict[SectionKind, range],
        span: tracing.Span = tracing.INVALID_SPAN,
    ) -> Pulled:
        """Check the handle, reserve, read, confirm; `sections`: which of its blocks are the
        pages and which the state (`_read_sections`). Raises ServiceError when the request
        cannot be served here (invalid, no free blocks within kv_wait_s, a KV layout that
        differs from this worker's, or a handle that is not proven genuine for this request:
        PERMISSION_DENIED)."""
        rid, prompt = spec.request_id, tokens
        tp = self.engine.config.tensor_parallel_size
        if tp > 1 and not self.engine.rank_kv:  # its ranks' caches are not mapped here (CUDA)
            raise failed_precondition(
                f"decode worker {self.worker_id!r} has {tp} tensor-parallel ranks on "
                f"{self.engine.config.device}: hand-offs into them are built on a CPU only; "
                "routers place its requests without one"
            )
        try:
            # Pure and cheap: before reserving, so a misconfigured pair holds no block here.
            # First, so that a pair with different block sizes (which also sign different
            # hashes) is told what differs.
            check_compatible(handoff.remote.layout, self.transport.layout)
        except LayoutMismatch as exc:
            raise self._layout_error(handoff, exc) from None
        self._check_signature(spec, tokens, handoff)
        await self._check_owner(handoff)
        try:
            reserved = await self.loop.call_until(
                lambda e: e.reserve_kv(spec, resume),
                self.config.kv_wait_s,
            )
        except ValueError as exc:
            raise invalid_argument(str(exc)) from None
        if reserved is None:
            raise resource_exhausted(
                f"no free KV blocks for a {len(prompt)}-token prompt after "
                f"{self.config.kv_wait_s:.0f}s"
            )
        table, num_cached = reserved
        done = ReadDone(0, 0.0)
        num_tokens = 0
        ids = handoff.remote.block_ids
        # each section after the pages (a linear state, a draft model's KV): blocks to read
        # it into, after the reserved pages
        extra: list[tuple[range, list[int]]] = []
        for kind in (SectionKind.LINEAR_STATE, SectionKind.DRAFT_KV):
            if kind in sections:
                into = await self.loop.call(partial(_reserve_section, rid=rid, kind=kind))
                if into is None:
                    await self.loop.call(lambda e: e.abort(rid))
                    raise resource_exhausted(f"no free KV blocks for the hand-off's {kind}")
                extra.append((sections[kind], into))
        try:
            kv = self.engine.kv
            plan = plan_read(
                [ids[i] for i in sections[SectionKind.ATTENTION]],
                handoff.block_size,
                table,
                num_cached,
                len(prompt),
                kv.block_size,
                kv.handoff_live(len(prompt)) if kv.num_tables > 1 else None,
            )
            num_tokens = len(plan.remote_block_ids) * handoff.block_size
            for remote, into in extra:  # read with the pages
                plan = ReadPlan(
                    plan.remote_block_ids + tuple(ids[i] for i in remote),
                    plan.local_block_ids + tuple(into),
                )
            tracing.kv_plan(span, plan.remote_block_ids, plan.local_block_ids)
            done = await self._reader.read(handoff.remote, plan, handoff.lease_id.encode())
            resp = await self._owner_stub(handoff).ReleaseKv(
                wpb.ReleaseKvRequest(
                    request_id=rid, lease_id=handoff.lease_id, epoch=handoff.epoch
                ),
                timeout=5.0,
                metadata=tracing.headers(span),
            )
            valid = resp.valid
        except LayoutMismatch as exc:
            # The transport's own check (after ours above): free the reserved blocks unread.
            await self.loop.call(lambda e: e.abort(rid))
            raise self._layout_error(handoff, exc) from None
        except TransferError as exc:
            failure = f"KV read from {handoff.remote.agent_name} failed: {exc}"
            valid = False
            outcome = KVOutcome.FAILED
            span.set_attribute("tandem.kv.outcome", outcome.value)
        except grpc.aio.AioRpcError as exc:
            failure = f"lease confirm at {handoff.owner_address} failed: {exc.code().name}"
            valid = False
            outcome = KVOutcome.FAILED
            span.set_attribute("tandem.kv.outcome", outcome.value)
        else:
            failure = "" if valid else f"lease {handoff.lease_id} lapsed before confirm"
            outcome = KVOutcome.COMMITTED if valid else KVOutcome.LAPSED
            span.set_attribute("tandem.kv.outcome", outcome.value)
        if not valid:
            log.warning("KV pull for %s not usable (%s)", rid, failure)
            await self.loop.call(lambda e: e.abort(rid))  # drop the reserved blocks unread
        else:
            await self.loop.call(lambda e: e.commit_kv(rid))
        return Pulled(
            valid, num_cached, done.num_bytes, done.seconds * 1e3, failure, outcome, num_tokens
        )

    def _read_sections(
        self, tokens: list[int], handoff: KVHandoff
    ) -> dict[SectionKind, range] | str:
        """Each of the hand-off's sections' blocks (`check_sections`), or why this worker
        cannot resume from them."""
        kv, draft = self.engine.kv, self.engine.draft_handoff
        num_tokens = len(tokens)
        draft_section = None if draft is None else (draft.format, draft.num_bytes(num_tokens))
        try:
            return check_sections(
                handoff.sections,
                expected_sections(
                    self.engine.pages_format,
                    self.engine.state_handoff,
                    draft_section,
                ),
                len(handoff.remote.block_ids),
                sum(map(len, kv.handoff_live(num_tokens))),
                self.transport.layout.block_bytes,
                needs_sections=kv.num_tables > 1,
            )
        except SectionRefused as exc:
            return f"KV hand-off refused: {exc}"

    async def _decline_kv(
        self,
        spec: RequestSpec,
        tokens: list[int],
        handoff: KVHandoff,
        reason: str,
        span: tracing.Span = tracing.INVALID_SPAN,
    ) -> None:
        """A hand-off this worker will not read: once the handle is proven (signature,
        owner), its lease is released at the owner so the prefill worker frees the blocks now
        rather than when the lease lapses. A failed release is logged, not raised: the lease
        lapses anyway."""
        self._check_signature(spec, tokens, handoff)
        await self._check_owner(handoff)
        try:
            await self._owner_stub(handoff).ReleaseKv(
                wpb.ReleaseKvRequest(
                    request_id=spec.request_id, lease_id=handoff.lease_id, epoch=handoff.epoch
                ),
                timeout=5.0,
                metadata=tracing.headers(span),
            )
        except grpc.aio.AioRpcError as exc:
            log.warning("releasing the declined KV of %s failed: %s", spec.request_id, exc)
        log.warning("%s: %s declined, its prompt prefilled again", reason, spec.request_id)

    def _check_signature(self, spec: RequestSpec, tokens: list[int], handoff: KVHandoff) -> None:
        """The owner signed this handle for this request id and for the hashes this worker
        computes from the request's own tokens (`handoff_tokens`) and salt. Raises
        PERMISSION_DENIED."""
        if self._handoff_key is None:
            return  # no cluster secret: unsigned hand-offs (warned at start)
        keys = hash_keys(self.engine.model_id, spec.cache_salt, self.engine.kv_hash_format)
        hashes = prompt_hashes(tokens, self.engine.kv.block_size, keys)
        if not verify_handoff(self._handoff_key, spec.request_id, hashes, handoff):
            what = "missing" if not handoff.signature else "does not match"
            log.warning(
                "KV hand-off for %r from %r refused: signature %s",
                spec.request_id, handoff.remote.agent_name, what,
            )  # fmt: skip
            raise permission_denied(
                f"KV hand-off signature invalid ({what} for request {spec.request_id!r} and "
                f"its prompt): the handle was altered, meant for another request, or signed "
                f"with another cluster secret"
            )

    async def _check_owner(self, handoff: KVHandoff) -> None:
        """The handle's owner is a prefill worker the registry knows, at that address and
        incarnation, before anything dials it. Raises PERMISSION_DENIED."""
        if self._watcher is None:
            return  # no Redis: static test setups (warned at start)
        owner = (handoff.remote.agent_name, handoff.owner_address, handoff.epoch)
        if self._roster.knows(*owner):
            return
        await self._watcher.refresh()  # it may have joined since the last poll
        if self._roster.knows(*owner):
            return
        log.warning("KV hand-off refused: owner %r at %r (epoch %d) is not registered", *owner)
        raise permission_denied(
            f"KV hand-off owner {handoff.remote.agent_name!r} at {handoff.owner_address!r} "
            f"(epoch {handoff.epoch}) is not a registered prefill worker"
        )

    def _layout_error(self, handoff: KVHandoff, exc: LayoutMismatch) -> ServiceError:
        log.error("KV hand-off from %s refused: %s", handoff.remote.agent_name, exc)
        return failed_precondition(
            f"{exc} (prefill worker {handoff.remote.agent_name!r}, decode worker "
            f"{self.worker_id!r}): run both with the same model and dtype"
        )
