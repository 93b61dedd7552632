"""One Generate call's trip through the workers, and its recovery when a worker fails it.

    prefill hop (when placed on a prefill worker) -> token 1 to the client, a KV handle
    decode hop (pulls the KV, or prefills itself)  -> the rest of the tokens, complete

A worker fault in either hop (the worker died: UNAVAILABLE; froze: keepalive ends the call;
stalled past hop_timeout_s; a pulled hand-off unusable: `kv_failed`) is recorded against
the worker (circuit breaker), and `tandem.routing.recovery.plan_recovery` picks the next step:
prefill again elsewhere, recompute on the decode worker, migrate to another decode worker
with the tokens already streamed, or fail with UNAVAILABLE once the budget is spent. Each
step gets fresh worker-side request ids, so leftovers of the failed attempt (aborted in the
background) can never meet the new one. The client sees a delay, never a repeated token.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc

from tandem import wire
from tandem.routing import Placement, WorkerLoad
from tandem.routing.recovery import (
    HOLD_POLL_S,
    Action,
    Failure,
    Fault,
    RecoveryConfig,
    ejection_reason,
    last_of_role,
    plan_recovery,
    worker_fault,
)
from tandem.routing.stall import StallWatch
from tandem.services.common.observe import tracing
from tandem.services.common.observe.metrics import RouterMetrics
from tandem.services.common.rpc import convert, errors
from tandem.services.router.call import Call, CallContext, worker_request_id
from tandem.services.router.links import Links
from tandem.services.router.placer import Placer
from tandem.services.router.replies import Replies
from tandem.transfer import KVHandoff
from tandem.v1 import router_pb2 as rpb
from tandem.v1 import worker_pb2 as wpb
from tandem.v1 import worker_pb2_grpc as wgrpc

log = logging.getLogger(__name__)


class HopFailed(Exception):
    """A worker failed the current hop; recovery decides what follows."""

    def __init__(
        self,
        fault: Fault,
        worker_id: str,
        why: str,
        breaker: bool = True,
        unreachable: bool = False,
        stalled: bool = False,
    ) -> None:
        super().__init__(f"{fault.value} on {worker_id}: {why}")
        self.fault = fault
        self.worker_id = worker_id
        self.why = why
        self.breaker = breaker  # counts against the worker's circuit breaker
        self.unreachable = unreachable  # the connection itself failed (UNAVAILABLE)
        self.stalled = stalled  # no progress for hop_timeout_s (alive, maybe hung)


class Hops:
    """Runs calls through the workers, over `links` (channels, and aborts of failed
    attempts), answering the client with `replies`."""

    def __init__(
        self,
        placer: Placer,
        links: Links,
        replies: Replies,
        hop_timeout_s: float,
        recovery: RecoveryConfig,
        min_reprefill_tokens: int,
        metrics: RouterMetrics | None = None,
    ) -> None:
        self.placer = placer
        self.links = links
        self.replies = replies
        self.metrics = metrics or RouterMetrics()
        self.hop_timeout_s = hop_timeout_s
        self.recovery = recovery
        self.min_reprefill_tokens = min_reprefill_tokens

    async def run(self, call: Call, context: CallContext) -> AsyncIterator[rpb.GenerateResponse]:
        """The client's messages. Raises ServiceError when the request cannot finish."""
        while True:
            try:
                if call.placement.prefill is not None and call.kv is None:
                    async for msg in self._prefill(call, context):
                        yield msg
                    if call.finished:
                        return
                async for msg in self._decode(call, context):
                    yield msg
                return
            except HopFailed as failed:
                await self._recover(call, failed)

    # -- hops ------------------------------------------------------------------------------

    async def _prefill(
        self, call: Call, context: CallContext
    ) -> AsyncIterator[rpb.GenerateResponse]:
        worker = call.placement.prefill
        assert worker is not None
        request = convert.prefill_request_to_proto(
            dataclasses.replace(call.spec, request_id=call.worker_rid),
            call.placement.decode.worker_id,
        )
        stub = wgrpc.PrefillWorkerStub(self.links.channel(worker.address))
        call.worker_call = stream = stub.Prefill(
            request, timeout=context.time_remaining(), metadata=tracing.headers(call.span)
        )
        try:
            resp: wpb.PrefillResponse | None = None
            async for event in self._events(call, stream, Fault.PREFILL_FAILED, worker):
                if event.WhichOneof("kind") == "result":
                    resp = event.result
                    break
            if resp is None:
                why = "stream ended without a result"
                raise HopFailed(Fault.PREFILL_FAILED, worker.worker_id, why)
        finally:
            call.dispatch.prefill_done()
        self.placer.worker_ok(worker.worker_id)
        if call.outputs:
            # A second prefill (the first hand-off failed): token 1 is out already, only the
            # KV is wanted. Without a hand-off (finished at its own token 1, possible when
            # sampling), the decode worker prefills.
            if resp.finished or not resp.HasField("kv"):
                self.links.abort(call.worker_rid, call.placement)
                call.placement = dataclasses.replace(call.placement, prefill=None)
            else:
                call.kv = _handoff(resp)
            return
        call.timings.first_token_ms = call.elapsed_ms()
        call.cached_prompt_tokens = resp.num_cached_tokens
        chunk = rpb.Chunk(token_ids=[resp.first_token_id], text=resp.text, logprobs=resp.logprobs)
        self._streamed(call, chunk)
        yield self.replies.chunk(call, chunk)
        if resp.finished:
            reason = wire.finish_reason_from_proto(resp.finish_reason)
            yield self.replies.complete(call, reason, resp.stop_reason)
            return
        call.kv = _handoff(resp)

    async def _decode(
        self, call: Call, context: CallContext
    ) -> AsyncIterator[rpb.GenerateResponse]:
        worker = call.placement.decode
        request = convert.decode_request_to_proto(
            convert.DecodeInput(
                dataclasses.replace(call.spec, request_id=call.worker_rid),
                tuple(call.outputs),
                call.emitted_chars,
                call.kv,
                report_kv_failure=(
                    self.recovery.reprefill and call.recoveries < self.recovery.max_recoveries
                ),
            )
        )
        stub = wgrpc.DecodeWorkerStub(self.links.channel(worker.address))
        call.worker_call = stream = stub.Decode(
            request, timeout=context.time_remaining(), metadata=tracing.headers(call.span)
        )
        answered = False
        async for msg in self._events(call, stream, Fault.DECODE_FAILED, worker):
            if not answered:
                answered = True
                self.placer.worker_ok(worker.worker_id)
            kind = msg.WhichOneof("kind")
            if kind == "chunk":
                if not call.outputs and msg.chunk.token_ids:
                    call.timings.first_token_ms = call.elapsed_ms()
                self._streamed(call, msg.chunk)
                yield self.replies.chunk(call, msg.chunk)
            elif kind == "complete":
                done = msg.complete
                if not call.placement.disaggregated:
                    call.cached_prompt_tokens = done.num_cached_tokens
                call.timings.kv_transfer_ms = done.kv_transfer_ms
                reason = wire.finish_reason_from_proto(done.finish_reason)
                yield self.replies.complete(call, reason, done.stop_reason)
                return
            elif kind == "moved":
                # The worker is draining: its KV of the stream stays pinned for another decode
                # worker to pull (the same worker-side id: the handle is signed for it).
                call.kv = _handoff(msg.moved)
                why = "draining: the stream moves with its KV"
                raise HopFailed(Fault.DECODE_MOVED, worker.worker_id, why, breaker=False)
            elif kind == "kv_failed":
                owner = call.placement.prefill.worker_id if call.placement.prefill else "?"
                call.kv = None
                # The owner may be fine (a slow reader let the lease lapse): no breaker.
                raise HopFailed(Fault.KV_PULL_FAILED, owner, msg.kv_failed.reason, breaker=False)
        raise HopFailed(Fault.DECODE_FAILED, worker.worker_id, "stream ended without a result")

    async def _events(
        self,
        call: Call,
        stream: grpc.aio.UnaryStreamCall,
        fault: Fault,
        worker: WorkerLoad,
    ) -> AsyncIterator[Any]:
        """A hop's messages, progress reports consumed here: the hop fails as stalled only
        after hop_timeout_s without any advance (`tandem.routing.stall`), however long a busy
        worker takes. Raises HopFailed on a stall or a worker fault."""
        watch = StallWatch(self.hop_timeout_s, time.monotonic())
        while True:
            try:
                async with asyncio.timeout(max(watch.remaining_s(time.monotonic()), 0.0)):
                    msg = await stream.read()
            except TimeoutError:
                stream.cancel()
                raise HopFailed(
                    fault, worker.worker_id,
                    f"no progress for {self.hop_timeout_s:g}s (hop_timeout_s)", stalled=True,
                ) from None  # fmt: skip
            except grpc.aio.AioRpcError as exc:
                raise self._hop_error(call, exc, fault, worker.worker_id) from None
            if msg is grpc.aio.EOF:
                return
            now = time.monotonic()
            if msg.WhichOneof("kind") == "progress":
                watch.progress(convert.progress_from_proto(msg.progress), now)
                continue
            watch.output(now)
            yield msg

    def _streamed(self, call: Call, chunk: rpb.Chunk) -> None:
        if not call.t_last_token and chunk.token_ids and call.estimate_s is not None:
            self.metrics.queue_delay.observe(time.perf_counter() - call.t_start)
        call.t_last_token = self.metrics.streamed(
            call.timings.disaggregated, call.t_start, call.t_last_token, len(chunk.token_ids),
            time.perf_counter(),
        )  # fmt: skip
        call.outputs.extend(chunk.token_ids)
        call.emitted_chars += len(chunk.text)

    def _hop_error(
        self, call: Call, exc: grpc.aio.AioRpcError, fault: Fault, worker_id: str
    ) -> Exception:
        """A failed worker call as HopFailed (a worker fault: recover) or ServiceError (the
        request's own outcome, or a cancel by Abort, which the caller handles)."""
        code = exc.code()
        if call.aborted:
            return exc
        if worker_fault(code.name):
            return HopFailed(
                fault, worker_id, f"{code.name}: {exc.details()}",
                unreachable=code is grpc.StatusCode.UNAVAILABLE,
            )  # fmt: skip
        return errors.from_worker(exc)

    # -- recovery ----------------------------------------------------------------------------

    async def _recover(self, call: Call, failed: HopFailed) -> None:
        """Re-place `call` after `failed`, or raise ServiceError(UNAVAILABLE). With no decode
        worker to continue on, the stream is held (open, nothing sent) and planned again
        every HOLD_POLL_S until one is back or `hold_s` is spent (`Action.HOLD`)."""
        moved = failed.fault is Fault.DECODE_MOVED  # its hand-off, signed for this id, goes on
        call.failed.add(failed.worker_id)
        call.restarted.discard(failed.worker_id)  # this incarnation failed it too
        call.failed_epochs[failed.worker_id] = self.placer.epoch_of(failed.worker_id)
        # Never the last healthy worker of its role for a stall: taking it out of rotation
        # would refuse every request, not spare them a slow worker.
        spare = failed.stalled and last_of_role(failed.worker_id, self.placer.workers())
        if failed.breaker and not spare:
            if self.placer.worker_failed(failed.worker_id, str(failed)):
                reason = ejection_reason(failed.unreachable, failed.stalled)
                self.metrics.ejections[reason].inc()
        placement = call.placement
        if failed.unreachable:
            for w in (placement.decode, placement.prefill):
                if w is not None and w.worker_id == failed.worker_id:
                    self.links.retire(w.address)
        local = placement.cached_tokens if placement.prefill is None else 0
        failure = Failure(
            fault=failed.fault,
            decode_id=placement.decode.worker_id,
            prefill_id=placement.prefill.worker_id if placement.prefill else None,
            recoveries=call.recoveries,
            failed=frozenset(call.failed),
            num_uncached_tokens=call.spec.num_prompt_tokens - local,
            min_reprefill_tokens=self.min_reprefill_tokens,
            prefill_gone=failed.unreachable,
        )
        t_hold, held = time.monotonic(), False
        while True:
            step = plan_recovery(failure, self.placer.workers(), self.recovery)
            if step.action is not Action.HOLD or not held:  # a hold is reported once
                line = f"{failed}: {step.describe()}"
                tracing.recovery_step(call.span, failed.fault.value, step.action.value, line)
                self.metrics.recovery(failed.fault.value, step.action.value)
                log.warning("request %s: %s", call.spec.request_id, line)
                call.timings.recoveries.append(line)
            if step.action is not Action.HOLD:
                break
            held = True
            await asyncio.sleep(HOLD_POLL_S)
            self._forget_restarted(call)
            failure = dataclasses.replace(
                failure,
                failed=frozenset(call.failed),
                held_s=time.monotonic() - t_hold,
                restarted=frozenset(call.restarted),
            )
        # Whatever the failed attempt still holds (a pinned lease, a half-run request on a
        # frozen worker) is released in the background under its own ids; a moved stream's
        # pinned KV is what the next hop reads, when it can.
        keep = moved and step.keep_kv
        if not keep:
            self.links.abort(call.worker_rid, placement)
        if step.action is Action.FAIL:
            raise errors.unavailable(
                f"request {call.public_id} failed: {step.reason}", retry_after_s=1.0
            )
        assert step.decode is not None
        call.recoveries += 1
        if not keep:
            call.kv = None
            call.worker_rid = worker_request_id(call.spec.request_id)
        if step.action is Action.MIGRATE:
            call.timings.migrations += 1
        if step.action is Action.REPREFILL:
            call.timings.reprefills += 1
            assert step.prefill is not None
            call.timings.prefill_worker = step.prefill.worker_id
        call.timings.decode_worker = step.decode.worker_id
        reason = f"{placement.reason}; {step.describe()}"
        new = Placement(step.decode, step.prefill, placement.kind, reason)
        call.dispatch.finish()
        call.dispatch = self.placer.inflight.dispatch(new, call.spec.num_prompt_tokens)
        self.placer.claim(step.decode.worker_id)
        if step.prefill is not None:
            self.placer.claim(step.prefill.worker_id)
        call.placement = new

    def _forget_restarted(self, call: Call) -> None:
        """Workers that failed `call` and have since come back as a new incarnation (another
        registry epoch: restarted by supervision) are eligible again."""
        for worker_id, epoch in list(call.failed_epochs.items()):
            now = self.placer.epoch_of(worker_id)
            if now is not None and now != epoch:
                call.failed.discard(worker_id)
                call.restarted.add(worker_id)
                del call.failed_epochs[worker_id]


def _handoff(resp: wpb.PrefillResponse | wpb.KvMoved) -> KVHandoff:
    """A worker's hand-off (a prefill worker's, a draining decode worker's) as the core's
    value. Raises FAILED_PRECONDITION naming the bad field, as the decode worker would: a
    deployment problem, not the client's."""
    try:
        return convert.handoff_from_proto(resp.kv)
    except ValueError as exc:
        raise errors.failed_precondition(f"kv.{exc}") from None
