"""Placement policy with plain data."""

from __future__ import annotations

import pytest

from tandem.routing import RoutingConfig, WorkerLoad, choose

CFG = RoutingConfig(disagg_min_uncached_tokens=64)


def w(worker_id: str, role: str, **load) -> WorkerLoad:
    return WorkerLoad(worker_id=worker_id, role=role, address=f"{worker_id}:1", **load)


def test_no_decode_worker_means_no_placement() -> None:
    assert choose(100, [w("p0", "prefill")], CFG) is None
    assert choose(100, [w("d0", "decode", draining=True)], CFG) is None


def test_short_prompts_are_prefilled_on_the_decode_worker() -> None:
    p = choose(63, [w("p0", "prefill"), w("d0", "decode")], CFG)
    assert p is not None and not p.disaggregated and p.decode.worker_id == "d0"
    assert "63 uncached tokens" in p.reason
    p = choose(64, [w("p0", "prefill"), w("d0", "decode")], CFG)
    assert p is not None and p.disaggregated and p.prefill is not None


def test_without_prefill_workers_decode_prefills() -> None:
    p = choose(1000, [w("d0", "decode")], CFG)
    assert p is not None and not p.disaggregated and "no prefill worker" in p.reason


def test_least_loaded_prefill_and_decode() -> None:
    workers = [
        w("p0", "prefill", queued_prefill_tokens=500),
        w("p1", "prefill", queued_prefill_tokens=100, inflight_prefill_tokens=300),
        w("p2", "prefill", queued_prefill_tokens=450),
        w("d0", "decode", num_running=3),
        w("d1", "decode", num_running=1, num_waiting=1),
        w("d2", "decode", num_running=0, inflight_requests=4),
    ]
    p = choose(200, workers, CFG)
    assert p is not None and p.prefill is not None
    assert p.prefill.worker_id == "p1"  # 400 < 450 < 500
    assert p.decode.worker_id == "d1"  # 2 < 3 < 4 (router's in-flight count counts too)


def test_ties_break_on_free_blocks_then_id() -> None:
    workers = [
        w("d1", "decode", num_free_blocks=10),
        w("d0", "decode", num_free_blocks=10),
        w("d2", "decode", num_free_blocks=50),
    ]
    p = choose(1, workers, CFG)
    assert p is not None and p.decode.worker_id == "d2"
    p = choose(1, workers[:2], CFG)
    assert p is not None and p.decode.worker_id == "d0"


def test_draining_workers_are_skipped() -> None:
    workers = [
        w("p0", "prefill", draining=True),
        w("d0", "decode"),
        w("d1", "decode", draining=True),
    ]
    p = choose(500, workers, CFG)
    assert p is not None and not p.disaggregated and p.decode.worker_id == "d0"


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="disagg_min_uncached_tokens"):
        RoutingConfig(disagg_min_uncached_tokens=-1)
