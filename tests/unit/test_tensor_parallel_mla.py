"""Tensor parallelism for DeepSeek-V3 (issue 43): multi-head latent attention's heads split
over the ranks (q_b / q_proj, kv_b and with it W_UK / W_UV, o), the latent replicated (every
rank computes it and caches it: the one KV head on every rank), the routed experts' and the
shared experts' columns split, the group-limited router on every rank alike. TP=2 against
one rank and transformers: logits within 1e-5 (test_tensor_parallel.py's tolerance), greedy
tokens identical; with exact sums one rank's bit for bit."""

from __future__ import annotations

import random

import pytest
import torch

from tandem.model.config import ModelConfig
from tandem.parallel.sharding import (
    Shard,
    TensorSlice,
    check_shardable,
    kv_heads,
    local_config,
    q_heads,
    tensor_slices,
)
from tests.unit.test_model_parity import hf_greedy, hf_logits
from tests.unit.test_tensor_parallel import ATOL, run_recorded

MLA = ["deepseek-v3", "deepseek-v3-noqlora"]


def test_mla_split_heads_and_replicated_latent(hf_model) -> None:
    """4 heads over 2 ranks: 2 each, the latent's one KV head on both; each rank's rows of
    q_b (24 a head), kv_b (32 a head: k_nope 16 | v 16), columns of o (16 a head) or, with
    exact sums, o's hidden rows; the shared experts' columns and the experts' as MoE's."""
    model_dir, _ = hf_model("deepseek-v3")
    cfg = ModelConfig.from_dir(model_dir)
    check_shardable(cfg, 2)
    assert [q_heads(cfg, Shard(r, 2)) for r in range(2)] == [range(0, 2), range(2, 4)]
    assert [kv_heads(cfg, Shard(r, 2)) for r in range(2)] == [range(0, 1)] * 2
    local = local_config(cfg, Shard(1, 2))
    assert (local.num_q_heads, local.num_kv_heads) == (2, 1)
    assert local.head_dim == cfg.head_dim and local.moe is not None
    assert local.moe.expert_intermediate_size == 16
    s = tensor_slices(cfg, Shard(1, 2))
    a = "model.layers.1.self_attn."
    assert s[a + "q_b_proj.weight"] == TensorSlice(0, 48, 96)
    assert s[a + "kv_b_proj.weight"] == TensorSlice(0, 64, 128)
    assert s[a + "o_proj.weight"] == TensorSlice(1, 32, 64)
    for name in ("q_a_proj", "kv_a_proj_with_mqa", "q_a_layernorm", "kv_a_layernorm"):
        assert a + name + ".weight" not in s
    assert s["model.layers.1.mlp.shared_experts.gate_proj.weight"] == TensorSlice(0, 16, 32)
    assert s["model.layers.1.mlp.shared_experts.down_proj.weight"] == TensorSlice(1, 16, 32)
    assert s["model.layers.1.mlp.experts.3.up_proj.weight"] == TensorSlice(0, 16, 32)
    assert s["model.layers.0.mlp.down_proj.weight"] == TensorSlice(1, 64, 128)
    exact = tensor_slices(cfg, Shard(1, 2, exact_sums=True))
    assert exact[a + "o_proj.weight"] == TensorSlice(0, 32, 64)
    with pytest.raises(ValueError, match="splits its 4 heads evenly"):
        check_shardable(cfg, 3)


@pytest.mark.parametrize("exact", [True, False], ids=["exact-sums", "megatron"])
@pytest.mark.parametrize("arch", MLA)
def test_mla_tp2_matches_one_rank_and_hf(hf_model, engine_factory, arch, exact):
    """Chunked prefill (chunks of 5, expanded), absorbed decode, a prefix-cache hit: TP=2's
    logits within 1e-5 of one rank's and transformers', greedy tokens identical."""
    model_dir, hf = hf_model(arch)
    rng = random.Random(arch)
    shared = rng.choices(range(256), k=12)
    prompts = [rng.choices(range(256), k=13), shared + [1, 2, 3], shared + [7, 8, 9, 10]]
    results = []
    for size in (1, 2):
        engine = engine_factory(
            model_dir, tensor_parallel_size=size, max_num_batched_tokens=5, block_size=4,
            tp_exact_sums=exact,
        )  # fmt: skip
        try:
            results.append([run_recorded(engine, [p], 6) for p in prompts])
            engine.check_integrity()
        finally:
            engine.close()
    assert results[1][2][0][0].num_cached_tokens == 12
    for prompt, (one, _), (two, _) in zip(prompts, *results, strict=True):
        assert one[0].token_ids == two[0].token_ids == hf_greedy(hf, prompt, 6)
    for (one_done, one_rec), (_, two_rec) in zip(*results, strict=True):
        ref = hf_logits(hf, one_done[0].prompt_token_ids + one_done[0].token_ids)
        for (n, a), (m, b) in zip(one_rec.logits, two_rec.logits, strict=True):
            assert n == m
            torch.testing.assert_close(b, a, atol=ATOL, rtol=0)
            torch.testing.assert_close(b, ref[n - 1], atol=1e-4, rtol=0)


@pytest.mark.parametrize("stacked", [False, True], ids=["per-expert", "stacked"])
def test_mla_expert_parallel_and_stacked_experts(hf_model, engine_factory, tmp_path, stacked):
    """Expert parallelism (each rank 4 of the 8 experts whole, the shared experts' columns
    split) and a checkpoint of stacked experts (cut per rank as loaded): TP=2 as one rank."""
    from tests.unit.test_mla import _rewrite, stack_experts

    src, _ = hf_model("deepseek-v3")
    model_dir = _rewrite(src, tmp_path / "stacked", stack_experts(src)) if stacked else src
    prompt = random.Random(5).choices(range(256), k=11)
    one = run_recorded(engine_factory(src, block_size=4), [prompt], 5)
    for ep in (False, True):
        engine = engine_factory(
            model_dir, tensor_parallel_size=2, block_size=4, expert_parallel=ep,
            tp_exact_sums=False,
        )  # fmt: skip
        try:
            two = run_recorded(engine, [prompt], 5)
        finally:
            engine.close()
        assert two[0][0].token_ids == one[0][0].token_ids
        for (n, a), (m, b) in zip(one[1].logits, two[1].logits, strict=True):
            assert n == m
            torch.testing.assert_close(b, a, atol=ATOL, rtol=0)
