"""Prefill worker: the engine in prefill role behind the PrefillWorker gRPC service.

A Prefill call runs the prompt to its first token. The prompt's blocks then stay pinned
under a lease until the decode worker confirms with ReleaseKv after reading them, or the
lease expires (the leases, the signing and ReleaseKv: `tandem.services.common.worker.owner`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator

import grpc

from tandem.config import EngineRole
from tandem.engine.state_pages import handoff_sections
from tandem.services.common.observe import tracing
from tandem.services.common.rpc import convert
from tandem.services.common.rpc.errors import ServiceError, aborted, rpc
from tandem.services.common.worker.engine_loop import Quiet, next_output
from tandem.services.common.worker.owner import KVOwner
from tandem.v1 import worker_pb2 as wpb
from tandem.v1 import worker_pb2_grpc as wgrpc

log = logging.getLogger(__name__)


class PrefillServer(KVOwner, wgrpc.PrefillWorkerServicer):
    role = EngineRole.PREFILL
    service_names = ("tandem.v1.PrefillWorker",)

    def add_servicers(self, server: grpc.aio.Server) -> None:
        wgrpc.add_PrefillWorkerServicer_to_server(self, server)

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
                call.keep_request = True  # the lease frees the blocks, not this call's exit
                draft = self.engine.draft_handoff  # a draft model's KV for the prompt
                sections = handoff_sections(
                    self.engine.pages_format,
                    len(out.block_ids),
                    self.engine.state_handoff,
                    out.state_blocks,
                    self.engine.kv.num_tables > 1,
                    draft.section(spec.num_prompt_tokens, out.draft_blocks) if draft else None,
                )
                resp.kv.CopyFrom(
                    self.hand_off(spec, spec.prompt_token_ids, out.block_ids, sections, span)
                )
            elif out.handed_off:  # aborted while the hand-off was on its way here
                raise aborted(rid)
            yield wpb.PrefillEvent(result=resp)
