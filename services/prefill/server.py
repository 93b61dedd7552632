"""Prefill worker: the engine in prefill role behind the PrefillWorker gRPC service.

A Prefill call runs the prompt to its first token. The prompt's blocks then stay pinned
under a lease until the decode worker confirms with ReleaseKv after reading them, or the
lease expires; either way they return to the pool exactly once. The lease rules live in
`tandem.transfer.lease.LeaseTable`; this file wires them to the engine and the RPCs.

With a cluster secret, every hand-off is signed (`tandem.transfer.signing`): over the request
id, the prompt's hashes under the request's cache salt, and every field of the handle, so the
decode worker can refuse a handle that was forged, altered, or meant for another prompt.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import AsyncIterator

import grpc

from tandem.config import EngineRole
from tandem.engine.device import use_device
from tandem.engine.engine import LLMEngine
from tandem.engine.footprint import StateSize
from tandem.engine.prefix_hash import hash_keys
from tandem.engine.request import RequestSpec
from tandem.engine.state_pages import handoff_sections
from tandem.services.common.observe import tracing
from tandem.services.common.rpc import convert
from tandem.services.common.rpc.errors import ServiceError, aborted, rpc
from tandem.services.common.security import derive_key, load_secret
from tandem.services.common.worker.engine_loop import Quiet, next_output
from tandem.services.common.worker.shell import Worker
from tandem.transfer import KVHandoff, LeaseTable, prompt_hashes, sign_handoff
from tandem.v1 import worker_pb2 as wpb
from tandem.v1 import worker_pb2_grpc as wgrpc

log = logging.getLogger(__name__)


class PrefillServer(Worker, wgrpc.PrefillWorkerServicer):
    role = EngineRole.PREFILL
    service_names = ("tandem.v1.PrefillWorker",)

    def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        # Confirming a lease takes the table's own lock, not the engine thread: it must not
        # wait for a long prefill step to end.
        self.leases = LeaseTable(self.config.lease_ttl_s, self.epoch)
        self._progress_stop = threading.Event()
        self._progress = threading.Thread(target=self._drive_transfers, daemon=True)
        self.num_expired_leases = 0
        self._lease_spans: dict[str, tracing.Span] = {}  # request id -> tandem.lease (traced)
        secret_file = self.config.auth.cluster_secret_file
        self._handoff_key = (
            derive_key(load_secret(secret_file), "kv-handoff") if secret_file else None
        )

    def add_servicers(self, server: grpc.aio.Server) -> None:
        wgrpc.add_PrefillWorkerServicer_to_server(self, server)

    async def start(self) -> None:
        if self._handoff_key is None:
            log.warning("KV hand-offs unsigned: set cluster_secret_file")
        await super().start()
        self.loop.add_hook(self._expire_leases)
        self._progress.start()

    async def stop(self) -> None:
        self._progress_stop.set()
        await super().stop()
        self._progress.join(timeout=5)

    def _drive_transfers(self) -> None:
        # NIXL without its own progress thread needs the owner to make progress while
        # readers pull pinned blocks. Spin fast only while leases are outstanding.
        use_device(self.config.engine.device)  # UCX's CUDA transports work in this thread
        while not self._progress_stop.is_set():
            try:
                self.transport.poll()
            except Exception:
                log.exception("transport poll failed")
            self._progress_stop.wait(0.0005 if len(self.leases) else 0.02)

    def _expire_leases(self, engine: LLMEngine) -> None:
        for lease in self.leases.expire():
            engine.release(lease.request_id)
            self.num_expired_leases += 1
            self.metrics.lease_expired.inc()
            tracing.end_lease(self._lease_spans.pop(lease.request_id, None), "expired")
            log.warning("lease %s of %s expired unconfirmed", lease.lease_id, lease.request_id)

    # -- RPCs ------------------------------------------------------------------------------

    @rpc
    async def Prefill(
        self, request: wpb.PrefillRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[wpb.PrefillEvent]:
        t_start = time.perf_counter()
        spec, stream = self.admit(request, context)
        rid = spec.request_id
        with self.serving("tandem.prefill", spec, context) as call:
            span = call.span
            await self.add_request(spec)
            wait_s = self.config.progress_interval_s
            while isinstance(out := await next_output(stream, wait_s), Quiet):
                # Queued or computing: the router's stall clock sees the engine move.
                progress = convert.progress_to_proto(self.loop.progress(rid))
                yield wpb.PrefillEvent(progress=progress)
            if out is None or out.finish_reason == "abort":
                if rid in self._aborted:
                    raise aborted(rid)
                raise ServiceError(grpc.StatusCode.INTERNAL, "the engine step failed")
            tracing.engine_phases(
                span,
                "tandem.prefill.queue",
                "tandem.prefill.compute",
                t_start,
                self.loop.last_step_s,
            )
            span.set_attribute("tandem.cached_tokens", out.num_cached_tokens)
            resp = convert.prefill_response_to_proto(rid, out)
            if out.handed_off and rid not in self._aborted:
                # The engine pinned the blocks at hand-off; the lease bounds how long, and
                # frees them (not this call's exit).
                lease = self.leases.grant(rid)
                call.keep_request = True
                if span.is_recording():
                    self._lease_spans[rid] = tracing.start_lease(
                        span, lease.lease_id, self.config.lease_ttl_s
                    )
                draft = self.engine.draft_handoff  # a draft model's KV for the prompt
                handoff = KVHandoff(
                    remote=self.transport.export(out.block_ids),
                    block_size=self.engine.kv.block_size,
                    num_tokens=spec.num_prompt_tokens,
                    owner_address=self.address,
                    lease_id=lease.lease_id,
                    epoch=lease.epoch,
                    expires_at=lease.expires_at,
                    sections=handoff_sections(
                        self.engine.pages_format,
                        len(out.block_ids),
                        self.engine.state_handoff,
                        out.state_blocks,
                        self.engine.kv.num_tables > 1,
                        draft.section(spec.num_prompt_tokens, out.draft_blocks) if draft else None,
                    ),
                )
                resp.kv.CopyFrom(convert.handoff_to_proto(self._sign(spec, handoff)))
            elif out.handed_off:  # aborted while the hand-off was on its way here
                raise aborted(rid)
            yield wpb.PrefillEvent(result=resp)

    def _sign(self, spec: RequestSpec, handoff: KVHandoff) -> KVHandoff:
        """`handoff` signed for `spec` (unchanged without a cluster secret). The hashes are
        the ones the decode worker computes from its own request: same tokens, same salt."""
        if self._handoff_key is None:
            return handoff
        keys = hash_keys(self.engine.model_id, spec.cache_salt, self.engine.kv_hash_format)
        hashes = prompt_hashes(spec.prompt_token_ids, handoff.block_size, keys)
        signature = sign_handoff(self._handoff_key, spec.request_id, hashes, handoff)
        return dataclasses.replace(handoff, signature=signature)

    @rpc
    async def ReleaseKv(
        self, request: wpb.ReleaseKvRequest, context: grpc.aio.ServicerContext
    ) -> wpb.ReleaseKvResponse:
        answer = self.leases.confirm(request.lease_id, request.request_id, request.epoch)
        lease_span = self._lease_spans.pop(request.request_id, None)
        tracing.end_lease(lease_span, "confirmed" if answer.valid else "lapsed")
        if answer.release is not None:
            rid = answer.release
            self.loop.post(lambda e: e.release(rid))
        return wpb.ReleaseKvResponse(valid=answer.valid)

    def abort(self, request_id: str) -> bool:
        found = bool(self.leases.revoke(request_id))  # the abort frees the blocks
        tracing.end_lease(self._lease_spans.pop(request_id, None), "revoked")
        return super().abort(request_id) or found

    def footprint(self) -> dict[str, StateSize]:
        sizes = super().footprint()
        sizes["leases"] = StateSize(len(self.leases), None)
        sizes["lease_spans"] = StateSize(len(self._lease_spans), None)
        return sizes

    def owns(self, request_id: str) -> bool:
        return super().owns(request_id) or self.leases.holds(request_id)

    def pending(self) -> int:
        """A drain also waits for every committed hand-off to be pulled (its lease confirmed)
        or to lapse: the decode worker reads the blocks from here, so leaving earlier would
        make it prefill the prompt again."""
        return super().pending() + len(self.leases)
