"""Decode worker: the engine in decode role behind the DecodeWorker gRPC service.

With a KV hand-off, Decode reserves local blocks, pulls the prompt's KV from the prefill
worker (`tandem.transfer.plan_read`: only blocks it does not cache itself; NIXL READ,
contiguous runs coalesced), then confirms the lease. Only a confirmed lease proves the
blocks were pinned for the whole read; anything else (lapsed lease, dead prefill worker,
failed read) discards the copy: fail closed. The router's request says what follows: with
`report_kv_failure` the stream ends with `kv_failed` and the router prefills again on another
prefill worker (tandem.routing.recovery); without, the prompt is recomputed here. A handle whose KV
layout (dtype, block geometry) differs from this worker's cache is not a transient failure
but a misconfigured deployment: the call ends with FAILED_PRECONDITION naming the fields, before
any block is reserved or read. Without a hand-off, the prompt is prefilled here (conditional
disaggregation).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Sequence
from typing import NamedTuple

import grpc

from services.common import convert
from services.common.errors import (
    ServiceError,
    failed_precondition,
    invalid_argument,
    resource_exhausted,
    rpc,
)
from services.common.worker.engine_loop import output_batches
from services.common.worker.kv_reader import KVReader, ReadDone
from services.common.worker.shell import Worker
from tandem.config import EngineRole
from tandem.engine.request import RequestSpec
from tandem.transfer import KVHandoff, LayoutMismatch, TransferError, check_compatible, plan_read
from tandem.v1 import router_pb2 as rpb
from tandem.v1 import worker_pb2 as wpb
from tandem.v1 import worker_pb2_grpc as wgrpc

log = logging.getLogger(__name__)


class Pulled(NamedTuple):
    """Outcome of a KV pull. committed: the request joined the batch with the pulled KV."""

    committed: bool
    num_cached_tokens: int  # prompt tokens this worker already held (not read)
    num_bytes: int
    transfer_ms: float
    failure: str = ""  # why not committed


class DecodeServer(Worker, wgrpc.DecodeWorkerServicer):
    role = EngineRole.DECODE
    service_names = ("tandem.v1.DecodeWorker",)

    def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        self._reader = KVReader(self.transport)
        self._channels: dict[str, grpc.aio.Channel] = {}
        self.num_recomputed = 0

    def add_servicers(self, server: grpc.aio.Server) -> None:
        wgrpc.add_DecodeWorkerServicer_to_server(self, server)

    async def stop(self) -> None:
        for ch in self._channels.values():
            await ch.close()
        await super().stop()
        self._reader.close()

    def _prefill_stub(self, address: str) -> wgrpc.PrefillWorkerStub:
        ch = self._channels.get(address)
        if ch is None:
            ch = self._channels[address] = grpc.aio.insecure_channel(address)
        return wgrpc.PrefillWorkerStub(ch)

    # -- RPCs ------------------------------------------------------------------------------

    @rpc
    async def Decode(
        self, request: wpb.DecodeRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[wpb.DecodeResponse]:
        spec, stream = self.admit(request, context)
        rid = spec.request_id
        outputs = list(request.output_token_ids)
        emitted = request.num_emitted_chars
        self.num_active_rpcs += 1
        complete = wpb.DecodeComplete()
        try:
            if request.HasField("kv"):
                if not outputs:
                    raise invalid_argument("output_token_ids must hold token 1")
                try:
                    handoff = convert.handoff_from_proto(request.kv)
                except ValueError as exc:
                    # Built by the prefill worker, not the client: a deployment problem.
                    raise failed_precondition(f"kv.{exc}") from None
                pulled = await self._pull_kv(spec, outputs, emitted, handoff)
                complete.kv_transfer_ms = pulled.transfer_ms
                complete.kv_transfer_bytes = pulled.num_bytes
                if not pulled.committed:
                    if request.report_kv_failure:
                        # The router prefills again elsewhere; our reserved blocks are free.
                        yield wpb.DecodeResponse(
                            request_id=rid, kv_failed=wpb.KvFailed(reason=pulled.failure)
                        )
                        return
                    self.num_recomputed += 1
                    complete.recomputed = True
                    await self.add_request(spec, outputs, emitted)
            else:
                await self.add_request(spec, outputs, emitted or None)
            async for batch in output_batches(stream):
                chunk = convert.chunk_to_proto(batch)
                if chunk.token_ids or chunk.text:
                    yield wpb.DecodeResponse(request_id=rid, chunk=chunk)
                last = batch[-1]
                if last.finished:
                    # Prompt tokens this worker found in its own prefix cache (with pulled KV,
                    # the part it did not need to read; without, the part it did not prefill).
                    complete.num_cached_tokens = last.num_cached_tokens
                    complete.finish_reason = convert.finish_reason_to_proto(last.finish_reason)
                    complete.stop_reason = convert.stop_reason_to_proto(last.stop_reason)
                    yield wpb.DecodeResponse(request_id=rid, complete=complete)
        finally:
            self.num_active_rpcs -= 1
            self.loop.close_stream(rid)
            # Cancelled or failed mid-stream: free everything this request holds here.
            self.loop.post(lambda e: e.abort(rid))

    async def _pull_kv(
        self, spec: RequestSpec, outputs: Sequence[int], emitted: int, handoff: KVHandoff
    ) -> Pulled:
        """Check the layout, reserve, read, confirm. Raises ServiceError when the request
        cannot be served here (invalid, no free blocks within kv_wait_s, or a KV layout
        that differs from this worker's)."""
        rid, prompt = spec.request_id, list(spec.prompt_token_ids)
        try:
            # Pure and cheap: before reserving, so a misconfigured pair holds no block here.
            check_compatible(handoff.remote.layout, self.transport.layout)
        except LayoutMismatch as exc:
            raise self._layout_error(handoff, exc) from None
        try:
            reserved = await self.loop.call_until(
                lambda e: e.reserve_kv(rid, prompt, outputs, spec.params, emitted),
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
        try:
            plan = plan_read(
                handoff.remote.block_ids,
                handoff.block_size,
                table,
                num_cached,
                len(prompt),
                self.engine.kv.block_size,
            )
            done = await self._reader.read(handoff.remote, plan, handoff.lease_id.encode())
            resp = await self._prefill_stub(handoff.owner_address).ReleaseKv(
                wpb.ReleaseKvRequest(
                    request_id=rid, lease_id=handoff.lease_id, epoch=handoff.epoch
                ),
                timeout=5.0,
            )
            valid = resp.valid
        except LayoutMismatch as exc:
            # The transport's own check (after ours above): free the reserved blocks unread.
            await self.loop.call(lambda e: e.abort(rid))
            raise self._layout_error(handoff, exc) from None
        except TransferError as exc:
            failure = f"KV read from {handoff.remote.agent_name} failed: {exc}"
            valid = False
        except grpc.aio.AioRpcError as exc:
            failure = f"lease confirm at {handoff.owner_address} failed: {exc.code().name}"
            valid = False
        else:
            failure = "" if valid else f"lease {handoff.lease_id} lapsed before confirm"
        if not valid:
            log.warning("KV pull for %s not usable (%s)", rid, failure)
            await self.loop.call(lambda e: e.abort(rid))  # drop the reserved blocks unread
        else:
            await self.loop.call(lambda e: e.commit_kv(rid))
        return Pulled(valid, num_cached, done.num_bytes, done.seconds * 1e3, failure)

    def _layout_error(self, handoff: KVHandoff, exc: LayoutMismatch) -> ServiceError:
        log.error("KV hand-off from %s refused: %s", handoff.remote.agent_name, exc)
        return failed_precondition(
            f"{exc} (prefill worker {handoff.remote.agent_name!r}, decode worker "
            f"{self.worker_id!r}): run both with the same model and dtype"
        )

    @rpc
    async def Abort(
        self, request: rpb.AbortRequest, context: grpc.aio.ServicerContext
    ) -> rpb.AbortResponse:
        return rpb.AbortResponse(found=await self.loop.call(lambda e: e.abort(request.request_id)))
