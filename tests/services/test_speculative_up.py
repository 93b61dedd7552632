"""Speculative decoding served (issue 45): `tandem up --speculative ngram` and `suffix` over
real processes. Prompts that repeat themselves are prefilled on the prefill worker, handed off,
and decoded with drafts on the decode worker from its first step; every greedy answer is the
plain single engine's, token for token, the decode worker's metrics show drafts proposed and
accepted, and every block comes back."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator
from pathlib import Path

import pytest

from tandem.client import AsyncTandemClient
from tandem.engine.sampling import SamplingParams
from tandem.services.common.redis.registry import Registry
from tandem.services.up import Cluster
from tests.services.conftest import up_cluster
from tests.services.test_metrics_cluster import samples, scrape, value
from tests.services.test_moe_up import reference_engine
from tests.services.workers import assert_all_free

MAX_TOKENS = 40


@pytest.fixture(scope="module", params=["ngram", "suffix", "draft"])
def cluster(
    request: pytest.FixtureRequest, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Cluster]:
    # draft: the target drafting for itself, always k tokens (on a CPU the cost rule would
    # not draft with a draft as costly as the target); every prompt handed off (a short
    # one prefilled on the decode worker prefills the draft there too)
    draft = dict(draft_model=str(tiny_model_dir), speculative_adaptive=False,
                 disagg_min_uncached_tokens=0)  # fmt: skip
    extra = draft if request.param == "draft" else {}
    run = tmp_path_factory.mktemp("run")
    with up_cluster(tiny_model_dir, run, speculative=request.param, **extra) as c:  # type: ignore[arg-type]
        yield c


def repeating_prompts(seed: int, n: int) -> list[list[int]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        body = rng.choices(range(5, 512), k=rng.randint(8, 40))
        out.append(body + rng.choices(range(5, 512), k=3) + body)
    return out


def test_speculative_cluster_answers_as_the_plain_engine(
    cluster: Cluster, tiny_model_dir: Path
) -> None:
    prompts = repeating_prompts(7, 6)  # 6 at once: under --speculative-max-batch 8
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    expected = reference_engine(tiny_model_dir).generate(prompts, params)

    async def run() -> list:
        async with AsyncTandemClient(cluster.router_address) as client:
            return await asyncio.gather(
                *(client.generate(p, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
                  for p in prompts)
            )  # fmt: skip

    results = asyncio.run(run())
    for got, want in zip(results, expected, strict=True):
        assert got.token_ids == want.token_ids
    assert any(r.disaggregated for r in results)
    decode = samples(scrape(cluster.metrics_addresses["decode-0"]))
    method = cluster.config.speculative
    proposed = value(decode, "tandem_worker_spec_proposed_tokens_total", proposer=method)
    accepted = value(decode, "tandem_worker_spec_accepted_tokens_total", proposer=method)
    rows = value(decode, "tandem_worker_spec_verify_rows_total", proposer=method)
    emitted = value(decode, "tandem_worker_spec_emitted_tokens_total", proposer=method)
    assert proposed >= accepted > 0 and emitted == accepted + rows
    if method == "draft":  # its KV came with each hand-off: the decode worker never prefilled it
        handed = value(decode, "tandem_worker_spec_draft_handoff_tokens_total", proposer=method)
        assert value(decode, "tandem_worker_spec_draft_prefill_tokens_total") == 0
        assert all(r.disaggregated for r in results) and handed >= sum(map(len, prompts))
        prefill = samples(scrape(cluster.metrics_addresses["prefill-0"]))
        assert value(prefill, "tandem_worker_spec_draft_prefill_tokens_total") >= handed
    assert_all_free(cluster)


def test_every_worker_advertises_its_speculative_method(cluster: Cluster) -> None:
    """The registry records (WorkerInfo, from the engine) name the method on both roles, and
    no draft format for ngram and suffix (they move nothing with a hand-off, so they pair as
    before); a draft model's format, the same on both, for draft."""

    async def records() -> dict[str, tuple[str, str]]:
        registry = Registry(cluster.redis_url)
        try:
            workers = await registry.list_workers()
        finally:
            await registry.close()
        return {w.worker_id: (w.speculative, w.draft_format) for w in workers}

    method = cluster.config.speculative
    found = asyncio.run(records())
    fmt = found["decode-0"][1]
    assert fmt.startswith("draft.v1 ") if method == "draft" else fmt == ""
    assert found == {"prefill-0": (method, fmt), "decode-0": (method, fmt)}
