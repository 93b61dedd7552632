"""The KV tiers' worker metrics (issue 44): tandem_worker_kv_tier_*{role, tier} from a list
of TierStats (LLMEngine.tier_stats), exact, and read when scraped."""

from __future__ import annotations

import dataclasses
import re

from prometheus_client import generate_latest

from tandem.services.common.observe.collectors import TIER_COUNTERS, TIER_GAUGES, tier_families
from tandem.services.common.observe.metrics import WorkerMetrics, metric_names
from tandem.tiers.stats import TierStats

HOST = TierStats(
    tier="host", capacity_bytes=1 << 30, used_bytes=3 << 20, blocks=12, hit_tokens=640,
    offload_bytes=5 << 20, offload_seconds=0.25, onload_bytes=2 << 20, onload_seconds=0.125,
    skipped_offloads=3, digest_mismatches=0, failed_writes=0, evictions=7,
)  # fmt: skip
DISK = TierStats(
    tier="disk", capacity_bytes=1 << 40, used_bytes=9 << 20, blocks=36, hit_tokens=128,
    offload_bytes=9 << 20, offload_seconds=1.5, onload_bytes=1 << 20, onload_seconds=0.5,
    skipped_offloads=1, digest_mismatches=2, failed_writes=4, evictions=0,
)  # fmt: skip


def test_tier_families_one_sample_per_tier_and_field() -> None:
    families = tier_families("decode", [HOST, DISK])
    got = {
        (s.name, s.labels["tier"]): s.value
        for family in families
        for s in family.samples
        if not s.name.endswith("_created")
    }
    assert {s.labels["role"] for family in families for s in family.samples} == {"decode"}
    want = {}
    for stats in (HOST, DISK):
        for field in TIER_GAUGES:
            want[(f"tandem_worker_kv_tier_{field}", stats.tier)] = getattr(stats, field)
        for field in TIER_COUNTERS:
            want[(f"tandem_worker_kv_tier_{field}_total", stats.tier)] = getattr(stats, field)
    assert got == want
    assert [f.type for f in families] == ["gauge"] * 3 + ["counter"] * 9
    assert got[("tandem_worker_kv_tier_capacity_bytes", "disk")] == 1 << 40
    assert got[("tandem_worker_kv_tier_onload_seconds_total", "host")] == 0.125
    assert got[("tandem_worker_kv_tier_digest_mismatches_total", "disk")] == 2


def test_no_tiers_no_series() -> None:
    assert [s for family in tier_families("prefill", []) for s in family.samples] == []


def test_tier_metrics_are_read_when_scraped() -> None:
    stats = [[HOST]]
    m = WorkerMetrics("prefill")
    m.kv_tiers(lambda: stats[0])
    r = m.registry

    def value(name: str, tier: str) -> float | None:
        return r.get_sample_value(name, {"role": "prefill", "tier": tier})

    assert value("tandem_worker_kv_tier_blocks", "host") == 12
    assert value("tandem_worker_kv_tier_blocks", "disk") is None
    stats[0] = [dataclasses.replace(HOST, blocks=13, hit_tokens=700), DISK]
    assert value("tandem_worker_kv_tier_blocks", "host") == 13
    assert value("tandem_worker_kv_tier_hit_tokens_total", "host") == 700
    assert value("tandem_worker_kv_tier_failed_writes_total", "disk") == 4
    text = generate_latest(r).decode()
    assert re.search(
        r'^tandem_worker_kv_tier_used_bytes\{role="prefill",tier="disk"\} ', text, re.M
    )


def test_tier_metrics_only_with_tiers() -> None:
    """A worker without tiers registers none: the names every worker exposes stay the same
    (as a mixture-of-experts model's routing counts, the tiers' are registered on demand)."""
    for role in ("prefill", "decode"):
        assert not {n for n in metric_names(role) if n.startswith("tandem_worker_kv_tier_")}
