"""DeepSeek-V3 hand-offs between tensor-parallel sizes (issue 43), real processes, real
Redis, real NIXL: a prefill worker of TP=p hands a request's latent cache to a decode worker
of TP=d (2 -> 1, 1 -> 2, 2 -> 2). Every rank caches the same latent (MLA's one KV head,
replicated), so the hand-off moves it once: one owner rank's blocks over the transport, the
decode's other ranks filled by a local copy. The decode runs absorbed over it and answers as
the single engine, token for token; the decode worker's
tandem_worker_kv_wire_bytes_per_token is the latent's bytes per token x layers x 1."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import grpc
import pytest

from tandem.model.config import ModelConfig
from tandem.services.common.redis.server import RedisServer
from tandem.services.common.security import AuthConfig, internal_metadata
from tandem.services.up.processes import free_port
from tandem.v1 import worker_pb2_grpc as wgrpc
from tests.services.test_moe_up import moe_model, reference_engine
from tests.services.test_prefill_footprint import scrape
from tests.services.test_tensor_parallel_handoff import decode, greedy, prefill
from tests.services.workers import signed_worker_args

WORKERS = {"p1": ("prefill", 1), "p2": ("prefill", 2), "d1": ("decode", 1), "d2": ("decode", 2)}
BLOCK = 16  # the workers' block size


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return moe_model(tmp_path_factory.mktemp("deepseek-v3-tp"), "deepseek-v3")


@pytest.fixture(scope="module")
def cluster(
    model_dir: Path,
    redis_server: RedisServer,
    procs: SimpleNamespace,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[SimpleNamespace]:
    secret_file, common = signed_worker_args(redis_server.url, tmp_path_factory.mktemp("secret"))
    started, channels, stubs, metrics = [], [], {}, {}
    try:
        for name, (role, tp) in WORKERS.items():
            port = free_port("127.0.0.1")
            proc, address = procs.worker(
                role, model_dir, redis_server.url, name, "--tp", str(tp), *common,
                "--metrics-port", str(port),
            )  # fmt: skip
            started.append(proc)
            channels.append(grpc.insecure_channel(address))
            stub_cls = wgrpc.PrefillWorkerStub if role == "prefill" else wgrpc.DecodeWorkerStub
            stubs[name] = stub_cls(channels[-1])
            metrics[name] = f"http://127.0.0.1:{port}/metrics"
        yield SimpleNamespace(
            metadata=internal_metadata(AuthConfig(cluster_secret_file=str(secret_file))),
            metrics=metrics,
            **stubs,
        )
    finally:
        for channel in channels:
            channel.close()
        procs.stop(*started)


def wire_per_token(url: str) -> tuple[float, float]:
    samples = scrape(url)
    count = samples["tandem_worker_kv_wire_bytes_per_token_count"][()]
    return samples["tandem_worker_kv_wire_bytes_per_token_sum"][()], count


@pytest.mark.parametrize(("p", "d"), [("p2", "d1"), ("p1", "d2"), ("p2", "d2")])
def test_latent_handoff_moves_one_copy(
    cluster: SimpleNamespace, model_dir: Path, p: str, d: str
) -> None:
    cfg = ModelConfig.from_dir(model_dir)
    assert cfg.features.mla is not None
    latent = cfg.features.mla.entry_dim * 4 * cfg.num_layers  # float32, every layer: 480
    reference = reference_engine(model_dir)
    rng = random.Random(f"{p}{d}")
    prompts = [rng.choices(range(5, 512), k=n) for n in (70, 21, 5)]
    before_sum, before_count = wire_per_token(cluster.metrics[d])
    for i, prompt in enumerate(prompts):
        first = prefill(cluster, p, f"{p}-{d}-{i}", prompt)
        assert len(first.kv.ranks) == (WORKERS[p][1] if WORKERS[p][1] > 1 else 0)
        assert first.kv.layout.num_kv_heads == 1
        assert first.kv.block_bytes == BLOCK * latent  # one copy of the latent a block
        tokens, complete = decode(cluster, d, f"{p}-{d}-{i}", prompt, first)
        assert tokens == greedy(reference, prompt), f"prompt {i}"
        assert not complete.recomputed
        blocks = -(-len(prompt) // BLOCK)
        assert complete.kv_transfer_bytes == blocks * BLOCK * latent  # x 1, not x TP
    total, count = wire_per_token(cluster.metrics[d])
    assert count - before_count == len(prompts)
    assert total - before_sum == len(prompts) * latent  # latent bytes x layers x 1 copy
