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


@pytest.fixture(scope="module", params=["ngram", "suffix"])
def cluster(
    request: pytest.FixtureRequest, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Cluster]:
    with up_cluster(tiny_model_dir, tmp_path_factory.mktemp("run"), speculative=request.param) as c:
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
    assert_all_free(cluster)


def test_every_worker_advertises_its_speculative_method(cluster: Cluster) -> None:
    """The registry records (WorkerInfo, from the engine) name the method on both roles, and
    no draft format: ngram and suffix move nothing with a hand-off, so they pair as before."""

    async def records() -> dict[str, tuple[str, str]]:
        registry = Registry(cluster.redis_url)
        try:
            workers = await registry.list_workers()
        finally:
            await registry.close()
        return {w.worker_id: (w.speculative, w.draft_format) for w in workers}

    method = cluster.config.speculative
    assert asyncio.run(records()) == {"prefill-0": (method, ""), "decode-0": (method, "")}
