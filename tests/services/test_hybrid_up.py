"""Hybrid-attention models served disaggregated (issue 42): `tandem up --model` over small
random gpt-oss (sliding / full layers, sinks, biased MoE), Gemma 3 (5-token local windows,
global layers) and Qwen3-Next (Gated DeltaNet layers, gated attention, a shared expert)
checkpoints, real processes. Prompts far longer than the windows prefill on the prefill
worker and the decode worker pulls every hand-off -- Qwen3-Next's with its recurrent state in
a section of its own -- none recomputed. Every answer is the single-process engine's (itself
checked against transformers: test_model_parity.py)."""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tandem.client import TandemClient
from tandem.engine.sampling import SamplingParams
from tandem.model.config import ModelConfig
from tandem.services.up import Cluster
from tests.services.conftest import up_cluster
from tests.services.test_metrics_cluster import samples, scrape, value
from tests.services.test_moe_up import assert_answers_as_its_engine, moe_model, reference_engine
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


def test_a_shared_prefix_is_a_hit_on_every_group(cluster: Cluster, model_dir: Path) -> None:
    """A second prompt sharing 7 blocks of the first one's is served from a worker's cache --
    for Qwen3-Next from its pages and the state checkpoint the prefill worker took at their
    end -- and the router, looking its index up (with state marks for Qwen3-Next), counts
    the same prefix the worker resumes from; the answer is the single engine's."""
    rng = random.Random(3)
    shared = rng.choices(range(5, 512), k=118)
    first, second = shared + [5, 6], shared + rng.choices(range(5, 512), k=50)
    with TandemClient(cluster.router_address) as client:
        client.generate(first, max_tokens=2, temperature=0.0, ignore_eos=True)
        deadline = time.monotonic() + 30
        while True:  # the prefill worker's cache reaches the index after its step
            got = client.generate(second, max_tokens=6, temperature=0.0, ignore_eos=True)
            if got.route_cached_tokens or time.monotonic() > deadline:
                break
            time.sleep(0.2)
    # 7 blocks of 16, on whichever worker prefilled it (the decode worker holds gpt-oss's
    # and Gemma 3's pages from the first hand-off too, but no Qwen3-Next state)
    assert got.cached_prompt_tokens == got.route_cached_tokens == 112
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    [want] = reference_engine(model_dir).generate([second], params)
    assert got.token_ids == want.token_ids
    assert_all_free(cluster)
