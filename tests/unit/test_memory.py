"""KV cache sizing and the context-fit rule (tandem.engine.memory), exact; and the engine
applying them at startup."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest

from tandem.engine.memory import KVSizing, blocks_for_bytes, fit_context, gpu_kv_bytes

GiB = 2**30


def test_gpu_kv_bytes_is_the_budget_left_after_the_profile_peak() -> None:
    # 100 GiB device at 0.9: 90 GiB; the profile peaked at 20 GiB of which 2 were scratch KV.
    assert gpu_kv_bytes(100 * GiB, 0.9, 20 * GiB, 2 * GiB) == 72 * GiB


def test_gpu_kv_bytes_refuses_when_weights_and_activations_exceed_the_budget() -> None:
    with pytest.raises(ValueError, match=r"peak at 50.00 GiB.*0.5 of 100.00 GiB is 50.00 GiB"):
        gpu_kv_bytes(100 * GiB, 0.5, 51 * GiB, 1 * GiB)


def test_blocks_for_bytes_rounds_down_to_whole_blocks() -> None:
    assert blocks_for_bytes(1000, 96, "kv_cache_bytes", 16) == KVSizing(
        10, 160, 960, "kv_cache_bytes"
    )
    with pytest.raises(ValueError, match="kv_cache_bytes=50 holds no block of 96 bytes"):
        blocks_for_bytes(50, 96, "kv_cache_bytes", 16)


def test_fit_context_keeps_a_context_that_fits() -> None:
    assert fit_context(2048, explicit=True, num_blocks=128, block_size=16, block_bytes=4) == 2048


def test_fit_context_caps_the_models_default_context() -> None:
    assert fit_context(8192, explicit=False, num_blocks=364, block_size=16, block_bytes=4) == 5824


def test_fit_context_refuses_an_explicit_context_with_the_figures() -> None:
    with pytest.raises(ValueError) as err:
        fit_context(8192, explicit=True, num_blocks=364, block_size=16, block_bytes=1024)
    assert str(err.value) == (
        "max_model_len=8192 does not fit the KV cache: 364 blocks x 16 tokens = 5824 tokens "
        "(372736 bytes); give the cache 524288 bytes or more, or lower max_model_len"
    )


def test_engine_caps_and_says_so(
    tiny_model_dir: Path, engine_factory: Any, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO, logger="tandem.engine"):
        engine = engine_factory(tiny_model_dir, block_size=4, num_blocks=16)
    assert engine.max_model_len == 64  # the tiny model's 2048 does not fit 16 x 4 tokens
    assert "serving at most 64 tokens per request" in caplog.text
    assert "16 blocks x 4 tokens = 64 tokens" in caplog.text
    with pytest.raises(ValueError, match="max_model_len"):
        engine.add_request(engine.spec("r", list(range(5, 69))))


def test_engine_refuses_an_explicit_context_that_does_not_fit(
    tiny_model_dir: Path, engine_factory: Any
) -> None:
    with pytest.raises(ValueError, match=r"max_model_len=1024 does not fit the KV cache: 16 "):
        engine_factory(tiny_model_dir, block_size=4, num_blocks=16, max_model_len=1024)


def test_warm_up_leaves_no_trace(tiny_model_dir: Path, engine_factory: Any) -> None:
    engine = engine_factory(tiny_model_dir, block_size=4, num_blocks=64)
    engine.enable_kv_events()
    engine.warm_up()
    assert engine.num_free_blocks() == engine.num_blocks
    assert engine.cached_block_hashes() == [] and engine.take_kv_events() == []
    assert (engine.num_steps, engine.num_tokens_computed) == (0, 0)
    engine.check_integrity()


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_profile_steps_run_the_largest_prefill_and_decode_steps(
    tiny_model_dir: Path, engine_factory: Any, backend: str
) -> None:
    """The GPU sizing path's steps, run on the CPU so that their shapes are checked in CI:
    a prefill of the whole token budget, then max_num_seqs decode rows at the full context
    through a scratch cache of just the prefill's blocks, with the metadata each backend
    reads (Triton: the paged batch; under Triton's interpreter on a CPU)."""
    import torch

    from tandem.engine.profile import profile_steps

    engine = engine_factory(
        tiny_model_dir,
        block_size=4,
        num_blocks=64,
        max_num_batched_tokens=40,
        max_num_seqs=20,
        attention_backend=backend,
    )
    sched = engine.config.scheduler
    scratch_bytes = profile_steps(engine.model, sched, 4, torch.float32, 96, torch.device("cpu"))
    per_block = engine.kv_cache[0].numel() * engine.kv_cache.element_size()
    assert scratch_bytes == 10 * per_block  # 40 tokens / 4 per block
    assert engine.num_free_blocks() == engine.num_blocks  # the engine's own cache untouched
