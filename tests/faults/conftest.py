"""Fixtures of the fault-matrix suite: one `Fleet` (benchmarks/fleet.py) for the whole
package, its tiny model, and the single-process engine the outputs are compared with."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from benchmarks.fleet import KV_BYTES, Fleet
from benchmarks.fleet import MAX_INFLIGHT as MAX_INFLIGHT  # re-exported for the tests
from benchmarks.fleet import WAIT_S as WAIT_S  # re-exported for the tests
from tandem.config import CacheConfig, EngineConfig
from tandem.engine.engine import LLMEngine
from tandem.engine.sampling import SamplingParams
from tandem.weights.tiny import make_tiny_model


@pytest.fixture(scope="package")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("faults") / "tiny", preset="tiny")


@pytest.fixture(scope="package")
def fleet(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    f = Fleet(model_dir, tmp_path_factory.mktemp("fleet"))
    try:
        f.start()
        yield f
    finally:
        f.stop()


@pytest.fixture(scope="package")
def reference(model_dir: Path) -> Callable[[list[list[int]], int], list[list[int]]]:
    """Greedy token ids of the single-process engine on the same weights."""
    engine = LLMEngine(
        EngineConfig(
            model_dir=str(model_dir), dtype="float32", cache=CacheConfig(kv_cache_bytes=KV_BYTES)
        )
    )

    def generate(prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        return [out.token_ids for out in engine.generate(prompts, params)]

    return generate
