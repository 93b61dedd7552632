"""Shared factories: tiny random HF models (saved once per session) and engines over them."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.hf_models import build_hf_model

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Every worker a test starts checks its KV block accounting each second and counts a reaped
# orphan as a violation (WorkerConfig.kv_audit_strict): GetStats.num_audit_violations.
os.environ.setdefault("TANDEM_KV_AUDIT_STRICT", "1")
# Workers and `tandem up` clusters that tests start run in float32 (TANDEM_DTYPE, as a user
# would set it) unless a test passes --dtype: "auto" is bfloat16 on a CPU that runs it
# natively, and the tests' token-exact references must not depend on the CPU they run on.
# tests/unit/test_linear.py checks "auto" and the bfloat16 path itself.
os.environ.setdefault("TANDEM_DTYPE", "float32")
# Triton kernels run on CPU tensors through Triton's interpreter when there is no GPU. Triton
# reads this when it is first imported, so it is set before any test imports a kernel.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
# One intra-op thread in the test process: tests assert no timings, and a 2-thread OpenMP
# pool on a loaded 2-core CI machine was seen to hang inside a tiny matmul (worker processes
# started by tests keep their own defaults).
torch.set_num_threads(1)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Run the container image build last: committing and archiving a multi-GB image leaves
    the disk busy writing back for a while, which the timing-sensitive service tests that
    would otherwise follow it should not share."""
    items.sort(key=lambda item: "tests/deploy/test_image.py" in item.nodeid)


@pytest.fixture(scope="session")
def hf_model(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], tuple[Path, Any]]:
    """hf_model(arch) -> (model dir, transformers model), built once per session."""
    cache: dict[str, tuple[Path, Any]] = {}

    def get(arch: str) -> tuple[Path, Any]:
        if arch not in cache:
            out = tmp_path_factory.mktemp(f"hf-{arch}")
            cache[arch] = (out, build_hf_model(arch, out))
        return cache[arch]

    return get


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The embedded default model generator's `tiny` preset (with tokenizer)."""
    from tandem.weights.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny-model"), preset="tiny", seed=0)


def make_engine(model_dir: Path, **overrides: Any) -> Any:
    """An engine over `model_dir`; overrides: block_size, num_blocks (None: sized by
    kv_cache_bytes), kv_cache_bytes, max_num_seqs, max_num_batched_tokens,
    long_prefill_token_threshold, enable_prefix_caching, and any EngineConfig field."""
    from tandem.config import CacheConfig, EngineConfig, SchedulerConfig
    from tandem.engine.engine import LLMEngine

    # float32 unless a test asks: references must not depend on whether this CPU runs
    # bfloat16 natively (dtype "auto"; CI's may not).
    overrides.setdefault("dtype", "float32")
    cache = CacheConfig(
        block_size=overrides.pop("block_size", 4),
        num_blocks=overrides.pop("num_blocks", 256),
        enable_prefix_caching=overrides.pop("enable_prefix_caching", True),
        **{
            k: overrides.pop(k)
            for k in ("kv_cache_bytes", "kv_host_bytes", "kv_disk_dir", "kv_disk_bytes")
            if k in overrides
        },
    )
    sched_keys = (
        "max_num_seqs",
        "max_num_batched_tokens",
        "long_prefill_token_threshold",
        "max_model_len",
    )
    sched = SchedulerConfig(**{k: overrides.pop(k) for k in sched_keys if k in overrides})
    return LLMEngine(
        EngineConfig(model_dir=str(model_dir), cache=cache, scheduler=sched, **overrides)
    )


@pytest.fixture(scope="session")
def engine_factory() -> Callable[..., Any]:
    return make_engine
