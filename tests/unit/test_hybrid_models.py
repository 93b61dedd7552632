"""Gemma 3 and gpt-oss (issue 42): their configs as shipped, YaRN and Gemma's rope tables
against transformers', and gpt-oss's MXFP4 experts (dequantized exactly, served as
transformers serves the same values)."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import pytest
import torch

from tandem.engine.sampling import SamplingParams
from tandem.model.config import ModelConfig
from tandem.model.rope import RotaryEmbedding
from tandem.weights.families import E2M1_VALUES, dequantize_mxfp4


def _base(arch: str, **extra: Any) -> dict[str, Any]:
    raw = dict(
        architectures=[arch], vocab_size=256, hidden_size=64, intermediate_size=128,
        num_hidden_layers=6, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    )  # fmt: skip
    return {**raw, **extra}


def test_gemma3_config_as_shipped_before_layer_types() -> None:
    """gemma-3-1b's config.json (transformers 4.5x): no layer_types, a pattern of 6, the
    local base in rope_local_base_freq, the global layers' linear scaling in rope_scaling."""
    cfg = ModelConfig.from_hf(_base(
        "Gemma3ForCausalLM", sliding_window=512, sliding_window_pattern=6, rope_theta=1e6,
        rope_local_base_freq=1e4, rope_scaling={"rope_type": "linear", "factor": 8.0},
        query_pre_attn_scalar=256, hidden_activation="gelu_pytorch_tanh",
    ))  # fmt: skip
    f = cfg.features
    assert f.layer_windows == (512, 512, 512, 512, 512, None)
    assert f.offset_norms and not f.sinks and f.activation == "gelu_tanh"
    assert f.embed_scale == 8.0 and f.attn_scale == 256**-0.5
    assert cfg.rope_theta == 1e6 and cfg.rope_scaling is not None
    assert cfg.rope_scaling.rope_type == "linear" and cfg.rope_scaling.factor == 8.0
    assert f.local_rope == (1e4, None)
    assert cfg.qk_norm and not cfg.qkv_bias


def test_gpt_oss_config_defaults_and_refusals() -> None:
    cfg = ModelConfig.from_hf(_base(
        "GptOssForCausalLM", num_local_experts=8, num_experts_per_tok=2, sliding_window=128,
        rope_scaling={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0,
                      "beta_slow": 1.0, "truncate": False,
                      "original_max_position_embeddings": 4096},
    ))  # fmt: skip
    f = cfg.features
    # transformers' default pattern: sliding on even layers, full on odd ones
    assert f.layer_windows == (128, None, 128, None, 128, None)
    assert f.sinks and f.o_bias and cfg.qkv_bias and not f.offset_norms
    assert cfg.rope_theta == 150000.0
    assert cfg.moe is not None and cfg.moe.biases and cfg.moe.swiglu_limit == 7.0
    sc = cfg.rope_scaling
    assert sc is not None and sc.rope_type == "yarn" and not sc.truncate
    assert sc.attention_factor == pytest.approx(0.1 * torch.log(torch.tensor(32.0)).item() + 1)
    with pytest.raises(ValueError, match="layer_types"):
        ModelConfig.from_hf(_base("GptOssForCausalLM", num_local_experts=8,
                                  num_experts_per_tok=2, sliding_window=8,
                                  layer_types=["chunked_attention"] * 6))  # fmt: skip
    with pytest.raises(ValueError, match="sliding_window"):
        ModelConfig.from_hf(_base("Gemma3ForCausalLM", sliding_window=None))
    with pytest.raises(ValueError, match="use_bidirectional_attention"):
        ModelConfig.from_hf(_base("Gemma3ForCausalLM", sliding_window=8,
                                  use_bidirectional_attention=True))  # fmt: skip
    with pytest.raises(ValueError, match="one rank only"):
        from tandem.parallel.sharding import check_shardable

        check_shardable(cfg, 2)


@pytest.mark.parametrize("arch", ["gpt-oss", "gemma3"])
def test_rope_tables_match_transformers(hf_model, arch) -> None:
    """cos/sin of every layer kind (YaRN with its attention factor; Gemma's local base and
    the global layers' linear scaling), bit for bit against transformers' rotary module."""
    model_dir, hf = hf_model(arch)
    cfg = ModelConfig.from_dir(model_dir)
    positions = torch.arange(0, 300, 7)
    x = torch.zeros(1, dtype=torch.float32)
    rotary = hf.model.rotary_emb
    kinds = ["full_attention", "sliding_attention"] if arch == "gemma3" else [None]
    for kind in kinds:
        args = (kind,) if kind else ()
        cos, sin = rotary(x, positions[None], *args)
        ours = RotaryEmbedding(cfg, 512, torch.device("cpu"), local=kind == "sliding_attention")
        got_cos, got_sin = ours.tables(positions, torch.float32)
        half = cfg.head_dim // 2
        if arch == "gpt-oss":  # its table holds each frequency once (no duplicated halves)
            torch.testing.assert_close(got_cos[:, 0, :half], cos[0], atol=0, rtol=0)
            torch.testing.assert_close(got_sin[:, 0, :half], sin[0], atol=0, rtol=0)
        else:
            torch.testing.assert_close(got_cos[:, 0], cos[0], atol=0, rtol=0)
            torch.testing.assert_close(got_sin[:, 0], sin[0], atol=0, rtol=0)


def _quantize_mxfp4(w: torch.Tensor, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., out, in] -> random MXFP4 blocks [..., out, in / 32, 16] and scales: values drawn
    from the e2m1 grid, scales 2^-3..2^1, so dequantization has one exact answer."""
    *lead, out, inp = w.shape
    nib = torch.randint(0, 16, (*lead, out, inp // 32, 32), generator=gen, dtype=torch.uint8)
    blocks = nib[..., 0::2] | (nib[..., 1::2] << 4)
    scales = torch.randint(124, 129, (*lead, out, inp // 32), generator=gen, dtype=torch.uint8)
    return blocks, scales


def test_mxfp4_dequantization_matches_transformers() -> None:
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    gen = torch.Generator().manual_seed(3)
    blocks, scales = _quantize_mxfp4(torch.empty(3, 8, 64), gen)
    ours = dequantize_mxfp4(blocks, scales)  # [3, 8, 64]
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [3, 64, 8]
    torch.testing.assert_close(ours, theirs.transpose(1, 2), atol=0, rtol=0)
    # nibble 0x3 (1.5) low then 0xA (-1.0) high, scale 2^(128 - 127)
    one = dequantize_mxfp4(torch.full((1, 1, 16), 0xA3, dtype=torch.uint8),
                           torch.full((1, 1), 128, dtype=torch.uint8))  # fmt: skip
    assert one[0, :2].tolist() == [3.0, -2.0] and E2M1_VALUES[0xA] == -1.0


def _mxfp4_checkpoint(src: Path, hf: Any, out: Path) -> dict[str, torch.Tensor]:
    """`src`'s gpt-oss checkpoint with its experts in MXFP4, as OpenAI ships them, written
    to `out`; returns `hf`'s state with those experts dequantized."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(src / "model.safetensors"))
    gen = torch.Generator().manual_seed(4)
    state = {k: v.clone() for k, v in hf.state_dict().items()}
    for name in [n for n in tensors if n.endswith(("gate_up_proj", "down_proj"))]:
        w = tensors.pop(name).transpose(1, 2)  # [E, out, in]
        blocks, scales = _quantize_mxfp4(w, gen)
        tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales
        state[name] = dequantize_mxfp4(blocks, scales).transpose(1, 2).contiguous()
    save_file(tensors, str(out / "model.safetensors"))
    raw = json.loads((src / "config.json").read_text())
    raw["quantization_config"] = {"quant_method": "mxfp4"}
    (out / "config.json").write_text(json.dumps(raw))
    return state


def test_gpt_oss_mxfp4_checkpoint_serves_as_transformers(hf_model, engine_factory, tmp_path):
    """A gpt-oss checkpoint with MXFP4 experts, as OpenAI ships them: the engine's logits
    equal transformers' on the same (dequantized) weights."""
    src, hf = hf_model("gpt-oss")
    state = _mxfp4_checkpoint(src, hf, tmp_path)
    import copy

    ref = copy.deepcopy(hf)
    ref.load_state_dict(state)
    engine = engine_factory(tmp_path, block_size=4)
    seen: list[torch.Tensor] = []
    inner = engine.runner.sampler

    def record(logits: torch.Tensor, rows: Any) -> Any:
        seen.append(logits[0].clone())
        return inner(logits, rows)

    engine.runner.sampler = record
    prompt = random.Random(9).choices(range(256), k=11)
    [done] = engine.generate([prompt], SamplingParams(max_tokens=3, temperature=0.0))
    with torch.no_grad():
        full = torch.tensor([prompt + done.token_ids])
        fresh = ref(full).logits[0, len(prompt) - 1 : -1]
        stale = hf(full).logits[0, len(prompt) - 1 : -1]
    torch.testing.assert_close(torch.stack(seen), fresh, atol=1e-4, rtol=0)
    assert not torch.allclose(stale, fresh, atol=1e-2)  # the MXFP4 values are what served


def test_mxfp4_experts_load_in_4_bits_for_the_kernel(hf_model, tmp_path) -> None:
    """Where the fused MoE kernel decodes MXFP4 (CUDA: the loader's `keep_4bit`), gpt-oss's
    experts load as shipped, a quarter of bf16's bytes: their packed gate | up (de-interleaved
    with its scales) and down, through the kernel (the interpreter here), give what the
    dequantized experts give."""
    from tandem.kernels.fused_moe import fused_moe
    from tandem.weights.families import gpt_oss_experts
    from tandem.weights.safetensors_io import TensorReader, read_header

    src, hf = hf_model("gpt-oss")
    _mxfp4_checkpoint(src, hf, tmp_path)
    config = ModelConfig.from_dir(tmp_path)
    assert config.moe is not None
    entries = read_header(tmp_path / "model.safetensors")
    cpu, bf16, experts = torch.device("cpu"), torch.bfloat16, range(config.moe.num_experts)
    with TensorReader(entries, [n for n in entries if ".layers.0.mlp." in n], None) as reader:
        kept = gpt_oss_experts(reader, config, 0, experts, True, bf16, cpu, keep_4bit=True)
        dense = gpt_oss_experts(reader, config, 0, experts, True, bf16, cpu)
    assert kept.gate_up.dtype == torch.uint8 and kept.gate_up_scales is not None
    assert kept.gate_up.numel() * 4 == dense.gate_up.numel() * 2  # 4 bits against 16
    assert dense.gate_up_scales is None
    g = torch.Generator().manual_seed(2)
    x = torch.randn(9, config.hidden_size, generator=g).to(bf16)
    scores = torch.rand(9, config.moe.num_experts, generator=g)
    weights, ids = torch.topk(torch.softmax(scores, -1), config.moe.top_k, dim=-1)
    common = dict(gate_up_bias=dense.gate_up_bias, down_bias=dense.down_bias,
                  swiglu_limit=config.moe.swiglu_limit)  # fmt: skip
    got = fused_moe(x, kept.gate_up, kept.down, ids, weights, gate_up_scales=kept.gate_up_scales,
                    down_scales=kept.down_scales, **common)  # fmt: skip
    want = fused_moe(x, dense.gate_up, dense.down, ids, weights, **common)
    torch.testing.assert_close(got, want, atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("arch", ["gpt-oss", "gemma3"])
def test_triton_backend_serves_windows_and_sinks(hf_model, engine_factory, arch) -> None:
    """The Triton kernels (under the interpreter here) with windows and sinks: chunked
    prefills over prefix hits and decodes past the windows give transformers' greedy
    answers."""
    from tests.unit.test_model_parity import hf_greedy

    model_dir, hf = hf_model(arch)
    engine = engine_factory(
        model_dir, block_size=4, attention_backend="triton", max_num_batched_tokens=8
    )
    shared = random.Random(arch).choices(range(256), k=9)
    prompts = [shared + random.Random(i).choices(range(256), k=3 + 5 * i) for i in range(3)]
    engine.generate(prompts[:1], SamplingParams(max_tokens=1, temperature=0.0))  # cache it
    done = engine.generate(prompts, SamplingParams(max_tokens=5, temperature=0.0))
    assert done[1].num_cached_tokens == 8
    assert [d.token_ids for d in done] == [hf_greedy(hf, p, 5) for p in prompts]


def test_model_dir_type_hint(tmp_path: Path) -> None:
    """A Gemma 3 multimodal checkpoint (Gemma3ForConditionalGeneration) is refused by name."""
    (tmp_path / "config.json").write_text(
        json.dumps({"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3"})
    )
    with pytest.raises(ValueError, match="Gemma3ForConditionalGeneration"):
        ModelConfig.from_dir(tmp_path)


@pytest.mark.parametrize("num_tokens", [1, 5, 64, 150])  # within, at and across chunks
def test_chunked_delta_rule_equals_the_recurrence(num_tokens: int) -> None:
    """The chunked (WY) form over a request's tokens, from a non-zero state, equals the
    token-by-token recurrence, outputs and final state; and both equal transformers'
    reference functions on the same inputs."""
    from transformers.models.qwen3_next.modeling_qwen3_next import (
        torch_chunk_gated_delta_rule,
    )

    from tandem.model.linear_attention import chunk_rule, l2norm, recurrent_step

    g = torch.Generator().manual_seed(num_tokens)
    heads, kd, vd = 3, 8, 6
    q = l2norm(torch.randn(num_tokens, heads, kd, generator=g)) * kd**-0.5
    k = l2norm(torch.randn(num_tokens, heads, kd, generator=g))
    v = torch.randn(num_tokens, heads, vd, generator=g)
    decay = -torch.rand(num_tokens, heads, generator=g) * 2  # log space, <= 0
    beta = torch.rand(num_tokens, heads, generator=g)
    s0 = torch.randn(heads, kd, vd, generator=g) * 0.3
    state, outs = s0[None], []
    for t in range(num_tokens):
        o, state = recurrent_step(q[t : t + 1], k[t : t + 1], v[t : t + 1],
                                  decay[t : t + 1], beta[t : t + 1], state)  # fmt: skip
        outs.append(o[0])
    got, final = chunk_rule(q, k, v, decay, beta, s0)
    torch.testing.assert_close(got, torch.stack(outs), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(final, state[0], atol=1e-5, rtol=1e-5)
    # transformers' chunked reference (it normalises and scales q, k itself: pass raw ones
    # whose normalised forms are ours)
    ref, ref_state = torch_chunk_gated_delta_rule(
        (q * kd**0.5)[None], k[None], v[None], g=decay[None], beta=beta[None],
        initial_state=s0[None], output_final_state=True, use_qk_l2norm_in_kernel=True,
    )  # fmt: skip
    torch.testing.assert_close(got, ref[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(final, ref_state[0], atol=1e-5, rtol=1e-5)


def test_linear_models_resume_a_prefix_from_its_state_checkpoint(hf_model, engine_factory) -> None:
    """Qwen3-Next with prefix caching: a prompt sharing a cached prefix resumes from the state
    checkpoint the first request took mid-chunk at that prefix's last block boundary, with
    transformers' greedy tokens; with the checkpoint gone (the pages still cached) it is a
    miss; and a request arriving past its first token without a state (as a hand-off would
    bring one) is refused, not served."""
    from tandem.engine.runner import StepRow
    from tests.unit.test_model_parity import hf_greedy

    model_dir, hf = hf_model("qwen3-next")
    engine = engine_factory(model_dir, block_size=4)
    # pages only for the attention layers: the linear layers' state is outside the cache
    cfg = engine.model.config
    assert engine.kv_cache.shape[1] == len(cfg.kv_layers) == cfg.num_layers - 3
    shared = random.Random(5).choices(range(256), k=12)
    first, second = shared + [1, 2, 3], shared + [7, 8, 9]
    engine.generate([first], SamplingParams(max_tokens=1, temperature=0.0))
    [done] = engine.generate([second], SamplingParams(max_tokens=4, temperature=0.0))
    assert (done.num_cached_tokens, engine.runner.num_state_restores) == (12, 1)
    assert done.token_ids == hf_greedy(hf, second, 4)
    assert engine.kv.checkpoints is not None
    engine.kv.checkpoints.clear()
    [again] = engine.generate([second], SamplingParams(max_tokens=4, temperature=0.0))
    assert (again.num_cached_tokens, again.token_ids) == (0, done.token_ids)
    assert engine.runner.num_state_restores == 1
    row = StepRow("handed-off", 12, 1, (0, 1, 2, 3), True, [5])
    with pytest.raises(RuntimeError, match="without its linear-attention state"):
        engine.runner.prepare_rows([row])


def test_a_preempted_linear_request_resumes_from_a_checkpoint(hf_model, engine_factory) -> None:
    """Two Qwen3-Next requests outgrow 12 blocks: the later one is preempted, and resumes
    from the cached blocks its preemption left and the state checkpoint its decode steps
    took there, not from zero; both continue as transformers does."""
    from tests.unit.test_model_parity import assert_batch_matches_hf

    model_dir, hf = hf_model("qwen3-next")
    engine = engine_factory(model_dir, block_size=4, num_blocks=12)
    rng = random.Random(9)
    cases = [(rng.choices(range(256), k=10), 20) for _ in range(2)]
    assert_batch_matches_hf(engine, hf, cases, preempts=True)
    assert engine.runner.num_state_restores > 0


def test_profile_steps_run_linear_models(hf_model, engine_factory) -> None:
    """The GPU sizing's profile steps (a full-budget prefill, max_num_seqs decode rows) run
    a Qwen3-Next model too, in slots reserved at load; whatever the slots hold after, a
    request starts from a zeroed one."""
    from tandem.config import SchedulerConfig
    from tandem.engine.profile import profile_steps
    from tests.unit.test_model_parity import hf_greedy

    model_dir, hf = hf_model("qwen3-next")
    engine = engine_factory(model_dir, block_size=4, max_num_seqs=6)
    states = engine.model.linear_states
    assert states is not None and states.num_slots >= 6  # reserved at load
    sched = SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=32)
    states.recurrent.fill_(7.0)  # stale: a request must start from zeros whatever it holds
    states.conv.fill_(7.0)
    assert profile_steps(engine.model, sched, 4, torch.float32, 64, torch.device("cpu")) > 0
    prompt = random.Random(8).choices(range(256), k=9)
    [done] = engine.generate([prompt], SamplingParams(max_tokens=3, temperature=0.0))
    assert done.token_ids == hf_greedy(hf, prompt, 3)


def test_linear_state_travels_in_an_in_process_hand_off(hf_model, engine_factory) -> None:
    """Qwen3-Next, prefill and decode roles in one process: the prefill engine packs the
    request's state after its pages (`RequestOutput.state_blocks`), the decode engine reads
    both (blocks copied as a transport would) and continues exactly as the single engine,
    greedy and seeded sampling, with and without a prefix of the prompt cached locally;
    every block free at the end, the state's blocks included."""
    from tandem.config import EngineRole
    from tandem.engine.request import Resume
    from tests.unit.test_engine import copy_blocks

    model_dir, _ = hf_model("qwen3-next")
    full = engine_factory(model_dir, block_size=4)
    prefill = engine_factory(model_dir, block_size=4, role=EngineRole.PREFILL)
    decode = engine_factory(model_dir, block_size=4, role=EngineRole.DECODE)
    assert prefill.state_handoff is not None and decode.state_handoff is not None
    rng = random.Random(11)
    shared = rng.choices(range(256), k=12)
    prompts = [rng.choices(range(256), k=n) for n in (3, 17)] + [shared + [1], shared + [2, 3]]
    for i, prompt in enumerate(prompts):
        for params in (
            SamplingParams(max_tokens=6, temperature=0.0),
            SamplingParams(max_tokens=6, temperature=0.8, seed=3),
        ):
            rid = f"h{i}-{params.seed}"
            [ref] = full.generate([prompt], params)
            prefill.add_request(prefill.spec(rid, prompt, params))
            [out] = [o for o in prefill.step() if o.request_id == rid]
            assert out.handed_off and out.state_blocks == prefill.state_handoff.num_blocks
            src = out.block_ids
            spec = decode.spec(rid, prompt, params)
            reserved = decode.reserve_kv(spec, Resume(tuple(out.new_token_ids)))
            assert reserved is not None
            table, cached = reserved
            state = decode.state_handoff.reserve(rid)
            assert state is not None
            first = cached // 4
            pages = len(src) - out.state_blocks
            copy_blocks(prefill, src[first:pages] + src[pages:], decode, table[first:] + state)
            decode.commit_kv(rid)
            request = decode._requests[rid]
            assert prefill.release(rid)
            while decode.has_unfinished():
                decode.step()
            assert request.output_token_ids == ref.token_ids, rid
    from tandem.engine.footprint import engine_footprint

    for e in (full, prefill, decode):
        e.check_integrity()
        assert e.num_free_blocks() == e.num_blocks
        # no request's state outlives it (slots, positions, reserved state blocks)
        sizes = engine_footprint(e)
        assert {"linear_state_slots", "state_handoff_reserved"} <= set(sizes)
        assert all(s.entries == 0 for s in sizes.values() if s.bound is None), sizes
        ckpts = sizes["linear_state_checkpoints"]
        assert ckpts.bound is not None and 0 < ckpts.entries <= ckpts.bound
