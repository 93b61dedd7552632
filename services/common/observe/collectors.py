"""Worker metrics read when scraped, not maintained: Prometheus collectors over engine state.

`EngineGauges` reads the engine's load (running and waiting requests, KV blocks) and its
preemptions; `ExpertRouting` reads a mixture-of-experts model's tokens per (layer, expert);
`KVTiers` reads the KV tiers' figures (tandem.tiers, `tier_families`); `Speculation` the
speculative proposers' counts (tandem.speculative, `spec_families`).
`WorkerMetrics` (tandem.services.common.observe.metrics) registers them on its registry; nothing is
computed on the engine's hot path for them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from tandem.load import Load
    from tandem.speculative.stats import SpecStats
    from tandem.tiers.stats import TierStats

# The KV tiers' metrics: tandem_worker_kv_tier_<TierStats field>{role, tier}, one series per
# tier ("host", "disk"). Gauges of what the tier holds now, then counters since start (the
# tiers keep the cumulative totals; a scrape reports them as they are).
TIER_PREFIX = "tandem_worker_kv_tier_"
TIER_GAUGES = {
    "capacity_bytes": "The tier's budget in bytes (--kv-host-bytes, --kv-disk-bytes).",
    "used_bytes": "Bytes the tier's verified blocks take now (records with their headers).",
    "blocks": "Verified KV blocks the tier holds now.",
}
TIER_COUNTERS = {
    "hit_tokens": "Prompt tokens served from the tier (brought back and used).",
    "offload_bytes": "KV block bytes written to the tier.",
    "offload_seconds": "Time the tier spent writing blocks (sealing, digests, I/O).",
    "onload_bytes": "KV block bytes read back from the tier and verified.",
    "onload_seconds": "Time the tier spent reading blocks back and verifying them.",
    "skipped_offloads": "Evicted blocks the tier did not take because it was behind.",
    "digest_mismatches": "Blocks that failed their digest on read-back (dropped, recomputed).",
    "failed_writes": "Block writes that failed (an I/O error, a full disk): never visible.",
    "evictions": "Blocks the tier evicted to stay within its budget.",
}
# Speculative decoding's metrics (issue 45): tandem_worker_spec_<SpecStats field>_total{role,
# proposer}, one series per proposer ("ngram", "suffix"); counters since start.
SPEC_PREFIX = "tandem_worker_spec_"
SPEC_COUNTERS = {
    "proposed_tokens": "Drafted tokens the target model verified.",
    "accepted_tokens": "Drafted tokens the target agreed with (emitted as drafted).",
    "verify_rows": "Request-steps that verified a draft (one row of one step each).",
    "emitted_tokens": "Tokens the verifying rows emitted (accepted plus the target's own).",
    "paused_steps": "Steps in which speculation paused (more decoding requests than "
    "--speculative-max-batch).",
    "draft_prefill_tokens": "Prompt tokens the draft model computed on this worker (0 on a "
    "decode worker whose hand-offs carry the draft's KV).",
    "draft_handoff_tokens": "Prompt tokens whose draft-model KV arrived in a hand-off.",
}


class EngineGauges(Collector):
    """Running, waiting and KV-block gauges, and the preemptions counter, read from the
    engine when scraped (a racy read from outside the engine thread, as the heartbeat's: fine
    for load figures)."""

    def __init__(self, role: str, stats: Callable[[], Load] | None) -> None:
        self.role = role
        self.stats = stats
        self._last: Load | None = None

    def collect(self) -> Iterable[Metric]:
        s = self._last
        if self.stats is not None:
            try:
                s = self._last = self.stats()
            except RuntimeError:  # a queue changed size under the read: last figures
                pass
        values = {
            "tandem_worker_requests_running": ("Requests in the engine's batch.",
                                               s.num_running if s else 0),
            "tandem_worker_requests_waiting": ("Requests waiting for the engine (or for KV).",
                                               s.num_waiting if s else 0),
            "tandem_worker_kv_blocks_used": ("KV cache blocks in use.",
                                             s.num_blocks - s.num_free_blocks if s else 0),
            "tandem_worker_kv_blocks_capacity": ("KV cache blocks.", s.num_blocks if s else 0),
        }  # fmt: skip
        for name, (doc, value) in values.items():
            family = GaugeMetricFamily(name, doc, labels=["role"])
            family.add_metric([self.role], value)
            yield family
        preemptions = CounterMetricFamily(
            "tandem_worker_preemptions",
            "Requests preempted since start: their KV blocks freed for others', the tokens "
            "recomputed when the request is scheduled again.",
            labels=["role"],
        )
        preemptions.add_metric([self.role], s.num_preemptions if s else 0)
        yield preemptions


class ExpertRouting(Collector):
    """Tokens routed per (layer, expert), read from the model when scraped."""

    def __init__(
        self, role: str, layers: tuple[int, ...], counts: Callable[[], list[list[int]]]
    ) -> None:
        self.role, self.layers, self.counts = role, layers, counts

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(
            "tandem_worker_moe_routed_tokens",
            "Tokens routed to each expert of each sparse layer (a token counts once per "
            "expert it is routed to).",
            labels=["role", "layer", "expert"],
        )
        for layer, row in zip(self.layers, self.counts(), strict=True):
            for expert, n in enumerate(row):
                family.add_metric([self.role, str(layer), str(expert)], n)
        yield family


def record_families(
    prefix: str,
    label: str,
    role: str,
    records: Iterable[Any],
    fields: Iterable[tuple[type[CounterMetricFamily | GaugeMetricFamily], dict[str, str]]],
) -> list[Metric]:
    """One family per field of `fields` (its kind, then field -> help), named prefix +
    field, labelled role and `label` (the records' attribute of that name): one sample per
    record (none without records)."""
    records = list(records)
    families: list[Metric] = []
    for kind, docs in fields:
        for field, doc in docs.items():
            family = kind(prefix + field, doc, labels=["role", label])
            for r in records:
                family.add_metric([role, getattr(r, label)], getattr(r, field))
            families.append(family)
    return families


def tier_families(role: str, stats: Iterable[TierStats]) -> list[Metric]:
    """The KV tiers' metric families for `stats` (LLMEngine.tier_stats: one record per tier),
    labelled role and tier; each family holds one sample per tier (none without tiers)."""
    kinds = ((GaugeMetricFamily, TIER_GAUGES), (CounterMetricFamily, TIER_COUNTERS))
    return record_families(TIER_PREFIX, "tier", role, stats, kinds)


class KVTiers(Collector):
    """The KV tiers' figures (`tier_families`), read when scraped: `read` is
    LLMEngine.tier_stats, which copies them under the tiers' own lock (any thread)."""

    def __init__(self, role: str, read: Callable[[], list[TierStats]]) -> None:
        self.role, self.read = role, read

    def collect(self) -> Iterator[Metric]:
        yield from tier_families(self.role, self.read())


def spec_families(role: str, stats: Iterable[SpecStats]) -> list[Metric]:
    """Speculative decoding's metric families for `stats` (LLMEngine.spec_stats: one record
    per proposer), labelled role and proposer; each family holds one sample per proposer
    (none without speculation)."""
    kinds = ((CounterMetricFamily, SPEC_COUNTERS),)
    return record_families(SPEC_PREFIX, "proposer", role, stats, kinds)


class Speculation(Collector):
    """The speculative proposers' counts (`spec_families`), read when scraped: `read` is
    LLMEngine.spec_stats."""

    def __init__(self, role: str, read: Callable[[], list[SpecStats]]) -> None:
        self.role, self.read = role, read

    def collect(self) -> Iterator[Metric]:
        yield from spec_families(self.role, self.read())
