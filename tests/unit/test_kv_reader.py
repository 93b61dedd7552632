"""The decode worker's KV read thread makes the worker's CUDA device current before its
first read (UCX's CUDA transports work in that thread, not where the cache was made)."""

from __future__ import annotations

import asyncio
import threading

import pytest
import torch

from tandem.services.common.worker.kv_reader import KVReader
from tandem.transfer import ReadPlan
from tandem.transfer.local import LocalTransport

BLOCK_SHAPE = (2, 2, 4, 2, 8)  # [num_layers, 2, block_size, num_kv_heads, head_dim]


class RecordingTransport(LocalTransport):
    """A local transport that notes the thread of each read."""

    read_threads: list[str]

    def read(self, *args, **kwargs) -> int:  # type: ignore[no-untyped-def, override]
        self.read_threads.append(threading.current_thread().name)
        return super().read(*args, **kwargs)


def test_the_read_thread_makes_the_worker_device_current(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[int, str]] = []
    monkeypatch.setattr(
        torch.cuda, "set_device", lambda i: calls.append((i, threading.current_thread().name))
    )
    owner, reader_transport = LocalTransport("owner"), RecordingTransport("reader")
    reader_transport.read_threads = []
    owner.register(torch.arange(4 * 256, dtype=torch.float32).reshape(4, *BLOCK_SHAPE))
    reader_transport.register(torch.zeros(4, *BLOCK_SHAPE))
    reader = KVReader(reader_transport, "cuda:1")
    try:
        plan = ReadPlan(remote_block_ids=(2, 3), local_block_ids=(0, 1))
        done = asyncio.run(reader.read(owner.export([2, 3]), plan, b"r1"))
    finally:
        reader.close()
        owner.close()
        reader_transport.close()
    assert done.num_bytes == 2 * 256 * 4
    (thread,) = reader_transport.read_threads
    assert thread.startswith("kv-xfer") and calls == [(1, thread)]
