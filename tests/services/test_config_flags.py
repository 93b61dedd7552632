"""Engine and routing settings given as flags reach real worker and router processes: the
composed configs (WorkerConfig.engine, RouterConfig.routing) leave no setting unreachable."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest
import torch

from tandem.client import TandemClient
from tandem.config import CacheConfig
from tandem.engine.kv_cache import block_bytes
from tandem.model.config import ModelConfig
from tandem.v1 import worker_pb2 as wpb
from tandem.v1 import worker_pb2_grpc as wgrpc
from tests.services.processes import spawn_logged

KV_BYTES = 8 << 20


_spawn = spawn_logged


@pytest.fixture(scope="module")
def cluster(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    logs = tmp_path_factory.mktemp("logs")
    decode, decode_address = _spawn(
        "tandem.services.decode", logs / "decode.log",
        "--model-dir", str(tiny_model_dir), "--transport", "local",
        "--kv-cache-bytes", str(KV_BYTES), "--dtype", "bfloat16", "--device", "cpu",
        "--enable-prefix-caching", "false", "--long-prefill-token-threshold", "8",
    )  # fmt: skip
    router, router_address = _spawn(
        "tandem.services.router", logs / "router.log",
        "--model-dir", str(tiny_model_dir), "--port", "0",
        "--decode-addresses", decode_address, "--min-free-block-fraction", "0.2",
    )  # fmt: skip
    yield decode_address, router_address, logs
    for proc in (router, decode):
        proc.terminate()
        proc.wait(timeout=30)


def test_engine_settings_reach_the_worker_process(cluster, tiny_model_dir: Path) -> None:  # type: ignore[no-untyped-def]
    decode_address, _, logs = cluster
    with grpc.insecure_channel(decode_address) as channel:
        stats = wgrpc.DecodeWorkerStub(channel).GetStats(wpb.GetStatsRequest(), timeout=10)
    model = ModelConfig.from_dir(tiny_model_dir)
    # bfloat16 KV takes half the bytes per block of float32: twice the blocks in the budget.
    assert stats.num_blocks == KV_BYTES // block_bytes(model, 16, torch.bfloat16)
    assert stats.num_blocks == 2 * (KV_BYTES // block_bytes(model, 16, torch.float32))
    log = (logs / "decode.log").read_text()
    assert "dtype='bfloat16'" in log and "device='cpu'" in log
    assert "long_prefill_token_threshold=8" in log
    assert "enable_prefix_caching=False" in log and "role=<EngineRole.DECODE" in log


def test_prefix_caching_off_caches_nothing(cluster) -> None:  # type: ignore[no-untyped-def]
    _, router_address, _ = cluster
    prompt = list(range(5, 69))  # 4 full blocks
    with TandemClient(router_address) as client:
        first = client.generate(prompt, max_tokens=2)
        again = client.generate(prompt, max_tokens=2)
    assert first.prompt_tokens == again.prompt_tokens == 64
    assert again.cached_prompt_tokens == 0  # with prefix caching on, 48 would be cached


def test_routing_settings_reach_the_router_process(cluster) -> None:  # type: ignore[no-untyped-def]
    _, _, logs = cluster
    assert "min_free_block_fraction=0.2" in (logs / "router.log").read_text()


# bf16 keeps 8 bits of mantissa: logits drift from fp32 by a few hundredths of a nat after a
# few layers (measured on the tiny model: at most 0.07). The stated tolerance: until the first
# token where the two differ, every token's logprob is within BF16_TOL of fp32's; and that
# token is a near-tie in fp32 (bf16's pick within BF16_TOL of fp32's best), after which the
# continuations legitimately part.
BF16_TOL = 0.1


def test_bfloat16_worker_agrees_with_float32_within_tolerance(  # type: ignore[no-untyped-def]
    cluster, tiny_model_dir: Path
) -> None:
    import random

    from tandem.config import EngineConfig
    from tandem.engine.engine import LLMEngine
    from tandem.engine.sampling import SamplingParams

    _, router_address, _ = cluster
    rng = random.Random(0)
    prompts = [[rng.randrange(5, 500) for _ in range(rng.randrange(8, 60))] for _ in range(6)]
    reference = LLMEngine(
        EngineConfig(
            str(tiny_model_dir), dtype="float32", cache=CacheConfig(kv_cache_bytes=KV_BYTES)
        )
    )
    want = reference.generate(
        prompts, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=5)
    )
    identical = 0
    with TandemClient(router_address) as client:
        for prompt, ref in zip(prompts, want, strict=True):
            got = client.generate(
                prompt, max_tokens=16, temperature=0.0, ignore_eos=True, logprobs=5
            )
            assert len(got.token_ids) == 16
            split = next(
                (
                    i
                    for i, (a, b) in enumerate(zip(ref.token_ids, got.token_ids, strict=True))
                    if a != b
                ),
                None,
            )
            agreed = range(16 if split is None else split)
            for i in agreed:
                assert abs(got.logprobs[i][1] - ref.logprobs[i][0]) <= BF16_TOL, (prompt, i)
            if split is None:
                identical += 1
            else:
                best, top = ref.logprobs[split]
                assert best - dict(top or ())[got.token_ids[split]] <= BF16_TOL, (prompt, split)
    assert identical >= len(prompts) // 2  # near-ties are the exception, not the rule
