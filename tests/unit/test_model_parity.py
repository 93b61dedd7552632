"""Numerical parity with HuggingFace transformers on the same weights (fp32, atol 1e-4)."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from tandem.engine.sampling import SampleResult, SampleRow, SamplingParams
from tandem.model.config import ModelConfig

ARCHS = ["llama", "llama3-rope-tied", "mistral", "qwen2", "qwen3", "qwen3-moe", "mixtral",
         "gpt-oss", "gemma3", "qwen3-next", "deepseek-v3", "deepseek-v3-noqlora"]  # fmt: skip
# DeepSeek-V3's multi-head latent attention: prefill chunks expanded, decode rows absorbed
MLA = ["deepseek-v3", "deepseek-v3-noqlora"]
ATOL = 1e-4


class RecordingSampler:
    """Wraps the engine's sampler and keeps each row's logits, keyed by output position."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.logits: list[tuple[int, torch.Tensor]] = []  # (num tokens before, logits row)

    def __call__(self, logits: torch.Tensor, rows: list[SampleRow]) -> list[SampleResult]:
        for i, row in enumerate(rows):
            n = len(row.prompt_token_ids) + len(row.output_token_ids)
            self.logits.append((n, logits[i].clone()))
        return self.inner(logits, rows)


def hf_logits(model: Any, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def hf_greedy(model: Any, prompt: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
        )
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("chunk", [None, 5])
def test_prefill_and_decode_logits_match_hf(hf_model, engine_factory, arch, chunk) -> None:
    model_dir, hf = hf_model(arch)
    kwargs = {} if chunk is None else {"max_num_batched_tokens": chunk}
    engine = engine_factory(model_dir, block_size=4, **kwargs)
    rec = RecordingSampler(engine.runner.sampler)
    engine.runner.sampler = rec
    prompt = random.Random(arch).choices(range(256), k=13)
    [done] = engine.generate([prompt], SamplingParams(max_tokens=6, temperature=0.0))
    full = prompt + done.token_ids
    ref = hf_logits(hf, full)
    assert len(rec.logits) == 6
    for n, row in rec.logits:  # logits after n tokens predict token n
        torch.testing.assert_close(row, ref[n - 1], atol=ATOL, rtol=0)
    assert done.token_ids == hf_greedy(hf, prompt, 6)


@pytest.mark.parametrize(
    "arch", ["llama", "qwen3", "qwen3-moe", "mixtral", "gpt-oss", "gemma3", "qwen3-next", *MLA]
)
def test_prefix_cache_hit_logits_match_hf(hf_model, engine_factory, arch) -> None:
    """A second request that starts after cached blocks still computes the same logits."""
    model_dir, hf = hf_model(arch)
    engine = engine_factory(model_dir, block_size=4)
    rec = RecordingSampler(engine.runner.sampler)
    engine.runner.sampler = rec
    shared = random.Random(1).choices(range(256), k=12)
    engine.generate([shared + [1, 2, 3]], SamplingParams(max_tokens=1, temperature=0.0))
    rec.logits.clear()
    second = shared + [7, 8, 9, 10, 11]
    [done] = engine.generate([second], SamplingParams(max_tokens=4, temperature=0.0))
    assert done.num_cached_tokens == 12
    ref = hf_logits(hf, second + done.token_ids)
    for n, row in rec.logits:
        torch.testing.assert_close(row, ref[n - 1], atol=ATOL, rtol=0)


def _mixed_prompts(n: int, seed: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [(rng.choices(range(256), k=rng.randint(1, 40)), rng.randint(1, 20)) for _ in range(n)]


@pytest.mark.parametrize(
    "arch",
    ["llama", "qwen2", "qwen3", "qwen3-moe", "mixtral", "gpt-oss", "gemma3", "qwen3-next", *MLA],
)
@pytest.mark.parametrize(
    "mode",
    ["chunked", "preemption"],
)
def test_concurrent_greedy_token_identical(hf_model, engine_factory, arch, mode) -> None:
    model_dir, hf = hf_model(arch)
    if mode == "chunked":
        # A 16-token budget splits most prompts across steps, mixed with decodes.
        engine = engine_factory(model_dir, block_size=4, max_num_batched_tokens=16)
    else:
        # 20 blocks of 4 tokens cannot hold 16 requests of up to 60 tokens at once (a
        # hybrid model's blocks hold one KV table's layers each: as many bytes in all).
        tables = ModelConfig.from_dir(model_dir).kv_layout.num_tables
        engine = engine_factory(model_dir, block_size=4, num_blocks=20 * tables)
    cases = _mixed_prompts(16, seed=sum(map(ord, arch)))
    assert_batch_matches_hf(engine, hf, cases, preempts=mode == "preemption")


def assert_batch_matches_hf(
    engine: Any, hf: Any, cases: list[tuple[list[int], int]], preempts: bool
) -> None:
    """All `cases` (prompt, new tokens) in the engine at once, greedy, the block accounting
    checked after every step: each output is HF's greedy continuation, some request was
    preempted when `preempts`, and every block is free at the end."""
    for i, (prompt, n) in enumerate(cases):
        engine.add_request(
            engine.spec(f"r{i}", prompt, SamplingParams(max_tokens=n, temperature=0.0))
        )
    requests = dict(engine._requests)
    while engine.has_unfinished():
        engine.step()
        engine.check_integrity()
    if preempts:
        assert sum(r.num_preemptions for r in requests.values()) > 0
    for i, (prompt, n) in enumerate(cases):
        got = requests[f"r{i}"].output_token_ids
        assert got == hf_greedy(hf, prompt, n), f"request r{i} diverged"
    assert engine.num_free_blocks() == engine.num_blocks
    engine.check_integrity()
