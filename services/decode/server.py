"""Decode worker: the engine in decode role behind the DecodeWorker gRPC service.

With a KV handle, Decode reserves local blocks, pulls the prompt's KV from the prefill
worker (NIXL READ, contiguous runs coalesced), then confirms the lease. Only a confirmed
lease proves the blocks were pinned for the whole read; anything else (lapsed lease, dead
prefill worker, failed read) discards the copy and recomputes the prompt here: fail closed.
Without a handle, the prompt is prefilled here (conditional disaggregation).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor

import grpc

from services.common import convert
from services.common.worker.shell import Worker
from tandem.config import EngineRole
from tandem.engine.engine import RequestOutput
from tandem.engine.sampling import SamplingParams
from tandem.transfer import TransferError
from tandem.v1 import router_pb2 as rpb
from tandem.v1 import worker_pb2 as wpb
from tandem.v1 import worker_pb2_grpc as wgrpc

log = logging.getLogger(__name__)


class DecodeServer(Worker, wgrpc.DecodeWorkerServicer):
    role = EngineRole.DECODE
    service_names = ("tandem.v1.DecodeWorker",)

    def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        # One transport, one thread: NIXL agents are not to be used concurrently.
        self._xfer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-xfer")
        self._channels: dict[str, grpc.aio.Channel] = {}
        self.num_recomputed = 0

    def add_servicers(self, server: grpc.aio.Server) -> None:
        wgrpc.add_DecodeWorkerServicer_to_server(self, server)

    async def stop(self) -> None:
        for ch in self._channels.values():
            await ch.close()
        await super().stop()
        self._xfer.shutdown(wait=False, cancel_futures=True)

    def _prefill_stub(self, address: str) -> wgrpc.PrefillWorkerStub:
        ch = self._channels.get(address)
        if ch is None:
            ch = self._channels[address] = grpc.aio.insecure_channel(address)
        return wgrpc.PrefillWorkerStub(ch)

    # -- RPCs ------------------------------------------------------------------------------

    async def Decode(
        self, request: wpb.DecodeRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[wpb.DecodeResponse]:
        rid, params = await self.admit(request.request_id, request.sampling, context)
        prompt = list(request.prompt_token_ids)
        outputs = list(request.output_token_ids)
        emitted = request.num_emitted_chars
        stream = self.loop.open_stream(rid)
        self.num_active_rpcs += 1
        complete = wpb.DecodeComplete()
        try:
            if request.HasField("kv"):
                if not outputs:
                    await convert.abort_rpc(
                        context,
                        grpc.StatusCode.INVALID_ARGUMENT,
                        "output_token_ids must hold token 1",
                    )
                try:
                    ok = await self._pull_kv(
                        rid, prompt, outputs, emitted, params, request.kv, complete
                    )
                except _InvalidArgument as exc:
                    await convert.abort_rpc(context, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
                except _ResourceExhausted as exc:
                    await convert.abort_rpc(context, grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc))
                if not ok:
                    self.num_recomputed += 1
                    complete.recomputed = True
                    await self._add(context, rid, prompt, params, outputs, emitted)
            else:
                await self._add(context, rid, prompt, params, outputs, emitted or None)
            ended = False
            while not ended:
                out = await stream.get()
                if out is None:
                    break
                # Coalesce: tokens that piled up while the client was slow (or while this
                # loop was busy) travel as one message; per-message cost dominates here.
                chunk = self._chunk(out)
                while not out.finished and not stream.empty():
                    nxt = stream.get_nowait()
                    if nxt is None:
                        ended = True
                        break
                    out = nxt
                    more = self._chunk(out)
                    chunk.token_ids.extend(more.token_ids)
                    chunk.text += more.text
                    chunk.logprobs.extend(more.logprobs)
                if chunk.token_ids or chunk.text:
                    yield wpb.DecodeResponse(request_id=rid, chunk=chunk)
                if out.finished:
                    # Prompt tokens this worker found in its own prefix cache (with pulled KV,
                    # the part it did not need to read; without, the part it did not prefill).
                    complete.num_cached_tokens = out.num_cached_tokens
                    complete.finish_reason = convert.finish_reason_to_proto(out.finish_reason)
                    complete.stop_reason = convert.stop_reason_to_proto(out.stop_reason)
                    yield wpb.DecodeResponse(request_id=rid, complete=complete)
        finally:
            self.num_active_rpcs -= 1
            self.loop.close_stream(rid)
            # Cancelled or failed mid-stream: free everything this request holds here.
            self.loop.post(lambda e: e.abort(rid))

    async def _add(
        self,
        context: grpc.aio.ServicerContext,
        rid: str,
        prompt: list[int],
        params: SamplingParams,
        outputs: list[int],
        emitted: int | None,
    ) -> None:
        try:
            await self.loop.call(lambda e: e.add_request(rid, prompt, params, outputs, emitted))
        except ValueError as exc:
            await convert.abort_rpc(context, grpc.StatusCode.INVALID_ARGUMENT, str(exc))

    @staticmethod
    def _chunk(out: RequestOutput) -> rpb.Chunk:
        chunk = rpb.Chunk(token_ids=out.new_token_ids, text=out.new_text)
        if out.logprobs:
            chunk.logprobs.extend(convert.logprobs_to_proto(out.new_token_ids, out.logprobs))
        return chunk

    async def _pull_kv(
        self,
        rid: str,
        prompt: list[int],
        outputs: list[int],
        emitted: int,
        params: SamplingParams,
        kv: wpb.KvHandle,
        complete: wpb.DecodeComplete,
    ) -> bool:
        """Reserve, read, confirm. True: the request joined the batch with pulled KV."""
        deadline = time.monotonic() + self.config.kv_wait_s
        while True:
            try:
                reserved = await self.loop.call(
                    lambda e: e.reserve_kv(rid, prompt, outputs, params, emitted)
                )
            except ValueError as exc:
                raise _InvalidArgument(str(exc)) from None
            if reserved is not None:
                break
            if time.monotonic() > deadline:
                raise _ResourceExhausted(
                    f"no free KV blocks for a {len(prompt)}-token prompt after "
                    f"{self.config.kv_wait_s:.0f}s"
                )
            await asyncio.sleep(0.01)
        table, num_cached = reserved
        bs = self.engine.kv.block_size
        first = num_cached // bs
        num_blocks = -(-len(prompt) // bs)
        complete.num_cached_tokens = num_cached
        remote_ids = list(kv.block_ids[first:num_blocks])
        local_ids = table[first:num_blocks]
        t0 = time.perf_counter()
        try:
            if len(kv.block_ids) < num_blocks or kv.block_size != bs:
                raise TransferError(
                    f"KV handle has {len(kv.block_ids)} blocks of {kv.block_size} tokens; "
                    f"need {num_blocks} of {bs}"
                )
            if remote_ids:
                remote = convert.remote_kv_from_proto(kv)
                lease_tag = kv.lease.lease_id.encode()
                remote = dataclasses.replace(remote, block_ids=tuple(remote_ids))
                complete.kv_transfer_bytes = await asyncio.get_running_loop().run_in_executor(
                    self._xfer, lambda: self.transport.read(remote, local_ids, lease_tag)
                )
            complete.kv_transfer_ms = (time.perf_counter() - t0) * 1e3
            resp = await self._prefill_stub(kv.prefill_address).ReleaseKv(
                wpb.ReleaseKvRequest(
                    request_id=rid, lease_id=kv.lease.lease_id, epoch=kv.lease.epoch
                ),
                timeout=5.0,
            )
            valid = resp.valid
        except (TransferError, grpc.aio.AioRpcError) as exc:
            log.warning("KV pull for %s failed (%s); recomputing locally", rid, exc)
            valid = False
        if not valid:
            await self.loop.call(lambda e: e.abort(rid))  # drop the reserved blocks unread
            return False
        await self.loop.call(lambda e: e.commit_kv(rid))
        return True

    async def Abort(
        self, request: rpb.AbortRequest, context: grpc.aio.ServicerContext
    ) -> rpb.AbortResponse:
        return rpb.AbortResponse(found=await self.loop.call(lambda e: e.abort(request.request_id)))


class _InvalidArgument(ValueError):
    pass


class _ResourceExhausted(RuntimeError):
    pass
