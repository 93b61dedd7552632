"""`tandem up --tp 2`: every worker is 2 ranks (gloo on the CPU). Long prompts are prefilled by
the prefill worker and handed off rank by rank (each rank's KV heads into the decode rank
holding them); the answers are the single-process engine's, and nothing is left held
afterwards."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator
from pathlib import Path

import pytest

from services.common.redis.registry import Registry
from services.up import Cluster
from tandem.client import AsyncTandemClient
from tandem.config import CacheConfig, EngineConfig
from tandem.engine.engine import LLMEngine
from tandem.engine.sampling import SamplingParams
from tandem.model.tiny import make_tiny_model
from tests.services.conftest import KV_BYTES, up_cluster
from tests.services.workers import assert_all_free


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tp") / "tiny", preset="tiny")


@pytest.fixture(scope="module")
def cluster(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with up_cluster(model_dir, tmp_path_factory.mktemp("run"), tensor_parallel_size=2) as c:
        yield c


def test_tp2_cluster_hands_off_and_answers_as_the_single_engine(
    cluster: Cluster, model_dir: Path
) -> None:
    rng = random.Random(29)
    cases = [
        (rng.choices(range(5, 512), k=rng.randint(1, 150)), rng.randint(1, 16)) for _ in range(8)
    ]
    reference = LLMEngine(
        EngineConfig(str(model_dir), dtype="float32", cache=CacheConfig(kv_cache_bytes=KV_BYTES))
    )
    expected = reference.generate(
        [p for p, _ in cases], SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    )

    async def run() -> list:
        async with AsyncTandemClient(cluster.router_address) as client:
            return await asyncio.gather(
                *(
                    client.generate(p, max_tokens=n, temperature=0.0, ignore_eos=True)
                    for p, n in cases
                )
            )

    results = asyncio.run(run())
    for (prompt, n), got, want in zip(cases, results, expected, strict=True):
        assert got.token_ids == want.token_ids[:n], f"prompt of {len(prompt)} tokens diverged"
    long = [r for (p, _), r in zip(cases, results, strict=True) if len(p) >= 64]
    assert long and all(r.disaggregated for r in long), [r.route_reason for r in long]
    workers = asyncio.run(_registered(cluster))
    assert sorted(w.tensor_parallel_size for w in workers) == [2, 2]
    assert_all_free(cluster)


async def _registered(cluster: Cluster) -> list:
    registry = Registry(cluster.redis_url)
    try:
        return await registry.list_workers()
    finally:
        await registry.close()
