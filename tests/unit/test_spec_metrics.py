"""Speculative decoding's worker metrics (issue 45): tandem_worker_spec_*_total{role,
proposer} from a list of SpecStats (LLMEngine.spec_stats), exact, and read when scraped."""

from __future__ import annotations

import dataclasses
import re

from prometheus_client import generate_latest

from tandem.services.common.observe.collectors import SPEC_COUNTERS, spec_families
from tandem.services.common.observe.metrics import WorkerMetrics, metric_names
from tandem.speculative.stats import SpecStats

NGRAM = SpecStats(
    proposer="ngram", proposed_tokens=400, accepted_tokens=250, verify_rows=100,
    emitted_tokens=340, paused_steps=7,
)  # fmt: skip
SUFFIX = SpecStats(
    proposer="suffix", proposed_tokens=90, accepted_tokens=81, verify_rows=30,
    emitted_tokens=108, paused_steps=0,
)  # fmt: skip
DRAFT = SpecStats(
    proposer="draft", proposed_tokens=60, accepted_tokens=45, verify_rows=20,
    emitted_tokens=65, paused_steps=1, draft_prefill_tokens=0, draft_handoff_tokens=512,
)  # fmt: skip


def test_spec_families_one_counter_sample_per_proposer_and_field() -> None:
    families = spec_families("decode", [NGRAM, SUFFIX, DRAFT])
    assert [f.name for f in families] == [
        "tandem_worker_spec_proposed_tokens",
        "tandem_worker_spec_accepted_tokens",
        "tandem_worker_spec_verify_rows",
        "tandem_worker_spec_emitted_tokens",
        "tandem_worker_spec_paused_steps",
        "tandem_worker_spec_draft_prefill_tokens",
        "tandem_worker_spec_draft_handoff_tokens",
    ]
    assert [f.type for f in families] == ["counter"] * 7
    got = {
        (s.name, s.labels["proposer"]): s.value
        for family in families
        for s in family.samples
        if not s.name.endswith("_created")
    }
    assert {s.labels["role"] for family in families for s in family.samples} == {"decode"}
    assert {tuple(sorted(s.labels)) for family in families for s in family.samples} == {
        ("proposer", "role")
    }
    assert got == {
        ("tandem_worker_spec_proposed_tokens_total", "ngram"): 400,
        ("tandem_worker_spec_accepted_tokens_total", "ngram"): 250,
        ("tandem_worker_spec_verify_rows_total", "ngram"): 100,
        ("tandem_worker_spec_emitted_tokens_total", "ngram"): 340,
        ("tandem_worker_spec_paused_steps_total", "ngram"): 7,
        ("tandem_worker_spec_proposed_tokens_total", "suffix"): 90,
        ("tandem_worker_spec_accepted_tokens_total", "suffix"): 81,
        ("tandem_worker_spec_verify_rows_total", "suffix"): 30,
        ("tandem_worker_spec_emitted_tokens_total", "suffix"): 108,
        ("tandem_worker_spec_paused_steps_total", "suffix"): 0,
        ("tandem_worker_spec_proposed_tokens_total", "draft"): 60,
        ("tandem_worker_spec_accepted_tokens_total", "draft"): 45,
        ("tandem_worker_spec_verify_rows_total", "draft"): 20,
        ("tandem_worker_spec_emitted_tokens_total", "draft"): 65,
        ("tandem_worker_spec_paused_steps_total", "draft"): 1,
        ("tandem_worker_spec_draft_prefill_tokens_total", "draft"): 0,
        ("tandem_worker_spec_draft_handoff_tokens_total", "draft"): 512,
        **{
            (f"tandem_worker_spec_draft_{n}_tokens_total", p): 0
            for n in ("prefill", "handoff")
            for p in ("ngram", "suffix")
        },
    }


def test_every_count_of_spec_stats_is_a_counter() -> None:
    counts = [f.name for f in dataclasses.fields(SpecStats) if f.name != "proposer"]
    assert list(SPEC_COUNTERS) == counts


def test_no_speculation_no_series() -> None:
    assert [s for family in spec_families("decode", []) for s in family.samples] == []


def test_spec_metrics_are_read_when_scraped() -> None:
    stats = [[NGRAM]]
    m = WorkerMetrics("decode")
    m.speculation(lambda: stats[0])
    r = m.registry

    def value(name: str, proposer: str) -> float | None:
        return r.get_sample_value(name, {"role": "decode", "proposer": proposer})

    assert value("tandem_worker_spec_accepted_tokens_total", "ngram") == 250
    assert value("tandem_worker_spec_accepted_tokens_total", "suffix") is None
    stats[0] = [dataclasses.replace(NGRAM, accepted_tokens=260, paused_steps=9), SUFFIX]
    assert value("tandem_worker_spec_accepted_tokens_total", "ngram") == 260
    assert value("tandem_worker_spec_paused_steps_total", "ngram") == 9
    assert value("tandem_worker_spec_emitted_tokens_total", "suffix") == 108
    text = generate_latest(r).decode()
    assert re.search(
        r'^tandem_worker_spec_verify_rows_total\{proposer="suffix",role="decode"\} 30\.0$',
        text,
        re.M,
    )


def test_spec_metrics_only_with_speculation() -> None:
    """A worker without speculation registers none: the names every worker exposes stay the
    same (as the KV tiers', the speculative counts are registered on demand)."""
    for role in ("prefill", "decode"):
        assert not {n for n in metric_names(role) if n.startswith("tandem_worker_spec_")}
