"""Tier-aware placement (tandem.routing.tiers and its use in tandem.routing.policy), exact:
every figure below is worked out by hand in the comment beside it. Rates are chosen so the
onload equivalents are exact binary fractions."""

from __future__ import annotations

import pytest

from tandem.routing import (
    Candidate,
    RouteRequest,
    RoutingConfig,
    TierCost,
    TierOverlap,
    WorkerLoad,
    choose,
    tier_cost,
    weigh,
)

CFG = RoutingConfig(disagg_min_uncached_tokens=0, imbalance_threshold_tokens=1000)


def w(worker_id: str, role: str, **load: object) -> WorkerLoad:
    load.setdefault("num_blocks", 1000)
    load.setdefault("num_free_blocks", 1000)
    return WorkerLoad(worker_id=worker_id, role=role, address=f"{worker_id}:1", **load)  # type: ignore[arg-type]


# -- TierOverlap ------------------------------------------------------------------------


def test_overlap_counts_each_tier_with_the_faster_ones() -> None:
    assert TierOverlap.of(0, 0, 0) == TierOverlap(0, 0, 0)
    # a worker without tiers publishes no marks: host and disk are its device count
    assert TierOverlap.of(3, 0, 0) == TierOverlap(3, 3, 3)
    # the device's blocks count for host even while a host mark lags
    assert TierOverlap.of(3, 1, 5) == TierOverlap(3, 3, 5)
    assert TierOverlap.of(1, 4, 2) == TierOverlap(1, 4, 4)
    assert TierOverlap.of(0, 2, 6) == TierOverlap(0, 2, 6)
    with pytest.raises(
        ValueError, match="device_blocks <= host_blocks <= disk_blocks, got 2, 1, 3"
    ):
        TierOverlap(2, 1, 3)
    with pytest.raises(ValueError, match="got -1, 0, 0"):
        TierOverlap(-1, 0, 0)


# -- tier_cost --------------------------------------------------------------------------


def test_device_only_costs_the_uncached_tokens() -> None:
    # 3 blocks of 4 = 12 device tokens of 20: 8 to compute, whatever the rates
    assert tier_cost(TierOverlap(3, 3, 3), 4, 20, 1000.0, 4000.0, 2000.0) == TierCost(12, 0, 0, 8)
    assert tier_cost(TierOverlap(0, 0, 0), 4, 20, 0.0, 0.0, 0.0) == TierCost(0, 0, 0, 20)


def test_host_segment_costs_its_onload_time_in_prefill_tokens() -> None:
    # device 1 block (4 tokens), host to block 4 (tokens 4..15: 12 onloaded at 4x the
    # prefill rate = 12 x 1000 / 4000 = 3 equivalents), 20 - 16 = 4 recomputed: 7
    cost = tier_cost(TierOverlap(1, 4, 4), 4, 20, 1000.0, 4000.0, 0.0)
    assert cost == TierCost(4, 12, 0, 7.0)
    assert cost.tier_tokens == 12


def test_host_and_disk_segments() -> None:
    # device 0, host blocks 0-1 (8 tokens at 8x: 1.0), disk blocks 2-4 (12 tokens at 2x: 6.0),
    # 24 - 20 = 4 recomputed: 11.0
    cost = tier_cost(TierOverlap(0, 2, 5), 4, 24, 1000.0, 8000.0, 2000.0)
    assert cost == TierCost(0, 8, 12, 11.0)


def test_disk_slower_than_recompute_counts_as_recompute() -> None:
    # the disk segment (12 tokens) onloads at 500/s, slower than prefill at 1000/s: computed.
    # host 8 tokens at 8x: 1.0; recomputed 24 - 8 = 16: 17.0
    cost = tier_cost(TierOverlap(0, 2, 5), 4, 24, 1000.0, 8000.0, 500.0)
    assert cost == TierCost(0, 8, 0, 17.0)
    # as fast as recomputing is not faster: computed too
    assert tier_cost(TierOverlap(0, 0, 5), 4, 24, 1000.0, 0.0, 1000.0) == TierCost(0, 0, 0, 24)


def test_each_segment_is_weighed_on_its_own() -> None:
    # a host tier slower than recompute (8 tokens computed) does not stop a fast disk tier:
    # disk 12 tokens at 4x = 3.0, recomputed 24 - 12 = 12: 15.0
    cost = tier_cost(TierOverlap(0, 2, 5), 4, 24, 1000.0, 800.0, 4000.0)
    assert cost == TierCost(0, 0, 12, 15.0)


def test_the_last_prompt_token_is_always_computed() -> None:
    # 5 blocks of 4 cover all 20 tokens; tokens 0..18 come from disk at 2x (9.5), token 19
    # is computed (1): 10.5
    assert tier_cost(TierOverlap(0, 0, 5), 4, 20, 1000.0, 0.0, 2000.0) == TierCost(0, 0, 19, 10.5)
    # the device holding everything leaves the last token too, and no tier segment
    assert tier_cost(TierOverlap(5, 5, 5), 4, 20, 1000.0, 9e9, 9e9) == TierCost(19, 0, 0, 1)
    # 19 tokens: the device holds 16, host all 5 blocks; tokens 16, 17 onloaded at 4x (0.5),
    # token 18 computed (1): 1.5
    assert tier_cost(TierOverlap(4, 5, 5), 4, 19, 1000.0, 4000.0, 0.0) == TierCost(16, 2, 0, 1.5)


def test_unknown_rates_count_tier_segments_as_recompute() -> None:
    # prefill rate not yet measured: nothing to compare with; scores as without tiers
    assert tier_cost(TierOverlap(1, 3, 5), 4, 24, 0.0, 8000.0, 4000.0) == TierCost(4, 0, 0, 20)
    # marks found but a tier rate of 0 (not measured, or no such tier)
    assert tier_cost(TierOverlap(1, 3, 5), 4, 24, 1000.0, 0.0, 0.0) == TierCost(4, 0, 0, 20)


# -- placement ----------------------------------------------------------------------------

RATES = {"prefill_tokens_per_s": 1000.0, "host_onload_tokens_per_s": 4000.0}


def test_a_host_hit_on_an_idle_worker_beats_a_device_hit_on_a_busy_one() -> None:
    """320 tokens in blocks of 16. p-busy holds 16 blocks (256 tokens) on its device with 100
    queued tokens: 2 x (320 - 256) + 100 = 228. p-idle holds them in host memory only,
    onloaded at 4x its prefill rate: 2 x (64 + 256 x 1000 / 4000) + 0 = 2 x 128 = 256 > 228;
    with 20 blocks (319 tokens, the last computed) in host: 2 x (1 + 319 / 4) = 161.5 < 228."""
    workers = [
        w("d0", "decode"),
        w("p-busy", "prefill", queued_prefill_tokens=100, **RATES),
        w("p-idle", "prefill", **RATES),
    ]
    tiers = {"p-busy": TierOverlap(16, 16, 16), "p-idle": TierOverlap(0, 16, 16)}
    route = RouteRequest(320, 16, {"p-busy": 16}, tiers=tiers)
    p = choose(route, workers, CFG)
    assert p is not None and p.prefill is not None and p.prefill.worker_id == "p-busy"
    costs = {c.worker_id: c.cost for c in p.candidates}
    assert costs == {"d0": None, "p-busy": 228.0, "p-idle": 256.0}

    tiers["p-idle"] = TierOverlap(0, 20, 20)
    route = RouteRequest(320, 16, {"p-busy": 16}, tiers=tiers)
    p = choose(route, workers, CFG)
    assert p is not None and p.prefill is not None and p.prefill.worker_id == "p-idle"
    assert p.reason == "kv: 0 cached tokens, queue 0, 319 from host + 0 from disk tiers"
    assert p.cached_tokens == 0  # device tokens: the tier's still need onloading
    assert p.candidates == (
        Candidate("d0", "decode", 0, load=0, free_blocks=1000),
        Candidate("p-busy", "prefill", 256, queue=100, cost=228.0),
        Candidate("p-idle", "prefill", 0, queue=0, cost=161.5, tier_tokens=319),
    )
    # without its tier entries p-idle recomputes everything: 2 x 320 = 640
    route = RouteRequest(320, 16, {"p-busy": 16})
    p = choose(route, workers, CFG)
    assert p is not None and p.prefill is not None and p.prefill.worker_id == "p-busy"


def test_a_disk_hit_slower_than_recompute_scores_as_a_miss() -> None:
    slow_disk = {"prefill_tokens_per_s": 1000.0, "disk_onload_tokens_per_s": 500.0}
    workers = [w("d0", "decode"), w("p0", "prefill", **slow_disk), w("p1", "prefill")]
    route = RouteRequest(320, 16, {}, tiers={"p0": TierOverlap(0, 0, 20)})
    costs = {c.worker_id: (c.cost, c.tier_tokens) for c in weigh(route, workers, CFG)}
    assert costs == {"d0": (None, 0), "p0": (640.0, 0), "p1": (640.0, 0)}


def test_device_only_workers_score_exactly_as_before() -> None:
    workers = [
        w("d0", "decode"),
        w("p0", "prefill", queued_prefill_tokens=40, **RATES),
        w("p1", "prefill", queued_prefill_tokens=7),
        w("p2", "prefill", **RATES),
    ]
    overlap = {"d0": 3, "p0": 5, "p1": 2}
    plain = RouteRequest(300, 16, overlap, prefix_key=42)
    # tiers equal to the device counts (a worker without tiers publishes no marks)
    same = {"p0": TierOverlap(5, 5, 5), "p1": TierOverlap(2, 2, 2), "p2": TierOverlap()}
    tiered = RouteRequest(300, 16, overlap, prefix_key=42, tiers=same)
    assert weigh(tiered, workers, CFG) == weigh(plain, workers, CFG)
    assert choose(tiered, workers, CFG) == choose(plain, workers, CFG)
    # another worker's tier entry leaves the others' figures as they were
    other = RouteRequest(300, 16, overlap, prefix_key=42, tiers={"p2": TierOverlap(0, 4, 4)})
    before = {c.worker_id: c for c in weigh(plain, workers, CFG)}
    after = {c.worker_id: c for c in weigh(other, workers, CFG)}
    assert {k: v for k, v in after.items() if k != "p2"} == {
        k: v for k, v in before.items() if k != "p2"
    }
    # p2: 64 host tokens at 4x = 16 equivalents, 236 recomputed: 2 x 252 = 504
    assert after["p2"] == Candidate("p2", "prefill", 0, queue=0, cost=504.0, tier_tokens=64)


def test_the_load_policy_ignores_tiers() -> None:
    workers = [w("d0", "decode"), w("p0", "prefill", **RATES)]
    route = RouteRequest(320, 16, {"p0": 4}, tiers={"p0": TierOverlap(4, 20, 20)})
    load = RoutingConfig(policy="load")
    (_, p0) = weigh(route, workers, load)
    assert p0 == Candidate("p0", "prefill", 0, queue=0, cost=640.0)
