"""Shared-memory collectives (tandem.parallel.shm) between real rank processes:
every call gives what gloo gives, the same bits on every rank, through both parities and
across many calls; a message larger than a slot goes through gloo; a dead peer ends the
wait with an error naming it."""

from __future__ import annotations

import multiprocessing
import os
import socket
import time
from multiprocessing.connection import Connection
from typing import Any

import numpy as np
import pytest
import torch

from tandem.parallel import shm
from tandem.parallel.group import TPGroup
from tandem.parallel.sharding import Shard

pytestmark = pytest.mark.skipif(
    not shm.available(), reason="shared-memory collectives need x86-64 Linux"
)


def _address() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def _values(call: int, rank: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * call + rank)
    return torch.randn(shape, generator=g).to(dtype)


def _rank_main(rank: int, size: int, address: str, slot_bytes: int, out: Connection) -> None:
    """Run the same calls through shared memory and through gloo; send back what differed."""
    torch.set_num_threads(1)
    shard = Shard(rank, size)
    group = TPGroup.init(shard, address, "cpu")
    assert group.shm is not None
    # The same group's shared file with small slots: the oversize path is reachable.
    group.shm = shm.ShmExchange(
        group.shm._buf[: shm.file_bytes(size, slot_bytes)],
        rank,
        size,
        group.shm._pids,
        slot_bytes,
    )
    gloo = TPGroup(shard)  # the same process group, no shared memory
    report: dict[str, Any] = {"mismatch": [], "seq": [], "results": []}
    widths = tuple(5 - (r > 0) for r in range(size))  # uneven: 5, 4, 4
    for call in range(40):
        rows = 1 + call % 7
        dtype = (torch.float32, torch.bfloat16)[call % 2]
        x = _values(call, rank, (rows, 24), dtype)
        for name, ours, theirs in (
            ("all_reduce", group.all_reduce(x.clone()), gloo.all_reduce(x.clone())),
            ("all_reduce_max", group.all_reduce_max(x.clone()), gloo.all_reduce_max(x.clone())),
            ("all_gather_last", group.all_gather_last(x), gloo.all_gather_last(x)),
        ):
            exact = name != "all_reduce" or size == 2  # 3 addends: gloo's order is its own
            if exact and not torch.equal(ours, theirs):
                report["mismatch"].append((name, call))
            if not torch.allclose(ours.float(), theirs.float(), atol=0.05, rtol=0.02):
                report["mismatch"].append((name, call, "far"))
            report["results"].append(ours.float().numpy())  # tensors would travel as fds
        cols = _values(call, rank, (rows, widths[rank]), dtype)
        gathered = group.all_gather_columns(cols, widths)
        if not torch.equal(gathered, gloo.all_gather_columns(cols, widths)):
            report["mismatch"].append(("all_gather_columns", call))
        report["results"].append(gathered.float().numpy())
    seq = group.shm._seq
    big = _values(99, rank, (slot_bytes // 4 + 1,), torch.float32)  # one float over a slot
    if not torch.equal(group.all_reduce(big.clone()), gloo.all_reduce(big.clone())):
        report["mismatch"].append(("oversize", 99))
    report["seq"] = [seq, group.shm._seq]
    out.send(report)
    out.close()
    group.close()


def _run(size: int, slot_bytes: int = 1 << 12) -> list[dict[str, Any]]:
    ctx = multiprocessing.get_context("spawn")
    address = _address()
    pipes, procs = [], []
    for rank in range(size):
        reader, writer = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_rank_main, args=(rank, size, address, slot_bytes, writer))
        proc.start()
        writer.close()
        pipes.append(reader)
        procs.append(proc)
    reports = []
    for reader in pipes:
        assert reader.poll(120), "a rank did not report"
        reports.append(reader.recv())
    for proc in procs:
        proc.join(30)
        assert proc.exitcode == 0
    return reports


@pytest.mark.parametrize("size", [2, 3])
def test_shared_memory_collectives_give_gloos_results_on_every_rank(size: int) -> None:
    reports = _run(size)
    for rank, report in enumerate(reports):
        assert report["mismatch"] == [], f"rank {rank}"
        # 160 calls through shared memory (both parities, 80 times each), the oversize
        # all-reduce through gloo (the sequence did not move).
        assert report["seq"] == [160, 160], f"rank {rank}"
    # Every rank holds the same bits after every call (sums added in rank order everywhere).
    for got in reports[1:]:
        pairs = zip(reports[0]["results"], got["results"], strict=True)
        assert all(np.array_equal(a, b) for a, b in pairs)
    assert len(reports[0]["results"]) == 160


def _lonely_rank(address: str, out: Connection) -> None:
    torch.set_num_threads(1)
    group = TPGroup.init(Shard(0, 2), address, "cpu")
    try:
        group.all_gather_last(torch.ones(1, 4))
        out.send("returned")
    except RuntimeError as exc:
        out.send(str(exc))


def _dying_rank(address: str) -> None:
    TPGroup.init(Shard(1, 2), address, "cpu")
    os._exit(3)  # before the collective rank 0 waits in


def test_a_dead_peer_ends_the_wait_with_an_error_naming_it() -> None:
    ctx = multiprocessing.get_context("spawn")
    address = _address()
    reader, writer = ctx.Pipe(duplex=False)
    waiting = ctx.Process(target=_lonely_rank, args=(address, writer))
    dying = ctx.Process(target=_dying_rank, args=(address,))
    waiting.start()
    dying.start()
    writer.close()
    assert reader.poll(120), "the waiting rank neither returned nor raised"
    message = reader.recv()
    dying.join(10)
    waiting.join(30)
    assert message.startswith(f"tensor-parallel rank 1 (pid {dying.pid}) is gone"), message


def test_process_runs_tells_a_zombie_from_a_live_process() -> None:
    assert shm.process_runs(os.getpid())
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:  # until the child has exited (a zombie: unreaped)
            if not shm.process_runs(pid):
                break
            time.sleep(0.01)
        assert not shm.process_runs(pid)
    finally:
        os.waitpid(pid, 0)
    assert not shm.process_runs(pid)  # reaped: gone


def test_a_rank_may_run_one_call_ahead_without_touching_the_parts_a_peer_still_reads() -> None:
    """Two ranks (threads) over one buffer: rank 1 holds its views of call 1 while rank 0
    goes on to write call 2; with one parity rank 0 would overwrite what rank 1 reads."""
    import threading

    slot = 256
    buf = torch.zeros(shm.file_bytes(2, slot), dtype=torch.uint8)
    ranks = [shm.ShmExchange(buf, r, 2, [os.getpid()] * 2, slot) for r in (0, 1)]
    seen: list[torch.Tensor] = []

    def rank1() -> None:
        parts = ranks[1].gather(torch.full((4,), 11.0), [(4,), (4,)])
        time.sleep(0.2)  # rank 0 writes call 2 meanwhile
        seen.append(parts[0].clone())
        ranks[1].gather(torch.full((4,), 12.0), [(4,), (4,)])

    thread = threading.Thread(target=rank1)
    thread.start()
    first = ranks[0].gather(torch.full((4,), 1.0), [(4,), (4,)])
    assert torch.equal(first[1], torch.full((4,), 11.0))
    second = ranks[0].gather(torch.full((4,), 2.0), [(4,), (4,)])
    thread.join(10)
    assert torch.equal(seen[0], torch.full((4,), 1.0))  # call 1's part, not call 2's
    assert torch.equal(second[1], torch.full((4,), 12.0))
