"""`tandem up --tp 2`: every worker is 2 ranks (gloo on the CPU). Long prompts are prefilled by
the prefill worker and handed off rank by rank (each rank's KV heads into the decode rank
holding them); the answers are the single-process engine's, and nothing is left held
afterwards."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest

from tandem.config import CacheConfig, EngineConfig
from tandem.engine.engine import LLMEngine
from tandem.services.common.redis.registry import Registry
from tandem.services.up import Cluster
from tandem.weights.tiny import make_tiny_model
from tests.services.conftest import KV_BYTES, up_cluster
from tests.services.workers import assert_all_free, assert_answers_as_the_single_engine


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
    reference = LLMEngine(
        EngineConfig(str(model_dir), dtype="float32", cache=CacheConfig(kv_cache_bytes=KV_BYTES))
    )
    results = assert_answers_as_the_single_engine(
        cluster, reference, seed=29, num_prompts=8, max_prompt_len=150, max_tokens=16
    )
    long = [r for r in results if r.prompt_tokens >= 64]
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
