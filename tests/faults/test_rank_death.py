"""A tensor-parallel decode worker loses one rank mid-stream (issue 29): the worker ends
(status 70, tandem.engine.ranks), its streams migrate to the other decode worker and finish
token-identical to the single engine, and nothing is left held anywhere."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from benchmarks.fleet import Fleet, wait_until
from tandem.client import Result
from tandem.engine.ranks import RANK_DIED_EXIT
from tests.faults.conftest import WAIT_S
from tests.faults.test_fault_matrix import check_outputs, prompts, stream_until
from tests.services.processes import alive, children_of


@pytest.fixture(scope="module")
def tp_fleet(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    """Two decode workers of 2 ranks each, one router."""
    f = Fleet(
        model_dir,
        tmp_path_factory.mktemp("tp-fleet"),
        roles={"d0": "decode", "d1": "decode"},
        routers={"r0": []},
        worker_args=("--tensor-parallel-size", "2"),
    )
    try:
        f.start()
        yield f
    finally:
        f.stop()


def rank_pids(fleet: Fleet, name: str) -> list[int]:
    """The worker's other ranks: its children running the rank loop (spawn's resource
    tracker is a child too)."""
    pids = []
    for pid in children_of(fleet.procs[name].pid):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"spawn_main" in cmdline:
            pids.append(pid)
    return pids


def test_a_dead_rank_ends_its_worker_and_its_streams_migrate(tp_fleet: Fleet, reference) -> None:
    cases = prompts(4, 8)
    max_tokens = 300
    [rank1] = rank_pids(tp_fleet, "d0")

    async def scenario() -> list[Result]:
        started = [asyncio.Event() for _ in cases]
        tasks = [
            asyncio.create_task(stream_until(tp_fleet.addresses["r0"], p, max_tokens, e, 2))
            for p, e in zip(cases, started, strict=True)
        ]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), WAIT_S)
        os.kill(rank1, signal.SIGKILL)
        return list(await asyncio.gather(*tasks))

    results = asyncio.run(asyncio.wait_for(scenario(), WAIT_S))
    check_outputs(reference, cases, results, max_tokens)
    migrated = [r for r in results if r.migrations]
    assert migrated, "no stream was on d0"  # the load policy spreads 4 streams over both
    for r in migrated:
        assert r.migrations == 1 and r.decode_worker == "d1", r.recoveries
        assert "decode_failed on d0" in r.recoveries[0]
    assert tp_fleet.procs["d0"].wait(timeout=WAIT_S) == RANK_DIED_EXIT
    wait_until("d0's other rank is gone", lambda: not alive(rank1))
    tp_fleet.assert_clean()  # d1: every block free, no request left
    tp_fleet.restart("d0")  # comes back with both ranks and serves
    assert len(rank_pids(tp_fleet, "d0")) == 1
    tp_fleet.assert_clean()
