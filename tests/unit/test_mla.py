"""DeepSeek-V3 (issue 43): multi-head latent attention over the paged cache, its routing, its
checkpoints and its cache's size. Parity with transformers through the engine is in
test_model_parity.py ("deepseek-v3", "deepseek-v3-noqlora")."""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from tandem.engine.kv_cache import block_bytes
from tandem.engine.sampling import SamplingParams
from tandem.model.attention import AttentionMetadata, DecodeGroup, PrefillSpan
from tandem.model.config import ModelConfig
from tandem.model.layer_groups import Mla, layer_groups
from tandem.model.llama import rms_norm
from tandem.model.mla import MlaWeights, mla_forward
from tandem.model.moe import MoeConfig, Routing, route
from tandem.model.rope import RotaryEmbedding, inv_freq
from tests.unit.test_model_parity import RecordingSampler, hf_logits

BLOCK = 4
HEADS, HIDDEN = 4, 64


def _weights(cfg: Mla, gen: torch.Generator) -> MlaWeights:
    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * shape[0] ** -0.5

    q_width = cfg.q_lora_rank or HEADS * cfg.qk_head_dim
    lora = cfg.q_lora_rank is not None
    return MlaWeights.build(
        cfg,
        qkv_a=rand(HIDDEN, q_width + cfg.entry_dim),
        q_a_norm=1 + 0.2 * torch.randn(q_width, generator=gen) if lora else None,
        q_b=rand(q_width, HEADS * cfg.qk_head_dim) if lora else None,
        kv_a_norm=1 + 0.2 * torch.randn(cfg.kv_lora_rank, generator=gen),
        kv_b=rand(cfg.kv_lora_rank, HEADS * (cfg.qk_nope_head_dim + cfg.v_head_dim)),
        o=rand(HEADS * cfg.v_head_dim, HIDDEN),
    )


def _rope(positions: torch.Tensor, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    freqs = positions[:, None].float() * inv_freq(dim, 10000.0, None, torch.device("cpu"))
    emb = torch.cat((freqs, freqs), dim=-1)[:, None]  # [n, 1, dim]
    return emb.cos(), emb.sin()


def _layer(
    x: torch.Tensor, pos: list[int], slots: list[tuple[int, int]], meta: AttentionMetadata,
    w: MlaWeights, cfg: Mla, kv: torch.Tensor,
) -> torch.Tensor:  # fmt: skip
    meta.slot_block_ids = torch.tensor([b for b, _ in slots])
    meta.slot_offsets = torch.tensor([o for _, o in slots])
    rope = _rope(torch.tensor(pos), cfg.qk_rope_head_dim)
    project = lambda a, m: a @ m  # noqa: E731
    return mla_forward(x, w, cfg, HEADS, rope, meta, kv, 0.3, project, rms_norm, 1e-6)


@pytest.mark.parametrize("q_lora_rank", [None, 24])
@pytest.mark.parametrize("interleave", [True, False])
def test_absorbed_decode_equals_the_expanded_form(q_lora_rank, interleave) -> None:
    """Two requests' contexts (13 and 6 tokens) in scattered blocks of a paged cache, written
    by a prefill; then each one's next token attended twice: as rows of one decode group
    (absorbed: W_UK in the query, W_UV after the weighted latents, the shorter row padded and
    masked) and as one-token prefill chunks (expanded through kv_b_proj). Same outputs."""
    gen = torch.Generator().manual_seed(0)
    cfg = Mla(q_lora_rank, 32, 16, 8, 16, interleave)
    w = _weights(cfg, gen)
    # stale data everywhere, under the padding too (masked: weighs nothing)
    kv = torch.randn(12, 2, BLOCK, 1, cfg.cache_head_dim, generator=gen)
    tables = {"a": [5, 2, 9, 0], "b": [7, 3]}
    lens = {"a": 13, "b": 6}
    for r in ("a", "b"):  # prefill each context in one chunk
        n = lens[r]
        blocks = torch.tensor(tables[r])
        meta = AttentionMetadata(torch.empty(0), torch.empty(0))
        meta.prefills = [PrefillSpan(0, n, n, blocks[: -(-n // BLOCK)])]
        slots = [(tables[r][p // BLOCK], p % BLOCK) for p in range(n)]
        _layer(torch.randn(n, HIDDEN, generator=gen), list(range(n)), slots, meta, w, cfg, kv)
    x = torch.randn(2, HIDDEN, generator=gen)
    pos = [lens["a"], lens["b"]]
    slots = [(tables[r][p // BLOCK], p % BLOCK) for r, p in zip("ab", pos, strict=True)]
    padded = torch.tensor([tables["a"], tables["b"] + [4, 4]])  # 4: padding, masked
    meta = AttentionMetadata(torch.empty(0), torch.empty(0))
    meta.decode_groups = [DecodeGroup.build(0, padded, torch.tensor([14, 7]), BLOCK)]
    absorbed = _layer(x, pos, slots, meta, w, cfg, kv.clone())
    for i, r in enumerate("ab"):
        meta = AttentionMetadata(torch.empty(0), torch.empty(0))
        ctx = pos[i] + 1
        meta.prefills = [PrefillSpan(0, 1, ctx, torch.tensor(tables[r][: -(-ctx // BLOCK)]))]
        expanded = _layer(x[i : i + 1], pos[i : i + 1], slots[i : i + 1], meta, w, cfg, kv.clone())
        torch.testing.assert_close(absorbed[i : i + 1], expanded, atol=1e-5, rtol=0)


def _hf_router(num: int, groups: int, topk_groups: int, top_k: int, norm: bool) -> Any:
    import transformers
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    config = transformers.DeepseekV3Config(
        hidden_size=HIDDEN, n_routed_experts=num, n_group=groups, topk_group=topk_groups,
        num_experts_per_tok=top_k, norm_topk_prob=norm, routed_scaling_factor=2.5,
    )  # fmt: skip
    router = DeepseekV3TopkRouter(config)
    with torch.no_grad():
        router.weight.normal_(0.0, 0.3)
        router.e_score_correction_bias.normal_(0.0, 0.1)
    return router


@pytest.mark.parametrize(
    ("num", "groups", "topk_groups", "top_k", "norm"),
    [(8, 2, 1, 3, True), (8, 1, 1, 2, False), (16, 4, 2, 4, True), (32, 8, 4, 8, True)],
)
def test_router_matches_transformers(num, groups, topk_groups, top_k, norm) -> None:
    """Sigmoid scores, the correction bias in the choice only, the best groups by their two
    best experts, top k within them, renormalised or not, times routed_scaling_factor:
    the same experts as DeepseekV3TopkRouter and their weights within 1e-6."""
    torch.manual_seed(num + groups + top_k)
    hf = _hf_router(num, groups, topk_groups, top_k, norm)
    cfg = MoeConfig(
        num_experts=num, top_k=top_k, expert_intermediate_size=8, routing=Routing.SIGMOID_GROUPS,
        norm_topk_prob=norm, sparse_layers=(0,), num_groups=groups, topk_groups=topk_groups,
        routed_scaling=2.5,
    )  # fmt: skip
    x = torch.randn(200, HIDDEN)
    with torch.no_grad():
        _, ref_weights, ref_ids = hf(x)
    bias = hf.e_score_correction_bias.detach()
    got = route(x, hf.weight.detach().t().contiguous(), cfg, bias)
    ids, order = got.expert_ids.sort(dim=-1)
    ref_sorted, ref_order = ref_ids.sort(dim=-1)
    assert torch.equal(ids, ref_sorted)
    weights = got.weights.gather(1, order)
    torch.testing.assert_close(weights, ref_weights.gather(1, ref_order), atol=1e-6, rtol=0)
    if topk_groups == 1:  # every expert of a token from its one best group
        group = ids // (num // groups)
        assert torch.equal(group, group[:, :1].expand_as(group))


def test_routing_config_refusals() -> None:
    base = dict(expert_intermediate_size=8, routing=Routing.SIGMOID_GROUPS, norm_topk_prob=True,
                sparse_layers=(0,))  # fmt: skip
    with pytest.raises(ValueError, match="groups of at least 2"):
        MoeConfig(num_experts=8, top_k=2, num_groups=3, **base)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="exceeds the experts of topk_group"):
        MoeConfig(num_experts=8, top_k=5, num_groups=2, topk_groups=1, **base)  # type: ignore[arg-type]


def _default_raw() -> dict[str, Any]:
    import transformers

    raw = transformers.DeepseekV3Config().to_dict()
    raw["architectures"] = ["DeepseekV3ForCausalLM"]
    return raw


def test_latent_cache_bytes_per_token() -> None:
    """transformers' default DeepseekV3Config (DeepSeek-V3's shape): 61 layers x (512 latent
    + 64 rope key) = 576 elements a layer, 70,272 bytes a token in bfloat16, as one KV head of
    288 whose K and V halves hold the entry; a block of 16 tokens holds 16 times that."""
    cfg = ModelConfig.from_hf(_default_raw())
    assert (cfg.num_kv_heads, cfg.head_dim, cfg.kv_layout.slots) == (1, 288, 61)
    assert cfg.kv_elements_per_token * 2 == 61 * 576 * 2 == 70_272
    assert block_bytes(cfg, 16, torch.bfloat16) == 16 * 70_272
    assert cfg.moe is not None and cfg.moe.sparse_layers == tuple(range(3, 61))
    assert (cfg.moe.num_groups, cfg.moe.topk_groups, cfg.moe.top_k) == (8, 4, 8)
    assert cfg.features.shared_expert_size == 2048 and cfg.features.mtp_layers == 1
    [group] = layer_groups(_default_raw(), 2)  # read from config.json alone (the router's)
    assert group.kv_token_bytes == 576 * 2 and len(group.layers) == 61
    odd = _default_raw() | {"kv_lora_rank": 511}
    with pytest.raises(ValueError, match="must be even"):
        ModelConfig.from_hf(odd)


# DeepSeek-V3's config.json as DeepSeek ships it (the fields this reader uses)
SHIPPED = {
    "architectures": ["DeepseekV3ForCausalLM"], "attention_bias": False,
    "first_k_dense_replace": 3, "hidden_act": "silu", "hidden_size": 7168,
    "intermediate_size": 18432, "kv_lora_rank": 512, "max_position_embeddings": 163840,
    "moe_intermediate_size": 2048, "moe_layer_freq": 1, "n_group": 8, "n_routed_experts": 256,
    "n_shared_experts": 1, "norm_topk_prob": True, "num_attention_heads": 128,
    "num_experts_per_tok": 8, "num_hidden_layers": 61, "num_key_value_heads": 128,
    "num_nextn_predict_layers": 1, "q_lora_rank": 1536, "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64, "rms_norm_eps": 1e-06, "rope_theta": 10000,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
                     "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                     "type": "yarn"},
    "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "topk_group": 4,
    "topk_method": "noaux_tc", "v_head_dim": 128, "vocab_size": 129280,
}  # fmt: skip


def test_deepseek_v3_config_as_shipped() -> None:
    """DeepSeek's own config.json (rope_scaling with "type", scoring_func, topk_method): the
    softmax scale is transformers' (192 ** -0.5 times mscale(40, 1) squared), YaRN's table
    factor mscale(40, 1) / mscale(40, 1) = 1; other scoring or top-k methods are refused."""
    import transformers
    from transformers.modeling_rope_utils import yarn_apply_mscale

    cfg = ModelConfig.from_hf(SHIPPED)
    hf = transformers.DeepseekV3Config(**SHIPPED)
    assert cfg.features.attn_scale == pytest.approx(
        yarn_apply_mscale(hf.rope_parameters, 192**-0.5), rel=1e-12
    )
    assert cfg.rope_scaling is not None and cfg.rope_scaling.attention_factor == 1.0
    assert (cfg.rope_scaling.factor, cfg.rope_scaling.original_max_position_embeddings) == (
        40.0,
        4096,
    )
    assert cfg.kv_elements_per_token * 2 == 70_272 and cfg.max_position_embeddings == 163840
    for field, value in (("scoring_func", "softmax"), ("topk_method", "greedy")):
        with pytest.raises(ValueError, match=f"unsupported {field}"):
            ModelConfig.from_hf(SHIPPED | {field: value})


@pytest.mark.parametrize("arch", ["deepseek-v3", "deepseek-v3-noqlora"])
def test_softmax_scale_and_rope_match_transformers(hf_model, arch) -> None:
    """The softmax scale (with YaRN's mscale_all_dim squared) is transformers' `scaling`, the
    rope tables (qk_rope_head_dim wide, YaRN's attention factor) its rotary module's."""
    model_dir, hf = hf_model(arch)
    cfg = ModelConfig.from_dir(model_dir)
    assert cfg.features.attn_scale == pytest.approx(hf.model.layers[0].self_attn.scaling, 1e-12)
    if arch == "deepseek-v3":
        assert cfg.features.attn_scale != pytest.approx(24**-0.5)  # mscale applies
    positions = torch.arange(0, 300, 7)
    cos, sin = hf.model.rotary_emb(torch.zeros(1), positions[None])
    ours = RotaryEmbedding(cfg, 512, torch.device("cpu"))
    got_cos, got_sin = ours.tables(positions, torch.float32)
    torch.testing.assert_close(got_cos[:, 0], cos[0], atol=0, rtol=0)
    torch.testing.assert_close(got_sin[:, 0], sin[0], atol=0, rtol=0)


def _rewrite(src: Path, out: Path, change: Any) -> Path:
    """A copy of the checkpoint at `src` whose tensors `change(tensors)` edits in place."""
    out.mkdir()
    tensors = load_file(str(src / "model.safetensors"))
    change(tensors)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text((src / "config.json").read_text())
    return out


def _assert_serves_as_transformers(engine_factory: Any, model_dir: Path, hf: Any) -> None:
    engine = engine_factory(model_dir, block_size=4)
    rec = RecordingSampler(engine.runner.sampler)
    engine.runner.sampler = rec
    prompt = random.Random(3).choices(range(256), k=11)
    [done] = engine.generate([prompt], SamplingParams(max_tokens=4, temperature=0.0))
    ref = hf_logits(hf, prompt + done.token_ids)
    for n, row in rec.logits:
        torch.testing.assert_close(row, ref[n - 1], atol=1e-4, rtol=0)


def test_multi_token_prediction_layers_are_skipped(hf_model, engine_factory, tmp_path, caplog):
    """A checkpoint with DeepSeek's MTP layer after the decoder's (model.layers.3.*, as
    num_nextn_predict_layers = 1 says) loads without reading it, says so once, and serves."""
    src, hf = hf_model("deepseek-v3")
    assert json.loads((src / "config.json").read_text())["num_nextn_predict_layers"] == 1

    def add_mtp(t: dict[str, torch.Tensor]) -> None:
        for name in [n for n in t if n.startswith("model.layers.2.")]:
            t[name.replace("layers.2.", "layers.3.")] = t[name].clone()
        for name, shape in (("eh_proj.weight", (HIDDEN, 2 * HIDDEN)), ("enorm.weight", (HIDDEN,)),
                            ("hnorm.weight", (HIDDEN,)), ("shared_head.norm.weight", (HIDDEN,)),
                            ("shared_head.head.weight", (256, HIDDEN))):  # fmt: skip
            t[f"model.layers.3.{name}"] = torch.randn(shape)

    model_dir = _rewrite(src, tmp_path / "mtp", add_mtp)
    with caplog.at_level(logging.INFO, logger="tandem.weights.families"):
        _assert_serves_as_transformers(engine_factory, model_dir, hf)
    lines = [r.getMessage() for r in caplog.records if "multi-token-prediction" in r.getMessage()]
    assert len(lines) == 1 and "model.layers.3.." in lines[0], lines


def stack_experts(model_dir: Path) -> Callable[[dict[str, torch.Tensor]], None]:
    """A `_rewrite` edit stacking each sparse layer's per-expert tensors of `model_dir`'s
    checkpoint as transformers holds them in memory (gate_up_proj [E, 2I, hidden],
    down_proj [E, hidden, I])."""
    moe = ModelConfig.from_dir(model_dir).moe
    assert moe is not None

    def stack(t: dict[str, torch.Tensor]) -> None:
        for i in moe.sparse_layers:
            p = f"model.layers.{i}.mlp.experts."
            experts = range(moe.num_experts)
            gate = [t.pop(f"{p}{e}.gate_proj.weight") for e in experts]
            up = [t.pop(f"{p}{e}.up_proj.weight") for e in experts]
            t[p + "gate_up_proj"] = torch.stack(
                [torch.cat(gu) for gu in zip(gate, up, strict=True)]
            )
            t[p + "down_proj"] = torch.stack([t.pop(f"{p}{e}.down_proj.weight") for e in experts])

    return stack


def test_stacked_experts_checkpoint_serves_as_per_expert(hf_model, engine_factory, tmp_path):
    """Experts stacked as transformers holds them in memory (mlp.experts.gate_up_proj [E, 2I,
    hidden], down_proj [E, hidden, I]) load into the same layout as DeepSeek's per-expert
    tensors: the same logits as transformers."""
    src, hf = hf_model("deepseek-v3")
    stacked = _rewrite(src, tmp_path / "stacked", stack_experts(src))
    _assert_serves_as_transformers(engine_factory, stacked, hf)


def test_refusals(hf_model, engine_factory) -> None:
    """What MLA does not serve yet says so: heads that do not split evenly over the
    tensor-parallel ranks, an FP8 latent cache, quantized weights. `auto` on CUDA stays torch
    for it (its Triton decode is unmeasured)."""
    from tandem.model.triton_attention import make_attention
    from tandem.parallel.sharding import check_shardable

    model_dir, _ = hf_model("deepseek-v3")
    cfg = ModelConfig.from_dir(model_dir)
    check_shardable(cfg, 2)  # tests/unit/test_tensor_parallel_mla.py
    with pytest.raises(ValueError, match="multi-head latent attention splits its 4 heads"):
        check_shardable(cfg, 3)
    assert cfg.features.mla is not None
    assert make_attention("triton", "cpu", mla=cfg.features.mla).mla is cfg.features.mla
    assert not make_attention("auto", "cuda", mla=cfg.features.mla).needs_paged_batch
    with pytest.raises(ValueError, match="kv_cache_dtype fp8"):
        engine_factory(model_dir, kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match="unquantized"):
        engine_factory(model_dir, quantization="int8")


def test_byte_budget_and_profile_steps_size_the_latent_cache(hf_model, engine_factory) -> None:
    """A CPU byte budget buys blocks of the latent's bytes (4 tokens x 3 layers x 40
    float32s = 1,920 bytes a block); the GPU sizing's profile steps run the MLA layers."""
    from tandem.config import SchedulerConfig
    from tandem.engine.profile import profile_steps
    from tests.unit.test_model_parity import hf_greedy

    model_dir, hf = hf_model("deepseek-v3-noqlora")
    engine = engine_factory(model_dir, block_size=4, num_blocks=None, kv_cache_bytes=1920 * 50)
    assert engine.num_blocks == 50
    sched = SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=32)
    assert profile_steps(engine.model, sched, 4, torch.float32, 64, torch.device("cpu")) > 0
    prompt = random.Random(8).choices(range(256), k=9)
    [done] = engine.generate([prompt], SamplingParams(max_tokens=3, temperature=0.0))
    assert done.token_ids == hf_greedy(hf, prompt, 3)


def test_latent_cache_travels_in_an_in_process_hand_off(hf_model, engine_factory) -> None:
    """Prefill and decode roles in one process: the prefill engine computes the prompt's
    latents, its blocks are copied as a transport would (one KV head of 20: each token's
    32 latent + 8 rope numbers per layer), and the decode engine continues from them in the
    absorbed form exactly as the single engine, greedy and seeded, with and without a
    prefix of the prompt cached at the decode side."""
    from tandem.config import EngineRole
    from tests.unit.test_engine import disaggregated

    model_dir, _ = hf_model("deepseek-v3")
    full = engine_factory(model_dir, block_size=4)
    prefill = engine_factory(model_dir, block_size=4, role=EngineRole.PREFILL)
    decode = engine_factory(model_dir, block_size=4, role=EngineRole.DECODE)
    assert tuple(decode.kv_cache.shape[1:]) == (3, 2, 4, 1, 20)
    rng = random.Random(7)
    shared = rng.choices(range(256), k=12)
    prompts = [rng.choices(range(256), k=n) for n in (2, 9, 23)] + [shared + [1], shared + [2, 3]]
    for i, prompt in enumerate(prompts):
        for params in (
            SamplingParams(max_tokens=8, temperature=0.0),
            SamplingParams(max_tokens=8, temperature=0.8, seed=5),
        ):
            [ref] = full.generate([prompt], params)
            got = disaggregated(prefill, decode, f"h{i}-{params.seed}", prompt, params)
            assert got == ref.token_ids, (i, params)
    for e in (full, prefill, decode):
        e.check_integrity()
        assert e.num_free_blocks() == e.num_blocks


@pytest.mark.parametrize("arch", ["deepseek-v3", "deepseek-v3-noqlora"])
def test_triton_backend_serves_as_transformers(hf_model, engine_factory, arch, monkeypatch):
    """attention_backend triton (the kernels under the interpreter here): decode rows through
    the MLA decode kernel over the paged batch, prefill chunks expanded from the spans the
    runner builds alongside it; chunked prefills over prefix hits and decodes give
    transformers' greedy answers, and the decode logits its logits."""
    from tandem.kernels import mla_decode
    from tests.unit.test_model_parity import hf_greedy

    launches: list[int] = []
    kernel = mla_decode.mla_decode_attention

    def counted(q_lat: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        launches.append(q_lat.shape[0])
        return kernel(q_lat, *args, **kwargs)

    monkeypatch.setattr(mla_decode, "mla_decode_attention", counted)
    model_dir, hf = hf_model(arch)
    engine = engine_factory(
        model_dir, block_size=4, attention_backend="triton", max_num_batched_tokens=8
    )
    assert engine.model.attention.needs_paged_batch and engine.runner.graphs is None
    shared = random.Random(arch).choices(range(256), k=9)
    prompts = [shared + random.Random(i).choices(range(256), k=3 + 5 * i) for i in range(3)]
    engine.generate(prompts[:1], SamplingParams(max_tokens=1, temperature=0.0))  # cache it
    rec = RecordingSampler(engine.runner.sampler)
    engine.runner.sampler = rec
    done = engine.generate(prompts, SamplingParams(max_tokens=5, temperature=0.0))
    assert done[1].num_cached_tokens == 8
    assert [d.token_ids for d in done] == [hf_greedy(hf, p, 5) for p in prompts]
    assert max(launches) == 3  # the three rows' decodes in one launch per layer
    ref = hf_logits(hf, prompts[2] + done[2].token_ids)
    rows = [(n, row) for n, row in rec.logits if n > len(prompts[2])]
    assert rows
    for n, row in rows[-3:]:
        if n <= len(ref):
            torch.testing.assert_close(row, ref[n - 1], atol=1e-4, rtol=0)
