"""What Gemma 3, gpt-oss and Qwen3-Next checkpoints store beyond the Llama layout, and how
it loads.

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
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Protocol

import torch

from tandem.model.config import ModelConfig
from tandem.model.linear_attention import LinearWeights
from tandem.model.moe import MoeWeights

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


def layer_shapes(config: ModelConfig, layer: int, mxfp4: bool) -> dict[str, tuple[int, ...]]:
    """The tensors of layer `layer` that Gemma 3 or gpt-oss adds to the Llama ones (a
    gpt-oss layer's experts: in place of Llama's MLP)."""
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
    if feat.shared_expert_size and config.moe is not None and layer in config.moe.sparse_layers:
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
