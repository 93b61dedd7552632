"""DeepSeek-V3 served disaggregated (issue 43), real processes: its latent-cache blocks (one
KV head of (kv_lora_rank + qk_rope_head_dim) / 2 per layer: the dense models' layout and
signature) travel through the workers' transport and decode, absorbed, on the decode worker.

- `tandem up --model` over a small random DeepseekV3ForCausalLM (transformers' checkpoint,
  the tiny model's tokenizer): every answer is the single engine's, token for token, some
  of them handed off;
- a signed pair of workers: one prompt's hand-off moves every block the prompt filled, the
  latent's bytes, and is pulled, not recomputed."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest

from tandem.model.config import ModelConfig
from tandem.services.common.redis.server import RedisServer
from tests.services.conftest import up_cluster
from tests.services.test_forged_handoff import decode, greedy, prefill, stats
from tests.services.test_moe_up import assert_answers_as_its_engine, moe_model, reference_engine
from tests.services.workers import assert_all_free, signed_pair

BLOCK = 16  # the workers' block size (tests/services/workers.py)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return moe_model(tmp_path_factory.mktemp("deepseek-v3"), "deepseek-v3")


def test_mla_cluster_answers_as_the_single_engine(model_dir: Path, tmp_path: Path) -> None:
    config = ModelConfig.from_dir(model_dir)
    assert config.features.mla is not None and (config.num_kv_heads, config.head_dim) == (1, 20)
    with up_cluster(model_dir, tmp_path / "run") as cluster:
        assert_answers_as_its_engine(cluster, model_dir)
        assert_all_free(cluster)


@pytest.fixture(scope="module")
def pair(
    model_dir: Path,
    redis_server: RedisServer,
    procs: SimpleNamespace,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[SimpleNamespace]:
    with signed_pair(model_dir, redis_server.url, procs, tmp_path_factory.mktemp("secret")) as c:
        yield c


def test_the_latent_cache_is_pulled(pair: SimpleNamespace, model_dir: Path) -> None:
    prompt = random.Random(4).choices(range(5, 512), k=70)  # 4 blocks of 16 and a partial
    first = prefill(pair, "m1", prompt)
    layout = first.kv.layout
    assert (layout.num_kv_heads, layout.head_dim, layout.num_layers) == (1, 20, 3)
    assert first.kv.block_bytes == BLOCK * 3 * 2 * 20 * 4  # float32 latents and rope keys
    assert len(first.kv.block_ids) == 5
    tokens, complete = decode(pair, "m1", prompt, first)
    assert tokens == greedy(reference_engine(model_dir), prompt)
    assert complete.kv_transfer_bytes == 5 * first.kv.block_bytes and not complete.recomputed
    assert stats(pair, pair.prefill).num_pinned_requests == 0  # lease confirmed
