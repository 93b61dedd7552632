"""The soak of issue 26, short: `tandem up` with the tiny model (1 prefill + 1 decode worker),
4 closed-loop clients of the OpenAI HTTP API sending a bounded number of requests from the
soak's own mix (benchmarks/soak_load.py: short chats streamed and not, documents long enough to
be prefilled on the prefill worker, streams closed by the client after 1-3 chunks, requests
given up before their first chunk, invalid requests), once on the device cache alone and once
with KV tiers behind a small one. Afterwards every valid request completed
or ended by its own disconnect, every invalid one got a 4xx, and both workers are back to 0 KV
blocks in use within lease_ttl_s, holding no lease and running nothing; no KV audit violation
and no ejection (where the build exports those metrics). No timing is asserted. The full soak
is `benchmarks/bench_soak.py` (BENCHMARKS.md)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

pytest.importorskip("openai", reason="the soak drives the real openai client (a dev dependency)")

from benchmarks.soak_load import INVALID_KINDS, Mix, Record, SoakTraffic  # noqa: E402
from benchmarks.soak_metrics import (  # noqa: E402
    Sample,
    scrape_all,
    wait_kv_free,
    worker_lease_ttl_s,
)
from tandem.services.up import Cluster  # noqa: E402
from tests.services.conftest import up_cluster  # noqa: E402
from tests.services.workers import assert_all_free  # noqa: E402

NUM_CLIENTS = 4
NUM_REQUESTS = 48
# The tiny model's context is 2048 tokens: documents of 60-300 words are ~200-1100 tokens,
# over the router's 64-token threshold, so they are prefilled on the prefill worker.
MIX = Mix(
    chat_weight=0.4,
    document_weight=0.5,
    invalid_weight=0.1,
    disconnect_fraction=0.3,
    disconnect_chunks=(1, 3),
    # Given up before the first chunk, wherever the request is by then (up to ~0.3 s:
    # queued, placed, mid-prefill, handed off, decoding).
    early_disconnect_fraction=0.3,
    early_disconnect_s=(0.002, 0.3),
    document_words=(60, 300),
    chat_max_tokens=16,
    document_max_tokens=32,
)
DRAIN_MARGIN_S = 2.0


async def soak(cluster: Cluster) -> list[Record]:
    config = json.loads((Path(cluster.config.model_dir) / "config.json").read_text())
    context = int(config["max_position_embeddings"])
    traffic = SoakTraffic(f"http://{cluster.http_address}/v1", max_model_len=context, mix=MIX)
    async with traffic:
        return await traffic.run(NUM_CLIENTS, num_requests=NUM_REQUESTS)


def describe(records: list[Record]) -> list[str]:
    return [f"{r.kind}: {r.outcome} {r.detail[:120]}" for r in records]


# KV tiers (issue 44) behind a device cache of 1 MiB (2048 tokens of the tiny model): the
# documents evict each other, so blocks go down to host memory and disk and come back while
# streams are cut and given up around them.
TIERS = dict(
    kv_cache_bytes=1 << 20, kv_host_bytes=8 << 20, kv_disk_bytes=16 << 20,
)  # fmt: skip


@pytest.mark.parametrize("tiers", [False, True], ids=["device", "kv-tiers"])
def test_soak_leaves_nothing_behind(tiny_model_dir: Path, tmp_path: Path, tiers: bool) -> None:
    overrides = dict(TIERS, kv_disk_dir=str(tmp_path / "kv-disk")) if tiers else {}
    with up_cluster(tiny_model_dir, tmp_path / "run", **overrides) as cluster:
        records = asyncio.run(soak(cluster))
        drained, samples = wait_kv_free(cluster, worker_lease_ttl_s() + DRAIN_MARGIN_S, 0.0)
        pages = scrape_all(cluster)
        try:  # GetStats: no block, lease, running or waiting request
            assert_all_free(cluster)
            held = ""
        except AssertionError as exc:
            held = f"a worker still holds something: {exc}"

    valid = [r for r in records if r.valid]
    invalid = [r for r in records if not r.valid]
    # The mix did what it says: streams cut short, documents served, every invalid kind sent.
    assert any(r.outcome == "disconnected" for r in valid)
    assert any(r.kind == "document" and r.outcome == "completed" for r in valid)
    assert {r.kind for r in invalid} == set(INVALID_KINDS)
    assert len(records) == NUM_REQUESTS + len(INVALID_KINDS)

    # Every defect at once, not the first alone.
    problems = [f"valid {line}" for line in describe([r for r in valid if not r.ok])]
    problems += [f"not refused with 4xx: {x}" for x in describe([r for r in invalid if not r.ok])]
    if drained is None:
        last: Sample = samples[-1]
        problems.append(
            f"KV blocks still in use {worker_lease_ttl_s() + DRAIN_MARGIN_S:g} s after the "
            f"traffic: {last.kv_blocks_used} (unreadable: {last.unreadable})"
        )
    if held:
        problems.append(held)
    audit = "tandem_worker_kv_audit_violations_total"
    for name, page in pages.items():
        if name != "router" and page.has(audit) and page.total(audit):
            problems.append(f"{name}: {page.total(audit):g} KV audit violations")
    ejections = "tandem_router_ejections_total"
    if pages["router"].has(ejections) and pages["router"].total(ejections):
        problems.append(f"ejections: {pages['router'].by_label(ejections, 'reason')}")
    if tiers:  # blocks went down the tiers, and nothing read back failed its check
        offloaded = sum(
            page.total("tandem_worker_kv_tier_offload_bytes_total")
            for name, page in pages.items()
            if name != "router"
        )
        if not offloaded:
            problems.append("no worker offloaded a block to its KV tiers")
        for name, page in pages.items():
            for bad in ("digest_mismatches", "failed_writes"):
                metric = f"tandem_worker_kv_tier_{bad}_total"
                if name != "router" and page.has(metric) and page.total(metric):
                    problems.append(f"{name}: {page.total(metric):g} {bad}")
    assert not problems, "\n".join(problems)
