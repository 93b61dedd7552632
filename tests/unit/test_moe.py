"""Mixture-of-experts pieces: config parsing of sparse layers, routing, and the grouped
expert computation against the per-expert loop (transformers' way)."""

from __future__ import annotations

import pytest
import torch

from tandem.model.config import ModelConfig
from tandem.model.moe import (
    MoeConfig,
    MoeWeights,
    Routed,
    Routing,
    activation,
    grouped_experts,
    looped_experts,
    route,
)
from tandem.parallel.sharding import check_shardable


def _raw(arch: str, **extra: object) -> dict[str, object]:
    base = dict(
        architectures=[arch], vocab_size=256, hidden_size=64, intermediate_size=128,
        num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2,
    )  # fmt: skip
    return {**base, **extra}


def test_qwen3_moe_sparse_layers_follow_step_and_dense_list() -> None:
    cfg = ModelConfig.from_hf(
        _raw("Qwen3MoeForCausalLM", num_experts=8, num_experts_per_tok=2,
             moe_intermediate_size=32, decoder_sparse_step=2, mlp_only_layers=[3])
    )  # fmt: skip
    assert cfg.moe is not None and cfg.qk_norm
    assert cfg.moe.sparse_layers == (1, 5)  # (i + 1) % 2 == 0, less layer 3
    assert cfg.moe.routing is Routing.SOFTMAX_TOPK and not cfg.moe.norm_topk_prob
    mixtral = ModelConfig.from_hf(_raw("MixtralForCausalLM", num_local_experts=4,
                                       num_experts_per_tok=2))  # fmt: skip
    assert mixtral.moe is not None and mixtral.moe.sparse_layers == tuple(range(6))
    assert mixtral.moe.expert_intermediate_size == 128
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        ModelConfig.from_hf(_raw("MixtralForCausalLM", num_local_experts=4, num_experts_per_tok=5))
    check_shardable(mixtral, 2)
    with pytest.raises(ValueError, match="experts' intermediate size"):
        check_shardable(ModelConfig.from_hf(_raw("MixtralForCausalLM", num_local_experts=4,
                        num_experts_per_tok=2, intermediate_size=1)), 2)  # fmt: skip


def _moe(num_experts: int, hidden: int, inter: int, seed: int) -> MoeWeights:
    g = torch.Generator().manual_seed(seed)
    return MoeWeights(
        router=torch.randn(hidden, num_experts, generator=g),
        gate_up=torch.randn(num_experts, hidden, 2 * inter, generator=g) / hidden**0.5,
        down=torch.randn(num_experts, inter, hidden, generator=g) / inter**0.5,
    )


@pytest.mark.parametrize("num_experts,top_k", [(1, 1), (4, 2), (8, 3)])
@pytest.mark.parametrize("hidden,inter", [(64, 32), (12, 6)])  # 12 x 6: not grouped_mm-aligned
@pytest.mark.parametrize("num_tokens", [1, 7, 33])
def test_grouped_equals_per_expert_loop(num_experts, top_k, hidden, inter, num_tokens) -> None:
    w = _moe(num_experts, hidden, inter, seed=num_experts * 100 + num_tokens)
    x = torch.randn(num_tokens, hidden, generator=torch.Generator().manual_seed(num_tokens))
    cfg = MoeConfig(num_experts, top_k, inter, Routing.SOFTMAX_TOPK, True, (0,))
    routed = route(x, w.router, cfg)
    want = looped_experts(x, routed, w, cfg)
    torch.testing.assert_close(grouped_experts(x, routed, w, cfg), want, atol=1e-5, rtol=1e-5)
    # every token to expert 0 (the others idle), and to the last expert
    for e in (0, num_experts - 1):
        ids = torch.full((num_tokens, top_k), e)
        skew = Routed(ids, torch.rand(num_tokens, top_k))
        torch.testing.assert_close(
            grouped_experts(x, skew, w, cfg), looped_experts(x, skew, w, cfg), atol=1e-5, rtol=1e-5
        )


def test_expert_parallel_shares_add_up_to_the_whole() -> None:
    """Ranks holding experts [0, 3) and [3, 6) of 6 (grouped_experts over their pairs
    only) sum to the whole layer."""
    w = _moe(6, 64, 32, seed=5)
    x = torch.randn(23, 64, generator=torch.Generator().manual_seed(5))
    cfg = MoeConfig(6, 2, 32, Routing.SOFTMAX_TOPK, True, (0,))
    routed = route(x, w.router, cfg)
    parts = [
        MoeWeights(w.router, w.gate_up[lo:hi], w.down[lo:hi], first_expert=lo)
        for lo, hi in ((0, 3), (3, 6))
    ]
    total = sum(grouped_experts(x, routed, p, cfg) for p in parts)
    torch.testing.assert_close(total, looped_experts(x, routed, w, cfg), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(
        grouped_experts(x, routed, parts[1], cfg), looped_experts(x, routed, parts[1], cfg)
    )


def test_gpt_oss_experts_match_transformers() -> None:
    """The router's bias, the experts' biases and the clamped SwiGLU, grouped, against
    transformers' GptOssMLP on the same weights (its gate and up interleaved; ours fused
    gate | up, as the loader de-interleaves them)."""
    import transformers
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    hf_cfg = transformers.GptOssConfig(hidden_size=16, intermediate_size=8, num_local_experts=4,
                                       num_experts_per_tok=2, swiglu_limit=0.5)  # fmt: skip
    torch.manual_seed(0)
    mlp = GptOssMLP(hf_cfg).eval()
    with torch.no_grad():
        for p in mlp.parameters():
            p.normal_(0.0, 1.0)  # wide enough that the 0.5 clamp bites on both sides
    ex = mlp.experts
    gu, gub = ex.gate_up_proj.detach(), ex.gate_up_proj_bias.detach()
    w = MoeWeights(
        router=mlp.router.weight.detach().t(),
        gate_up=torch.cat((gu[..., ::2], gu[..., 1::2]), -1),
        down=ex.down_proj.detach(),
        router_bias=mlp.router.bias.detach(),
        gate_up_bias=torch.cat((gub[..., ::2], gub[..., 1::2]), -1),
        down_bias=ex.down_proj_bias.detach(),
    )
    cfg = MoeConfig(4, 2, 8, Routing.TOPK_SOFTMAX, True, (0,), biases=True, swiglu_limit=0.5)
    x = torch.randn(9, 16)
    with torch.no_grad():
        want = mlp(x.unsqueeze(0))[0][0]
    routed = route(x, w.router, cfg, w.router_bias)
    torch.testing.assert_close(grouped_experts(x, routed, w, cfg), want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(looped_experts(x, routed, w, cfg), want, atol=1e-5, rtol=1e-5)
    clamped = activation(torch.tensor([[2.0, -2.0]]), cfg)  # gate 2 -> 0.5, up -2 -> -0.5
    assert clamped.item() == pytest.approx(0.5 * 0.5 * torch.sigmoid(torch.tensor(0.851)).item())


def test_routing_rules() -> None:
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    router = torch.eye(4)
    mixtral = MoeConfig(4, 2, 8, Routing.TOPK_SOFTMAX, True, (0,))
    ids, weights = route(logits, router, mixtral)
    assert ids.tolist() == [[0, 1]]
    torch.testing.assert_close(weights, torch.softmax(torch.tensor([[2.0, 1.0]]), -1))
    qwen = MoeConfig(4, 2, 8, Routing.SOFTMAX_TOPK, False, (0,))
    ids, weights = route(logits, router, qwen)
    torch.testing.assert_close(weights, torch.softmax(logits, -1)[:, :2])  # not renormalised
    assert weights.sum() < 0.95


def test_worker_metrics_count_tokens_routed_per_expert(hf_model, engine_factory) -> None:
    from prometheus_client import CollectorRegistry

    from tandem.engine.sampling import SamplingParams
    from tandem.services.common.observe.metrics import WorkerMetrics

    model_dir, _ = hf_model("qwen3-moe")
    engine = engine_factory(model_dir, block_size=4)
    metrics = WorkerMetrics("decode", registry=CollectorRegistry())
    prompt = list(range(10, 31))
    engine.generate([prompt], SamplingParams(max_tokens=5, temperature=0.0))
    metrics.after_step(engine, 0.0)
    moe = engine.model.config.moe
    assert moe.sparse_layers == (0,)  # layer 1 is dense (mlp_only_layers)

    def routed(layer: int, expert: int) -> float | None:
        labels = {"role": "decode", "layer": str(layer), "expert": str(expert)}
        return metrics.registry.get_sample_value("tandem_worker_moe_routed_tokens_total", labels)

    counts = [routed(0, e) for e in range(moe.num_experts)]
    # the prompt's 21 tokens, then 4 decoded ones fed back, each to top_k experts
    assert sum(c or 0 for c in counts) == (len(prompt) + 4) * moe.top_k
    assert sum(1 for c in counts if c) > 1  # spread over experts
    assert routed(1, 0) is None


def test_cost_model_takes_active_parameters() -> None:
    from tandem.sim import H200, LLAMA_8B, QWEN3_30B_A3B, ModelSpec, RooflineCost, cost_model

    moe = QWEN3_30B_A3B
    assert moe.weight_bytes_read(1) == pytest.approx(moe.active_params * 2)
    assert moe.weight_bytes_read(10_000) == pytest.approx(moe.weight_bytes)  # every expert
    assert moe.weight_bytes_read(1) < moe.weight_bytes_read(8) < moe.weight_bytes_read(64)
    dense_same_total = ModelSpec("dense-30b", moe.num_params, 48, 32, 4, 128)
    a, d = cost_model("h200-moe"), RooflineCost(H200, dense_same_total)
    assert isinstance(a, RooflineCost) and a.model is moe
    # long prefills are compute-bound: FLOPs of 3.3B active, not 30.5B, parameters
    ratio = (a.prefill_step_s(8192) - a.step_overhead_s) / (
        d.prefill_step_s(8192) - d.step_overhead_s
    )
    assert ratio == pytest.approx(3.3 / 30.5)
    assert a.decode_step_s(1, 1000) < d.decode_step_s(1, 1000)  # reads 8 of 128 experts
    assert LLAMA_8B.weight_bytes_read(1) == LLAMA_8B.weight_bytes
    with pytest.raises(ValueError, match="active parameters"):
        ModelSpec("bad", 1e9, 2, 2, 2, 64, num_active_params=2e9, num_experts=8, top_k=2)


@pytest.mark.parametrize("arch", ["qwen3-moe", "mixtral"])
@pytest.mark.parametrize("split", ["columns", "experts", "experts-attention-replicated"])
def test_tp2_matches_tp1_and_hf(hf_model, engine_factory, arch, split) -> None:
    """Two ranks (gloo); the experts split by columns (each rank half of every expert's)
    or, with expert parallelism, whole (each rank 4 of the 8, the others' never read), with
    attention split by heads (TP=2) or replicated. Prefill in chunks of 5, decode and a
    prefix hit give logits within 1e-5 of one rank's and 1e-4 of transformers', greedy
    tokens identical."""
    expert_parallel = split != "columns"
    replicated = split == "experts-attention-replicated"
    import random

    from tests.unit.test_model_parity import hf_greedy, hf_logits
    from tests.unit.test_tensor_parallel import run_recorded

    model_dir, hf = hf_model(arch)
    rng = random.Random(arch)
    shared = rng.choices(range(256), k=12)
    prompts = [rng.choices(range(256), k=13), shared + [1, 2, 3], shared + [7, 8, 9, 10]]
    one = engine_factory(model_dir, max_num_batched_tokens=5)
    two = engine_factory(
        model_dir, max_num_batched_tokens=5, tensor_parallel_size=2,
        expert_parallel=expert_parallel, replicate_attention=replicated,
    )  # fmt: skip
    try:
        heads = one.model.config.num_kv_heads
        assert two.model.config.num_kv_heads == (heads if replicated else heads // 2)
        lw = two.model.weights.layers[0].moe
        moe = one.model.config.moe
        if expert_parallel:  # rank 0: experts 0-3 whole
            assert lw.first_expert == 0 and lw.gate_up.shape[0] == moe.num_experts // 2
            assert lw.gate_up.shape[2] == 2 * moe.expert_intermediate_size
        else:  # every expert, half its columns
            assert lw.gate_up.shape[0] == moe.num_experts
            assert lw.gate_up.shape[2] == moe.expert_intermediate_size
        for prompt in prompts:
            (a,), rec_a = run_recorded(one, [prompt], 6)
            (b,), rec_b = run_recorded(two, [prompt], 6)
            assert a.token_ids == b.token_ids == hf_greedy(hf, prompt, 6)
            ref = hf_logits(hf, prompt + a.token_ids)
            for (n, x), (m, y) in zip(rec_a.logits, rec_b.logits, strict=True):
                assert n == m
                torch.testing.assert_close(y, x, atol=1e-5, rtol=0)
                torch.testing.assert_close(y, ref[n - 1], atol=1e-4, rtol=0)
        assert b.num_cached_tokens == 12
    finally:
        two.close()
