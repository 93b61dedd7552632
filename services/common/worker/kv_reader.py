"""The decode worker's KV reads, off the event loop: one transport, one thread (NIXL agents
are not to be used concurrently), each read timed for the response's kv_transfer_ms. The
thread makes the worker's CUDA device current (UCX's CUDA transports work in it)."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from concurrent.futures import ThreadPoolExecutor
from typing import NamedTuple

from tandem.engine.device import use_device
from tandem.transfer import KVTransport, ReadPlan, RemoteKV


class ReadDone(NamedTuple):
    num_bytes: int
    seconds: float


class KVReader:
    def __init__(self, transport: KVTransport, device: str = "cpu") -> None:
        self.transport = transport
        self._thread = ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="kv-xfer", initializer=use_device, initargs=(device,)
        )

    async def read(self, remote: RemoteKV, plan: ReadPlan, tag: bytes) -> ReadDone:
        """Pull `plan`'s blocks of `remote` into this worker's cache. Raises TransferError
        (the destination blocks then hold undefined data)."""
        if not plan.remote_block_ids:
            return ReadDone(0, 0.0)
        remote = dataclasses.replace(remote, block_ids=plan.remote_block_ids)
        local_ids = list(plan.local_block_ids)
        t0 = time.perf_counter()
        num_bytes = await asyncio.get_running_loop().run_in_executor(
            self._thread, lambda: self.transport.read(remote, local_ids, tag)
        )
        return ReadDone(num_bytes, time.perf_counter() - t0)

    def close(self) -> None:
        self._thread.shutdown(wait=False, cancel_futures=True)
