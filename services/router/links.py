"""The router's connections to its workers: one channel per address, a fresh one after a
connection failed, and the aborts of attempts that ended early, sent in the background."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Coroutine
from typing import Any

import grpc

from tandem.routing import Placement
from tandem.services.common import security
from tandem.services.common.observe.metrics import RouterMetrics
from tandem.services.common.runtime.process import channel_options
from tandem.types import Role
from tandem.v1 import router_pb2 as rpb
from tandem.v1 import worker_pb2_grpc as wgrpc

log = logging.getLogger(__name__)

ABORT_ATTEMPTS = 2  # an abort a worker did not answer is sent once more
ABORT_TIMEOUT_S = 2.0
ABORT_RETRY_S = 0.5
MAX_RETIRED = 64  # retired channels kept for closing at stop; older ones are collected


class Background:
    """Tasks the router starts and does not await (aborts, releases, gauge refresh)."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[None]] = set()

    def spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def wait(self, timeout_s: float) -> None:
        """Give the running tasks up to `timeout_s` to finish."""
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=timeout_s)


class Links:
    """Channels to workers by address. `retire(address)` makes the next call open a fresh
    one: a channel closed by keepalive sits in reconnect backoff, and would fail the first
    request after the worker recovers. A retired channel is closed at `close`: closing it
    at once would cancel calls that may still be running on it."""

    def __init__(
        self,
        auth: security.AuthConfig,
        keepalive_s: float,
        metrics: RouterMetrics,
        background: Background,
    ) -> None:
        self.auth = auth
        self.keepalive_s = keepalive_s
        self.metrics = metrics
        self.background = background
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._retired: list[grpc.aio.Channel] = []  # replaced; their calls may still run

    def channel(self, address: str) -> grpc.aio.Channel:
        ch = self._channels.get(address)
        if ch is None:
            # Keepalive: a frozen worker fails its calls within ~2 x keepalive_s.
            ch = self._channels[address] = security.internal_channel(
                address, self.auth, options=channel_options(self.keepalive_s)
            )
        return ch

    def retire(self, address: str) -> None:
        ch = self._channels.pop(address, None)
        if ch is not None:
            self._retired.append(ch)
            del self._retired[:-MAX_RETIRED]

    async def close(self) -> None:
        for ch in [*self._channels.values(), *self._retired]:
            await ch.close()

    def abort(self, worker_rid: str, placement: Placement) -> None:
        """Abort one attempt on both its workers, in the background."""
        self.background.spawn(self._abort_workers(worker_rid, placement))

    async def _abort_workers(self, worker_rid: str, placement: Placement) -> None:
        """Both workers at once. Workers answer an abort without waiting for their engine;
        one that cannot be reached now gets a second try, and past that its own reaper
        (leases, orphaned requests) frees what the attempt held."""
        req = rpb.AbortRequest(request_id=worker_rid)
        targets: list[tuple[Role, Any, str]] = [
            (Role.DECODE, wgrpc.DecodeWorkerStub, placement.decode.address)
        ]
        if placement.prefill is not None:
            targets.append((Role.PREFILL, wgrpc.PrefillWorkerStub, placement.prefill.address))
        await asyncio.gather(*(self._abort_one(req, *target) for target in targets))

    async def _abort_one(
        self, req: rpb.AbortRequest, role: Role, stub_cls: Any, address: str
    ) -> None:
        for attempt in range(ABORT_ATTEMPTS):
            t0 = time.perf_counter()
            try:
                await stub_cls(self.channel(address)).Abort(req, timeout=ABORT_TIMEOUT_S)
            except grpc.aio.AioRpcError as exc:
                self.metrics.worker_abort(role, None)
                log.warning(
                    "abort of %s on %s failed (attempt %d of %d): %s",
                    req.request_id, address, attempt + 1, ABORT_ATTEMPTS, exc.code().name,
                )  # fmt: skip
                await asyncio.sleep(ABORT_RETRY_S)
                continue
            except grpc.aio.UsageError:  # the router is stopping: its channels are closed
                log.warning("abort of %s on %s skipped: router stopping", req.request_id, address)
                return
            self.metrics.worker_abort(role, time.perf_counter() - t0)
            return
