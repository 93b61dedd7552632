"""Mixture-of-experts models served disaggregated: `tandem up --model` over a small random
Qwen3-MoE and Mixtral (transformers' own checkpoints, with the tiny model's tokenizer),
real processes; long prompts prefill on the prefill worker and decode on the decode worker,
and every answer is the single-process engine's, token for token; also with 2 ranks a
worker and the experts split whole between them (`--tp 2 --expert-parallel`)."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from tandem.config import CacheConfig, EngineConfig
from tandem.engine.engine import LLMEngine
from tandem.model.config import ModelConfig
from tandem.services.up import Cluster
from tandem.weights.tiny import make_tiny_model
from tests.hf_models import build_hf_model
from tests.services.conftest import KV_BYTES, up_cluster
from tests.services.workers import assert_all_free, assert_answers_as_the_single_engine


def moe_model(root: Path, arch: str) -> Path:
    """transformers' random `arch` checkpoint (tests/hf_models.py ARCH_CONFIGS) with the tiny
    model's tokenizer."""
    tiny = make_tiny_model(root / "tiny", preset="tiny")
    out = root / "model"
    build_hf_model(arch, out, vocab_size=512)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tiny / name, out / name)
    return out


@pytest.fixture(scope="module", params=["qwen3-moe", "mixtral"])
def model_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return moe_model(tmp_path_factory.mktemp(request.param), request.param)


@pytest.fixture(scope="module")
def cluster(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with up_cluster(model_dir, tmp_path_factory.mktemp("run")) as c:
        yield c


def test_moe_cluster_answers_as_the_single_engine(cluster: Cluster, model_dir: Path) -> None:
    assert ModelConfig.from_dir(model_dir).moe is not None
    assert_answers_as_its_engine(cluster, model_dir)
    assert_all_free(cluster)


def test_expert_parallel_cluster_answers_as_the_single_engine(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    """`tandem up --tp 2 --expert-parallel`: each worker's 2 ranks hold 4 of the 8 experts."""
    model_dir = moe_model(tmp_path_factory.mktemp("ep"), "qwen3-moe")
    run_dir = tmp_path_factory.mktemp("ep-run")
    with up_cluster(model_dir, run_dir, tensor_parallel_size=2, expert_parallel=True) as c:
        assert_answers_as_its_engine(c, model_dir)
        assert_all_free(c)


def reference_engine(model_dir: Path) -> LLMEngine:
    """The single float32 engine a cluster over `model_dir` answers as."""
    return LLMEngine(
        EngineConfig(str(model_dir), dtype="float32", cache=CacheConfig(kv_cache_bytes=KV_BYTES))
    )


def assert_answers_as_its_engine(cluster: Cluster, model_dir: Path) -> None:
    """Greedy answers through the cluster equal a float32 engine over `model_dir`, some of
    them handed off."""
    results = assert_answers_as_the_single_engine(
        cluster, reference_engine(model_dir), seed=30, num_prompts=10, max_prompt_len=160,
        max_tokens=12,
    )  # fmt: skip
    assert any(r.disaggregated for r in results)
