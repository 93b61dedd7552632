"""What Gemma 3, gpt-oss, Qwen3-Next and DeepSeek-V3 checkpoints store beyond the Llama
layout, and how it loads.

Gemma 3   per layer four norms: input_layernorm, post_attention_layernorm (on the
          attention's output), pre_feedforward_layernorm, post_feedforward_layernorm (on
          the MLP's output), and q_norm / k_norm; every norm's weight w is applied as
          1 + w in float32 (`norm`).
gpt-oss   o_proj's bias, self_attn.sinks [q_heads], the router (mlp.router, with a bias)
          and the experts as stacked tensors: mlp.experts.gate_up_proj [E, hidden, 2I]
          with gate and up interleaved column by column, its bias [E, 2I], down_proj
          [E, I, hidden] and its bias [E, hidden]. As OpenAI ships them (config.json's
          quantization_config.quant_method "mxfp4") the two expert matrices are MXFP4
          instead: `<name>_blocks` [E, out, in / 32, 16] uint8, two e2m1 values per byte
          (low nibble first), and `<name>_scales` [E, out, in / 32] uint8, each block of
          32 inputs scaled by 2^(scale - 127). On CUDA they stay in 4 bits
          (`pack_mxfp4`: the fused MoE kernel decodes them tile by tile); elsewhere they
          are dequantized as they load (`dequantize_mxfp4`): exactly, every e2m1 value
          times a power of two being a bfloat16.
DeepSeek-V3  MLA's self_attn: q_a_proj, q_a_layernorm, q_b_proj (or q_proj without
          q_lora_rank), kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj, o_proj (`mla_layer`);
          a sparse layer's router mlp.gate.weight with its e_score_correction_bias (both
          read in float32, as transformers keeps them), the shared experts
          mlp.shared_experts.{gate,up,down}_proj (ungated), and the routed experts either
          per expert as DeepSeek ships them and transformers saves them
          (mlp.experts.{e}.{gate,up,down}_proj.weight) or stacked as transformers holds
          them in memory (mlp.experts.gate_up_proj [E, 2I, hidden], mlp.experts.down_proj
          [E, hidden, I]; `fused_experts`). The multi-token-prediction layers after the
          decoder's (model.layers.{num_hidden_layers}.., DeepSeek's MTP) are never read.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Collection
from pathlib import Path
from typing import Protocol

import torch

from tandem.model.config import DEEPSEEK_V3, ModelConfig
from tandem.model.linear_attention import LinearWeights
from tandem.model.mla import MlaWeights
from tandem.model.moe import MoeWeights, expert_names
from tandem.quant.weight import WeightScheme

log = logging.getLogger(__name__)

GPT_OSS = "GptOssForCausalLM"

# The 16 e2m1 values by nibble: sign bit, two exponent bits, one mantissa bit.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
               -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)  # fmt: skip
MXFP4_BLOCK = 32  # inputs per scale


class Reader(Protocol):
    def read(self, name: str) -> torch.Tensor: ...


def is_mxfp4(model_dir: Path) -> bool:
    """Whether config.json declares OpenAI's MXFP4 experts (quant_method "mxfp4")."""
    raw = json.loads((Path(model_dir) / "config.json").read_text())
    qc = raw.get("quantization_config") if isinstance(raw, dict) else None
    return isinstance(qc, dict) and str(qc.get("quant_method", "")).lower() == "mxfp4"


def layer_shapes(
    config: ModelConfig, layer: int, mxfp4: bool, fused_experts: bool = False
) -> dict[str, tuple[int, ...]]:
    """The tensors of layer `layer` that Gemma 3, gpt-oss, Qwen3-Next or DeepSeek-V3 adds to
    the Llama ones (a gpt-oss or DeepSeek-V3 sparse layer's experts: in place of Llama's
    MLP; DeepSeek-V3's MLA in place of q/k/v/o)."""
    feat, hid = config.features, config.hidden_size
    p = f"model.layers.{layer}."
    shapes: dict[str, tuple[int, ...]] = {}
    if feat.o_bias:
        shapes[p + "self_attn.o_proj.bias"] = (hid,)
    if feat.sinks:
        shapes[p + "self_attn.sinks"] = (config.num_q_heads,)
    if feat.sandwich_norms:
        shapes[p + "pre_feedforward_layernorm.weight"] = (hid,)
        shapes[p + "post_feedforward_layernorm.weight"] = (hid,)
    if layer in feat.linear_layers:
        assert feat.linear is not None
        c = feat.linear
        k_all, v_all = c.num_k_heads * c.k_dim, c.num_v_heads * c.v_dim
        la = p + "linear_attn."
        shapes[la + "in_proj_qkvz.weight"] = (2 * k_all + 2 * v_all, hid)
        shapes[la + "in_proj_ba.weight"] = (2 * c.num_v_heads, hid)
        shapes[la + "conv1d.weight"] = (c.conv_channels, 1, c.conv_kernel)
        shapes[la + "dt_bias"] = (c.num_v_heads,)
        shapes[la + "A_log"] = (c.num_v_heads,)
        shapes[la + "norm.weight"] = (c.v_dim,)
        shapes[la + "out_proj.weight"] = (hid, v_all)
    sparse = config.moe is not None and layer in config.moe.sparse_layers
    if feat.mla is not None:
        shapes.update(mla_shapes(config, layer))
    if config.architecture == DEEPSEEK_V3 and sparse:
        shapes.update(deepseek_expert_shapes(config, layer, fused_experts))
    elif feat.shared_expert_size and sparse:
        s = feat.shared_expert_size
        shapes[p + "mlp.shared_expert.gate_proj.weight"] = (s, hid)
        shapes[p + "mlp.shared_expert.up_proj.weight"] = (s, hid)
        shapes[p + "mlp.shared_expert.down_proj.weight"] = (hid, s)
        shapes[p + "mlp.shared_expert_gate.weight"] = (1, hid)
    if config.architecture == GPT_OSS:
        assert config.moe is not None
        num, inter = config.moe.num_experts, config.moe.expert_intermediate_size
        e = p + "mlp."
        shapes[e + "router.weight"] = (num, hid)
        shapes[e + "router.bias"] = (num,)
        for name, out, inp in (("gate_up_proj", 2 * inter, hid), ("down_proj", hid, inter)):
            if mxfp4:
                if inp % MXFP4_BLOCK:
                    raise ValueError(f"MXFP4 {name}: {inp} inputs is not a multiple of 32")
                groups = inp // MXFP4_BLOCK
                shapes[e + f"experts.{name}_blocks"] = (num, out, groups, MXFP4_BLOCK // 2)
                shapes[e + f"experts.{name}_scales"] = (num, out, groups)
            else:
                shapes[e + f"experts.{name}"] = (num, inp, out)
            shapes[e + f"experts.{name}_bias"] = (num, out)
    return shapes


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """MXFP4 [..., out, groups, 16] uint8 blocks and [..., out, groups] uint8 scales ->
    [..., out, groups * 32] float32, exactly."""
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=blocks.device)
    values = torch.stack((lut[(blocks & 0x0F).long()], lut[(blocks >> 4).long()]), dim=-1)
    values = values.flatten(-2)  # [..., out, groups, 32]: low nibble, high nibble, ...
    values = torch.ldexp(values, (scales.to(torch.int32) - 127).unsqueeze(-1))
    return values.flatten(-2)


def pack_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """MXFP4 [..., out, groups, 16] blocks and [..., out, groups] scales as the fused MoE
    kernel reads them (tandem.kernels.fused_moe): bytes [..., in / 2, out] and scales
    [..., groups, out], each a matrix [in, out] like every other, still 4 bits a value."""
    packed = blocks.flatten(-2).transpose(-1, -2).contiguous()
    return packed, scales.transpose(-1, -2).contiguous()


def gpt_oss_experts(
    reader: Reader,
    config: ModelConfig,
    layer: int,
    experts: range,
    mxfp4: bool,
    dtype: torch.dtype,
    device: torch.device,
    keep_4bit: bool = False,
) -> MoeWeights:
    """Layer `layer`'s router and experts `experts` in our layout: matrices [in, out], gate
    and up de-interleaved into gate | up (the grouped GEMM's layout), biases alike. MXFP4
    experts are dequantized, or with `keep_4bit` (the loader's choice on CUDA) kept in 4 bits
    (`pack_mxfp4`: the fused MoE kernel decodes them)."""
    p = f"model.layers.{layer}.mlp."

    def load(name: str, dt: torch.dtype = dtype, stacked: bool = True) -> torch.Tensor:
        # this layer's experts only; a view of the reader's buffer, copied before the next read
        t = reader.read(p + name)
        t = t[experts.start : experts.stop] if stacked else t
        return t.to(device=device, dtype=dt, copy=True)

    def matrix(name: str) -> tuple[torch.Tensor, torch.Tensor | None]:
        """[E, in, out], and its MXFP4 scales when it stays in 4 bits (else None)."""
        if not mxfp4:
            return load(f"experts.{name}"), None
        blocks = load(f"experts.{name}_blocks", torch.uint8)
        scales = load(f"experts.{name}_scales", torch.uint8)
        if keep_4bit:
            return pack_mxfp4(blocks, scales)
        return dequantize_mxfp4(blocks, scales).to(dtype).transpose(1, 2).contiguous(), None

    def deinterleave(t: torch.Tensor) -> torch.Tensor:
        return torch.cat((t[..., 0::2], t[..., 1::2]), dim=-1).contiguous()

    gate_up, gate_up_scales = matrix("gate_up_proj")
    down, down_scales = matrix("down_proj")
    return MoeWeights(
        router=load("router.weight", stacked=False).t().contiguous(),  # [hidden, E]
        gate_up=deinterleave(gate_up),
        down=down,
        first_expert=experts.start,
        router_bias=load("router.bias", stacked=False),
        gate_up_bias=deinterleave(load("experts.gate_up_proj_bias")),
        down_bias=load("experts.down_proj_bias"),
        gate_up_scales=None if gate_up_scales is None else deinterleave(gate_up_scales),
        down_scales=down_scales,
    )


def mla_shapes(config: ModelConfig, layer: int) -> dict[str, tuple[int, ...]]:
    """An MLA layer's self_attn tensors (DeepSeek-V3)."""
    m, hid, heads = config.features.mla, config.hidden_size, config.num_q_heads
    assert m is not None
    a = f"model.layers.{layer}.self_attn."
    shapes: dict[str, tuple[int, ...]] = {}
    if m.q_lora_rank is not None:
        shapes[a + "q_a_proj.weight"] = (m.q_lora_rank, hid)
        shapes[a + "q_a_layernorm.weight"] = (m.q_lora_rank,)
        shapes[a + "q_b_proj.weight"] = (heads * m.qk_head_dim, m.q_lora_rank)
    else:
        shapes[a + "q_proj.weight"] = (heads * m.qk_head_dim, hid)
    shapes[a + "kv_a_proj_with_mqa.weight"] = (m.entry_dim, hid)
    shapes[a + "kv_a_layernorm.weight"] = (m.kv_lora_rank,)
    shapes[a + "kv_b_proj.weight"] = (heads * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank)
    shapes[a + "o_proj.weight"] = (hid, heads * m.v_head_dim)
    return shapes


def fused_experts(config: ModelConfig, names: Collection[str]) -> bool:
    """Whether a DeepSeek-V3 checkpoint stores its experts stacked (transformers' in-memory
    layout, module doc) rather than one tensor per expert."""
    if config.architecture != DEEPSEEK_V3 or config.moe is None or not config.moe.sparse_layers:
        return False
    return f"model.layers.{config.moe.sparse_layers[0]}.mlp.experts.gate_up_proj" in names


def deepseek_expert_shapes(
    config: ModelConfig, layer: int, fused: bool
) -> dict[str, tuple[int, ...]]:
    """A DeepSeek-V3 sparse layer's router, correction bias, experts and shared experts."""
    assert config.moe is not None
    num, inter = config.moe.num_experts, config.moe.expert_intermediate_size
    hid = config.hidden_size
    p = f"model.layers.{layer}.mlp."
    shapes: dict[str, tuple[int, ...]] = {
        p + "gate.weight": (num, hid),
        p + "gate.e_score_correction_bias": (num,),
    }
    if fused:
        shapes[p + "experts.gate_up_proj"] = (num, 2 * inter, hid)
        shapes[p + "experts.down_proj"] = (num, hid, inter)
    else:
        for e in range(num):
            gate, up, down = expert_names(DEEPSEEK_V3, layer, e)
            shapes.update({gate: (inter, hid), up: (inter, hid), down: (hid, inter)})
    if config.features.shared_expert_size:
        s = config.features.shared_expert_size
        shapes[p + "shared_experts.gate_proj.weight"] = (s, hid)
        shapes[p + "shared_experts.up_proj.weight"] = (s, hid)
        shapes[p + "shared_experts.down_proj.weight"] = (hid, s)
    return shapes


def mla_layer(
    reader: Reader, config: ModelConfig, layer: int, dtype: torch.dtype, device: torch.device
) -> MlaWeights:
    """Layer `layer`'s MLA weights (DeepSeek-V3), W_UK and W_UV split out of kv_b_proj."""
    m = config.features.mla
    assert m is not None
    a = f"model.layers.{layer}.self_attn."

    def matrix(*names: str) -> torch.Tensor:
        """The named [out, in] tensors' rows, concatenated and transposed: [in, out]."""
        rows = [reader.read(a + n + ".weight").to(device=device, dtype=dtype, copy=True)
                for n in names]  # fmt: skip
        return torch.cat(rows).t().contiguous()

    lora = m.q_lora_rank is not None
    return MlaWeights.build(
        m,
        qkv_a=matrix("q_a_proj" if lora else "q_proj", "kv_a_proj_with_mqa"),
        q_a_norm=norm(reader, a + "q_a_layernorm.weight", False, dtype, device) if lora else None,
        q_b=matrix("q_b_proj") if lora else None,
        kv_a_norm=norm(reader, a + "kv_a_layernorm.weight", False, dtype, device),
        kv_b=matrix("kv_b_proj"),
        o=matrix("o_proj"),
    )


def deepseek_experts(
    reader: Reader,
    config: ModelConfig,
    layer: int,
    fused: bool,
    dtype: torch.dtype,
    device: torch.device,
    mine: range | None = None,
    columns: range | None = None,
) -> MoeWeights:
    """A DeepSeek-V3 sparse layer in our layout: the router [hidden, E] and correction
    bias in float32, experts [E, hidden, 2I] (gate | up) and [E, I, hidden], the shared
    experts ungated; from per-expert tensors or stacked ones (`fused`).

    A tensor-parallel rank's part (tandem.parallel.sharding): experts `mine` (expert
    parallelism; default all) and of each its intermediate `columns` (default all); the
    per-expert and shared tensors come sliced from the reader, stacked ones are cut here."""
    assert config.moe is not None
    num, full = config.moe.num_experts, config.moe.expert_intermediate_size
    mine = mine if mine is not None else range(num)
    cols = columns if columns is not None else range(full)
    inter = len(cols)
    hid = config.hidden_size
    p = f"model.layers.{layer}.mlp."

    def load(name: str, dt: torch.dtype = dtype) -> torch.Tensor:
        return reader.read(p + name).to(device=device, dtype=dt, copy=True)

    if fused:  # [E, 2I, hidden] and [E, hidden, I] as F.linear takes them
        gu = reader.read(p + "experts.gate_up_proj")[mine.start : mine.stop]
        gu = torch.cat(
            (gu[:, cols.start : cols.stop], gu[:, full + cols.start : full + cols.stop]), 1
        )
        gate_up = gu.to(device=device, dtype=dtype).transpose(1, 2).contiguous()
        dn = reader.read(p + "experts.down_proj")[mine.start : mine.stop, :, cols.start : cols.stop]
        down = dn.to(device=device, dtype=dtype).transpose(1, 2).contiguous()
    else:
        gate_up = torch.empty(len(mine), hid, 2 * inter, dtype=dtype, device=device)
        down = torch.empty(len(mine), inter, hid, dtype=dtype, device=device)
        for e in range(len(mine)):
            gate, up, down_name = expert_names(DEEPSEEK_V3, layer, mine.start + e)
            gate_up[e, :, :inter].copy_(reader.read(gate).t())
            gate_up[e, :, inter:].copy_(reader.read(up).t())
            down[e].copy_(reader.read(down_name).t())
    shared = None
    if config.features.shared_expert_size:
        s = "shared_experts."
        both = torch.cat((load(s + "gate_proj.weight"), load(s + "up_proj.weight")))
        shared = (both.t().contiguous(), load(s + "down_proj.weight").t().contiguous(), None)
    return MoeWeights(
        router=load("gate.weight", torch.float32).t().contiguous(),
        gate_up=gate_up,
        down=down,
        first_expert=mine.start,
        shared=shared,
        correction_bias=load("gate.e_score_correction_bias", torch.float32),
    )


def check_mla(
    config: ModelConfig, quantized: bool, quantization: WeightScheme, names: Collection[str]
) -> None:
    """An MLA model (DeepSeek-V3) loads dense weights only for now; its multi-token-
    prediction layers, stored after the decoder's, are never read (logged)."""
    if quantized or quantization is not WeightScheme.NONE:
        raise ValueError(
            f"{config.architecture} serves unquantized (bf16/fp32) weights only for now: no "
            "quantized checkpoint (DeepSeek's FP8 block scales) and no --quantization"
        )
    if config.features.mtp_layers:
        layers = (n.split(".")[2] for n in names if n.startswith("model.layers."))
        skipped = sum(1 for i in layers if i.isdigit() and int(i) >= config.num_layers)
        log.info(
            "skipping %d multi-token-prediction layer(s) (model.layers.%d..): %d tensors "
            "not read",
            config.features.mtp_layers, config.num_layers, skipped,
        )  # fmt: skip


def norm(
    reader: Reader, name: str, offset: bool, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """An RMSNorm weight: as stored, in `dtype`; with `offset` (Gemma, Qwen3-Next) as 1 + w
    in float32 (the product transformers takes)."""
    w = reader.read(name)
    if offset:
        return (w.to(torch.float32) + 1.0).to(device)
    return w.to(device=device, dtype=dtype, copy=True)


def linear_layer(
    reader: Reader, config: ModelConfig, layer: int, dtype: torch.dtype, device: torch.device
) -> LinearWeights:
    """Layer `layer`'s Gated DeltaNet weights (Qwen3-Next). The checkpoint groups in_proj_qkvz's
    rows per key head ([q, k, v of its value heads, z of them] for each) and in_proj_ba's
    likewise ([b, a] per key head); they are regrouped as q | k | v | z and b | a."""
    c = config.features.linear
    assert c is not None
    p = f"model.layers.{layer}.linear_attn."
    ratio = c.num_v_heads // c.num_k_heads
    width = 2 * c.k_dim + 2 * ratio * c.v_dim  # rows per key head in in_proj_qkvz
    parts = ((0, c.k_dim), (c.k_dim, c.k_dim), (2 * c.k_dim, ratio * c.v_dim),
             (2 * c.k_dim + ratio * c.v_dim, ratio * c.v_dim))  # fmt: skip
    qkvz = torch.tensor([g * width + off + i for off, n in parts
                         for g in range(c.num_k_heads) for i in range(n)])  # fmt: skip
    ba = torch.tensor([g * 2 * ratio + off + i for off in (0, ratio)
                       for g in range(c.num_k_heads) for i in range(ratio)])  # fmt: skip

    def load(name: str, rows: torch.Tensor | None = None, transpose: bool = False) -> torch.Tensor:
        t = reader.read(p + name)
        t = t[rows] if rows is not None else t
        t = t.t() if transpose else t
        return t.to(device=device, dtype=dtype, copy=True).contiguous()

    return LinearWeights(
        qkvz=load("in_proj_qkvz.weight", qkvz, transpose=True),
        ba=load("in_proj_ba.weight", ba, transpose=True),
        conv=load("conv1d.weight")[:, 0],
        dt_bias=load("dt_bias"),
        a_log=load("A_log"),
        norm=load("norm.weight"),
        out=load("out_proj.weight", transpose=True),
    )
