"""Placement policy with plain data."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tandem.routing import RouteRequest, RoutingConfig, WorkerLoad, choose
from tandem.routing.policy import home_rank

CFG = RoutingConfig(disagg_min_uncached_tokens=64, imbalance_threshold_tokens=1000)


def w(worker_id: str, role: str, **load) -> WorkerLoad:
    load.setdefault("num_blocks", 1000)
    load.setdefault("num_free_blocks", 1000)
    return WorkerLoad(worker_id=worker_id, role=role, address=f"{worker_id}:1", **load)


def req(n: int, **overlap: int) -> RouteRequest:
    return RouteRequest(n, block_size=16, overlap=overlap)


def test_no_decode_worker_means_no_placement() -> None:
    assert choose(req(100), [w("p0", "prefill")], CFG) is None
    assert choose(req(100), [w("d0", "decode", draining=True)], CFG) is None


def test_conditional_disaggregation_on_the_uncached_length() -> None:
    workers = [w("p0", "prefill"), w("d0", "decode")]
    p = choose(req(63), workers, CFG)
    assert p is not None and not p.disaggregated and "63 uncached tokens" in p.reason
    p = choose(req(64), workers, CFG)
    assert p is not None and p.disaggregated
    # 1000 tokens, but 60 of its 62 full blocks are cached on the decode worker: 40 uncached
    p = choose(req(1000, d0=60), workers, CFG)
    assert p is not None and not p.disaggregated and p.cached_tokens == 960
    # the load policy ignores caches, so the same request is disaggregated
    p = choose(req(1000, d0=60), workers, RoutingConfig(policy="load"))
    assert p is not None and p.disaggregated


def test_load_policy_spreads_ties_and_prefers_the_shorter_queue() -> None:
    load = RoutingConfig(policy="load")
    idle = [w("p0", "prefill"), w("p1", "prefill"), w("p2", "prefill"), w("d0", "decode")]
    chosen = [
        choose(RouteRequest(500, sequence=i), idle, load).prefill.worker_id  # type: ignore[union-attr]
        for i in range(6)
    ]
    assert chosen == ["p0", "p1", "p2", "p0", "p1", "p2"]
    busy = [w("p0", "prefill", queued_prefill_tokens=300), *idle[1:]]
    chosen = [
        choose(RouteRequest(500, sequence=i), busy, load).prefill.worker_id  # type: ignore[union-attr]
        for i in range(4)
    ]
    assert chosen == ["p1", "p2", "p1", "p2"]


def test_cache_affinity_wins_when_loads_are_close() -> None:
    workers = [
        w("p0", "prefill", queued_prefill_tokens=0),
        w("p1", "prefill", queued_prefill_tokens=600),  # within the 1000-token band
        w("d0", "decode"),
    ]
    p = choose(req(1024, p1=60), workers, CFG)
    assert p is not None and p.prefill is not None and p.prefill.worker_id == "p1"
    assert p.cached_tokens == 960 and "960 cached tokens" in p.reason
    # without a cached prefix the idle worker wins
    p = choose(req(1024), workers, CFG)
    assert p is not None and p.prefill is not None and p.prefill.worker_id == "p0"


def test_cache_weight_keeps_a_prefix_on_its_holder() -> None:
    """The holder's queue is 1100 tokens, the other worker idle: recomputing the prompt there
    is sooner for this request (1024 vs 16 + 1100 tokens), but copies the prefix."""
    workers = [
        w("p0", "prefill"),
        w("p1", "prefill", queued_prefill_tokens=1100),
        w("d0", "decode"),
    ]
    greedy = RoutingConfig(disagg_min_uncached_tokens=64, cache_weight=1.0)
    p = choose(req(1040, p1=64), workers, greedy)
    assert p is not None and p.prefill is not None and p.prefill.worker_id == "p0"
    p = choose(req(1040, p1=64), workers, RoutingConfig(cache_weight=2.0))
    assert p is not None and p.prefill is not None and p.prefill.worker_id == "p1"
    # a few cached blocks do not pull a request onto a long queue
    p = choose(req(1040, p1=12), workers, RoutingConfig(cache_weight=2.0))
    assert p is not None and p.prefill is not None and p.prefill.worker_id == "p0"


def test_load_wins_when_imbalance_crosses_the_threshold() -> None:
    workers = [
        w("p0", "prefill", queued_prefill_tokens=0),
        w("p1", "prefill", queued_prefill_tokens=900, inflight_prefill_tokens=200),  # 1100
        w("d0", "decode"),
    ]
    p = choose(req(1024, p1=60), workers, CFG)
    assert p is not None and p.prefill is not None and p.prefill.worker_id == "p0"
    assert "outside the imbalance band" in p.reason


def test_hot_prefix_spreads_beyond_its_holder() -> None:
    """Requests for one hot prefix pile onto its holder until the band is crossed, then
    spill to the other worker; once both hold it, affinity splits them by load."""
    queues = {"p0": 0, "p1": 0}
    holders = {"p0"}
    placed = []
    for _ in range(40):
        workers = [w(p, "prefill", queued_prefill_tokens=q) for p, q in queues.items()]
        workers.append(w("d0", "decode"))
        overlap = {p: 60 for p in holders}
        p = choose(req(1024, **overlap), workers, CFG)
        assert p is not None and p.prefill is not None
        chosen = p.prefill.worker_id
        placed.append(chosen)
        queues[chosen] += 1024 - p.cached_tokens  # the work it queued
        holders.add(chosen)  # after prefilling, it holds the prefix too
    assert placed[0] == "p0" and "p1" in placed
    assert abs(queues["p0"] - queues["p1"]) <= CFG.imbalance_threshold_tokens + 1024


def _prefill_for(key: int | None, workers: list[WorkerLoad], seq: int = 0, **overlap: int) -> str:
    p = choose(RouteRequest(1024, 16, overlap, seq, key), workers, CFG)
    assert p is not None and p.prefill is not None
    return p.prefill.worker_id


def test_uncached_prefix_goes_to_its_home() -> None:
    """With nothing cached and equal loads, each prefix has one home prefill worker: the same
    for every request counter and every order the workers are listed in (two routers agree),
    and the prefixes of a fleet are split between the workers."""
    idle = [w("p0", "prefill"), w("p1", "prefill"), w("p2", "prefill"), w("d0", "decode")]
    homes = {}
    for key in range(60):
        homes[key] = _prefill_for(key, idle)
        assert _prefill_for(key, idle[::-1], seq=7) == homes[key]
        assert max(idle[:3], key=lambda x: home_rank(key, x.worker_id)).worker_id == homes[key]
    counts = {p: list(homes.values()).count(p) for p in ("p0", "p1", "p2")}
    assert all(10 <= c <= 30 for c in counts.values()), counts
    # A worker leaving moves only the prefixes that lived on it (rendezvous hashing).
    without_p2 = [x for x in idle if x.worker_id != "p2"]
    for key, home in homes.items():
        if home != "p2":
            assert _prefill_for(key, without_p2) == home


def test_home_is_the_same_in_every_process() -> None:
    """Routers are separate processes with their own str-hash salts; they must agree."""
    code = "from tandem.routing.policy import home_rank; print(home_rank(12345, 'prefill-0'))"
    outs = {
        subprocess.run(
            [sys.executable, "-c", code],
            env={**os.environ, "PYTHONHASHSEED": seed},
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        for seed in ("1", "2")
    }
    assert outs == {str(home_rank(12345, "prefill-0"))}


def test_home_only_breaks_ties() -> None:
    idle = [w("p0", "prefill"), w("p1", "prefill"), w("d0", "decode")]
    key = next(k for k in range(100) if _prefill_for(k, idle) == "p1")
    # a cached prefix elsewhere wins over the home
    assert _prefill_for(key, idle, p0=10) == "p0"
    # so does a shorter queue, within the imbalance band
    busy_home = [w("p0", "prefill"), w("p1", "prefill", queued_prefill_tokens=16), idle[2]]
    assert _prefill_for(key, busy_home) == "p0"
    # without a key (a prompt shorter than a block), the first by id
    assert [_prefill_for(None, idle, seq=s) for s in range(4)] == ["p0"] * 4


def test_decode_choice_load_then_headroom_then_cache() -> None:
    workers = [
        w("d0", "decode", num_running=3),
        w("d1", "decode", num_running=1, num_waiting=1),
        w("d2", "decode", num_running=0, inflight_requests=4),
    ]
    p = choose(req(10), workers, CFG)
    assert p is not None and p.decode.worker_id == "d1"
    # equal load: more cached prefix wins, then more free blocks
    workers = [w("d0", "decode"), w("d1", "decode", num_free_blocks=900)]
    p = choose(req(10, d1=0), workers, CFG)
    assert p is not None and p.decode.worker_id == "d0"
    p = choose(req(100, d1=4), workers, CFG)
    assert p is not None and p.decode.worker_id == "d1"
    # a worker without room for the prompt is the last resort
    workers = [w("d0", "decode", num_free_blocks=10), w("d1", "decode", num_running=5)]
    p = choose(req(1000), workers, CFG)
    assert p is not None and p.decode.worker_id == "d1"


def test_round_robin_rotates() -> None:
    workers = [w("p0", "prefill"), w("p1", "prefill"), w("d0", "decode"), w("d1", "decode")]
    cfg = RoutingConfig(policy="round_robin")
    got = []
    for seq in range(4):
        p = choose(RouteRequest(500, sequence=seq), workers, cfg)
        assert p is not None and p.prefill is not None
        got.append((p.prefill.worker_id, p.decode.worker_id))
    assert got == [("p0", "d0"), ("p1", "d1"), ("p0", "d0"), ("p1", "d1")]


def test_draining_workers_are_skipped() -> None:
    workers = [
        w("p0", "prefill", draining=True),
        w("d0", "decode"),
        w("d1", "decode", draining=True),
    ]
    p = choose(req(500), workers, CFG)
    assert p is not None and not p.disaggregated and p.decode.worker_id == "d0"


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("policy", "random"),
        ("disagg_min_uncached_tokens", -1),
        ("imbalance_threshold_tokens", -5),
        ("min_free_block_fraction", 1.5),
        ("cache_weight", 0.5),
    ],
)
def test_config_validation(field, value) -> None:
    with pytest.raises(ValueError, match=field):
        RoutingConfig(**{field: value})
