"""Prefill worker: the engine in prefill role behind the PrefillWorker gRPC service.

A Prefill call runs the prompt to its first token. The prompt's blocks then stay pinned
under a lease (id, epoch, expiry) until the decode worker confirms with ReleaseKv after
reading them, or the lease expires; either way they return to the pool exactly once.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from dataclasses import dataclass

import grpc

from services.common import convert
from services.common.worker.shell import Worker
from tandem.config import EngineRole
from tandem.engine.engine import LLMEngine
from tandem.v1 import router_pb2 as rpb
from tandem.v1 import worker_pb2 as wpb
from tandem.v1 import worker_pb2_grpc as wgrpc

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Lease:
    lease_id: str
    request_id: str
    expires_at: float  # time.time()


class PrefillServer(Worker, wgrpc.PrefillWorkerServicer):
    role = EngineRole.PREFILL
    service_names = ("tandem.v1.PrefillWorker",)

    def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        # lease id -> lease. Guarded by a lock, not by the engine thread: confirming a lease
        # must not wait for a long prefill step to end.
        self.leases: dict[str, Lease] = {}
        self._lease_lock = threading.Lock()
        self._progress_stop = threading.Event()
        self._progress = threading.Thread(target=self._drive_transfers, daemon=True)
        self.num_expired_leases = 0

    def add_servicers(self, server: grpc.aio.Server) -> None:
        wgrpc.add_PrefillWorkerServicer_to_server(self, server)

    async def start(self) -> None:
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
        while not self._progress_stop.is_set():
            try:
                self.transport.poll()
            except Exception:
                log.exception("transport poll failed")
            self._progress_stop.wait(0.0005 if self.leases else 0.02)

    def _expire_leases(self, engine: LLMEngine) -> None:
        now = time.time()
        with self._lease_lock:
            expired = [x for x in self.leases.values() if x.expires_at <= now]
            for lease in expired:
                del self.leases[lease.lease_id]
        for lease in expired:
            engine.release(lease.request_id)
            self.num_expired_leases += 1
            log.warning("lease %s of %s expired unconfirmed", lease.lease_id, lease.request_id)

    # -- RPCs ------------------------------------------------------------------------------

    async def Prefill(
        self, request: wpb.PrefillRequest, context: grpc.aio.ServicerContext
    ) -> wpb.PrefillResponse:
        rid, params = await self.admit(request.request_id, request.sampling, context)
        prompt = list(request.prompt_token_ids)
        stream = self.loop.open_stream(rid)
        self.num_active_rpcs += 1
        handed_off = False
        try:
            try:
                await self.loop.call(lambda e: e.add_request(rid, prompt, params))
            except ValueError as exc:
                await convert.abort_rpc(context, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            out = await stream.get()
            assert out is not None
            resp = wpb.PrefillResponse(
                request_id=rid,
                first_token_id=out.new_token_ids[0] if out.new_token_ids else 0,
                text=out.new_text,
                finished=out.finished,
                finish_reason=convert.finish_reason_to_proto(out.finish_reason),
            )

            resp.num_cached_tokens = out.num_cached_tokens
            resp.stop_reason = convert.stop_reason_to_proto(out.stop_reason)
            if out.logprobs:
                resp.logprobs.extend(convert.logprobs_to_proto(out.new_token_ids, out.logprobs))
            if out.handed_off:
                # The engine pinned the blocks at hand-off; the lease bounds how long.
                lease = Lease(uuid.uuid4().hex, rid, time.time() + self.config.lease_ttl_s)
                with self._lease_lock:
                    self.leases[lease.lease_id] = lease
                handed_off = True
                remote = self.transport.export(out.block_ids)
                resp.kv.CopyFrom(
                    convert.remote_kv_to_proto(
                        remote,
                        num_tokens=len(prompt),
                        block_size=self.engine.kv.block_size,
                        prefill_address=self.address,
                        lease=wpb.Lease(
                            lease_id=lease.lease_id,
                            epoch=self.epoch,
                            expires_at_unix_s=lease.expires_at,
                        ),
                    )
                )
            return resp
        finally:
            self.num_active_rpcs -= 1
            self.loop.close_stream(rid)
            if not handed_off:
                # Cancelled, failed or finished at token 1: nothing may stay pinned.
                self.loop.post(lambda e: e.abort(rid))

    async def ReleaseKv(
        self, request: wpb.ReleaseKvRequest, context: grpc.aio.ServicerContext
    ) -> wpb.ReleaseKvResponse:
        with self._lease_lock:
            lease = self.leases.get(request.lease_id)
            if lease is None or lease.request_id != request.request_id:
                return wpb.ReleaseKvResponse(valid=False)  # expired (blocks freed) or not ours
            if request.epoch != self.epoch:
                return wpb.ReleaseKvResponse(valid=False)
            del self.leases[request.lease_id]
            # The blocks were pinned for the whole read only if the lease is still live
            # now that the reader has finished.
            valid = lease.expires_at > time.time()
        self.loop.post(lambda e: e.release(lease.request_id))
        return wpb.ReleaseKvResponse(valid=valid)

    async def Abort(
        self, request: rpb.AbortRequest, context: grpc.aio.ServicerContext
    ) -> rpb.AbortResponse:
        with self._lease_lock:
            for lease in [x for x in self.leases.values() if x.request_id == request.request_id]:
                del self.leases[lease.lease_id]
        return rpb.AbortResponse(found=await self.loop.call(lambda e: e.abort(request.request_id)))
