"""What a worker whose KV blocks other workers pull keeps: the leases on its pinned blocks,
the signing of its hand-offs, and the transport's progress while readers pull.

A prefill worker hands off every request after its first token; a draining decode worker
hands off the streams it is moving (issue 46). Either way the blocks stay pinned under a
lease until the reader confirms with ReleaseKv after reading them, or the lease expires; they
return to the pool exactly once (`tandem.transfer.lease.LeaseTable`). With a cluster secret
every hand-off is signed (`tandem.transfer.signing`) over the request id, the hashes of the
tokens whose KV it holds under the request's cache salt, and every field of the handle, so
the reader can refuse a handle that was forged, altered, or meant for other tokens.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Sequence

import grpc

from tandem.engine.device import use_device
from tandem.engine.engine import LLMEngine
from tandem.engine.footprint import StateSize
from tandem.engine.prefix_hash import hash_keys
from tandem.engine.request import RequestSpec
from tandem.services.common.observe import tracing
from tandem.services.common.rpc import convert
from tandem.services.common.rpc.errors import rpc
from tandem.services.common.security import derive_key, load_secret
from tandem.services.common.worker.shell import Worker
from tandem.transfer import KVHandoff, LeaseTable, prompt_hashes, sign_handoff
from tandem.transfer.sections import HandoffSection
from tandem.v1 import worker_pb2 as wpb

log = logging.getLogger(__name__)


class KVOwner(Worker):
    """A worker that hands KV off (see the module doc)."""

    def __init__(self, *args, **kwargs) -> None:  # type: ignore[no-untyped-def]
        super().__init__(*args, **kwargs)
        # Confirming a lease takes the table's own lock, not the engine thread: it must not
        # wait for a long step to end.
        self.leases = LeaseTable(self.config.lease_ttl_s, self.epoch)
        self._progress_stop = threading.Event()
        self._progress = threading.Thread(target=self._drive_transfers, daemon=True)
        self.num_expired_leases = 0
        self._lease_spans: dict[str, tracing.Span] = {}  # request id -> tandem.lease (traced)
        secret_file = self.config.auth.cluster_secret_file
        self._handoff_key = (
            derive_key(load_secret(secret_file), "kv-handoff") if secret_file else None
        )

    async def start(self) -> None:
        if self._handoff_key is None:
            log.warning("KV hand-offs unsigned: set cluster_secret_file")
        await super().start()
        self.loop.add_hook(self._expire_leases)
        self._progress.start()

    async def stop(self) -> None:
        self._progress_stop.set()
        await super().stop()
        if self._progress.is_alive():
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

    def hand_off(
        self,
        spec: RequestSpec,
        tokens: Sequence[int],
        block_ids: list[int],
        sections: tuple[HandoffSection, ...],
        span: tracing.Span,
    ) -> wpb.KvHandle:
        """A lease on the engine's pinned `block_ids` (the KV of `tokens`: the prompt, and
        for a moved stream its output but the last token) and the signed handle naming them.
        The lease, not the caller's exit, frees the blocks."""
        rid = spec.request_id
        lease = self.leases.grant(rid)
        if span.is_recording():
            self._lease_spans[rid] = tracing.start_lease(
                span, lease.lease_id, self.config.lease_ttl_s
            )
        handoff = KVHandoff(
            remote=self.transport.export(block_ids),
            block_size=self.engine.kv.block_size,
            num_tokens=len(tokens),
            owner_address=self.address,
            lease_id=lease.lease_id,
            epoch=lease.epoch,
            expires_at=lease.expires_at,
            sections=sections,
        )
        return convert.handoff_to_proto(self._sign(spec, tokens, handoff))

    def _sign(self, spec: RequestSpec, tokens: Sequence[int], handoff: KVHandoff) -> KVHandoff:
        """`handoff` signed for `spec` (unchanged without a cluster secret). The hashes are
        the ones the reader computes from its own request: same tokens, same salt."""
        if self._handoff_key is None:
            return handoff
        keys = hash_keys(self.engine.model_id, spec.cache_salt, self.engine.kv_hash_format)
        hashes = prompt_hashes(list(tokens), handoff.block_size, keys)
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

    async def drain_step(self) -> int:
        """A drain also waits for every hand-off to be pulled (its lease confirmed) or to
        lapse: the reader pulls the blocks from here, so leaving earlier would make it
        compute them again."""
        return await super().drain_step() + len(self.leases)
