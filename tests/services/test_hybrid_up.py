"""Hybrid-attention models served disaggregated (issue 42): `tandem up --model` over small
random gpt-oss (sliding / full layers, sinks, biased MoE), Gemma 3 (5-token local windows,
global layers) and Qwen3-Next (Gated DeltaNet layers, gated attention, a shared expert)
checkpoints, real processes. Prompts far longer than the windows prefill on the prefill
worker and the decode worker pulls every hand-off -- Qwen3-Next's with its recurrent state in
a section of its own -- none recomputed. Every answer is the single-process engine's (itself
checked against transformers: test_model_parity.py)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tandem.model.config import ModelConfig
from tandem.services.up import Cluster
from tests.services.conftest import up_cluster
from tests.services.test_metrics_cluster import samples, scrape, value
from tests.services.test_moe_up import assert_answers_as_its_engine, moe_model
from tests.services.workers import assert_all_free


@pytest.fixture(scope="module", params=["gpt-oss", "gemma3", "qwen3-next"])
def model_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return moe_model(tmp_path_factory.mktemp(request.param), request.param)


@pytest.fixture(scope="module")
def cluster(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with up_cluster(model_dir, tmp_path_factory.mktemp("run")) as c:
        yield c


def test_hybrid_cluster_answers_as_the_single_engine(cluster: Cluster, model_dir: Path) -> None:
    features = ModelConfig.from_dir(model_dir).features
    windows = features.layer_windows
    assert features.linear_layers or (None in windows and any(w and w < 10 for w in windows))
    assert_answers_as_its_engine(cluster, model_dir)
    assert_all_free(cluster)
    decode = samples(scrape(cluster.metrics_addresses["decode-0"]))
    assert value(decode, "tandem_worker_kv_transfers_total", outcome="committed") >= 1
    assert value(decode, "tandem_worker_kv_transfers_total", outcome="refused") == 0
    assert value(decode, "tandem_worker_kv_recomputed_total") == 0
