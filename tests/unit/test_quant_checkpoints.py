"""Quantized checkpoints in their real on-disk layouts, written here from random integers
by readable re-implementations of each format's packing rule, loaded, and compared with the
weights the format's own rule gives (exact for AWQ/GPTQ/int8; fp8 values are e4m3 already).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from tandem.quant.checkpoint import (
    LINEAR_SUFFIXES,
    CheckpointQuant,
    convert,
    parse_quant_config,
)
from tandem.quant.weight import WeightScheme
from tandem.weights.loader import load_model

Tensors = dict[str, torch.Tensor]


def to_int32(words: torch.Tensor) -> torch.Tensor:
    """int64 holding 32-bit patterns -> int32 with the same bits."""
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def awq_pack(q: torch.Tensor) -> torch.Tensor:
    """AutoAWQ's GEMM rule: [rows, out] 4-bit -> int32 [rows, out / 8], word c's nibble i
    holding column 8c + order_map[i]."""
    order_map = [0, 2, 4, 6, 1, 3, 5, 7]
    words = torch.zeros(q.shape[0], q.shape[1] // 8, dtype=torch.int64)
    for col in range(q.shape[1] // 8):
        for i in range(8):
            words[:, col] |= q[:, col * 8 + order_map[i]].long() << (4 * i)
    return to_int32(words)


def gptq_pack_inputs(q: torch.Tensor, bits: int) -> torch.Tensor:
    """GPTQ's qweight rule: [in, out] -> int32 [in * bits / 32, out], inputs packed in order."""
    per_word = 32 // bits
    words = torch.zeros(q.shape[0] // per_word, q.shape[1], dtype=torch.int64)
    for row in range(words.shape[0]):
        for j in range(per_word):
            words[row] |= q[row * per_word + j].long() << (bits * j)
    return to_int32(words)


def gptq_pack_outputs(z: torch.Tensor, bits: int) -> torch.Tensor:
    """GPTQ's qzeros rule: [groups, out] -> int32 [groups, out * bits / 32], outputs in order."""
    return gptq_pack_inputs(z.t(), bits).t().contiguous()


def random_int4(gen: torch.Generator, out: int, inp: int, group: int) -> tuple[Tensors, Any]:
    groups = inp // group
    q = torch.randint(0, 16, (out, inp), generator=gen)
    zeros = torch.randint(1, 16, (out, groups), generator=gen)  # GPTQ v1 cannot store 0
    scales = (torch.rand(out, groups, generator=gen) * 0.02 + 0.001).half()
    return {"q": q, "zeros": zeros, "scales": scales}, None


def awq_layer(gen: torch.Generator, prefix: str, out: int, inp: int, group: int):
    p, _ = random_int4(gen, out, inp, group)
    g = torch.arange(inp) // group
    dense = (p["q"] - p["zeros"][:, g]) * p["scales"].float()[:, g]
    tensors = {
        f"{prefix}.qweight": awq_pack(p["q"].t()),
        f"{prefix}.qzeros": awq_pack(p["zeros"].t()),
        f"{prefix}.scales": p["scales"].t().contiguous(),
    }
    return tensors, dense


def gptq_layer(gen, prefix, out, inp, group, act_order=False, v2=False):
    p, _ = random_int4(gen, out, inp, group)
    g_idx = torch.arange(inp) // group
    if act_order:
        g_idx = torch.randperm(inp, generator=gen) // group
    dense = (p["q"] - p["zeros"][:, g_idx]) * p["scales"].float()[:, g_idx]
    stored_zeros = p["zeros"] if v2 else p["zeros"] - 1  # v1 stores zero - 1
    tensors = {
        f"{prefix}.qweight": gptq_pack_inputs(p["q"].t(), 4),
        f"{prefix}.qzeros": gptq_pack_outputs(stored_zeros.t().contiguous(), 4),
        f"{prefix}.scales": p["scales"].t().contiguous(),
        f"{prefix}.g_idx": g_idx.to(torch.int32),
    }
    return tensors, dense


def gptq8_layer(gen, prefix, out, inp):
    q = torch.randint(0, 256, (out, inp), generator=gen)
    scales = (torch.rand(1, out, generator=gen) * 0.02 + 0.001).half()
    dense = (q - 128) * scales.float().t()
    tensors = {
        f"{prefix}.qweight": gptq_pack_inputs(q.t(), 8),
        f"{prefix}.qzeros": gptq_pack_outputs(torch.full((1, out), 127), 8),  # 128 - 1
        f"{prefix}.scales": scales,
        f"{prefix}.g_idx": torch.zeros(inp, dtype=torch.int32),
    }
    return tensors, dense


def fp8_layer(gen, prefix, out, inp, scale_shape, scale_name="weight_scale"):
    w8 = (torch.randn(out, inp, generator=gen) * 100).to(torch.float8_e4m3fn)
    numel = 1
    for d in scale_shape:
        numel *= d
    scale = (torch.rand(numel, generator=gen) * 0.01 + 0.001).view(scale_shape)
    scale = scale.bfloat16().float()  # exact in bfloat16, as compressed_layer stores it
    if len(scale_shape) == 2 and scale_shape[1] == 1 and scale_shape[0] != out:  # blocks
        per_row = scale.flatten().repeat_interleave(128)[:out]
    else:
        per_row = scale.flatten().expand(out) if numel == 1 else scale.flatten()
    dense = w8.float() * per_row[:, None]
    return {f"{prefix}.weight": w8, f"{prefix}.{scale_name}": scale}, dense


def compressed_layer(gen, prefix, out, inp):
    tensors, dense = fp8_layer(gen, prefix, out, inp, (out, 1))
    scale = tensors[f"{prefix}.weight_scale"].bfloat16()
    tensors[f"{prefix}.weight_scale"] = scale
    return tensors, tensors[f"{prefix}.weight"].float() * scale.float()


def compressed_int8_layer(gen, prefix, out, inp):
    q = torch.randint(-128, 128, (out, inp), generator=gen, dtype=torch.int8)
    scale = (torch.rand(out, 1, generator=gen) * 0.01 + 0.001).half()
    dense = q.float() * scale.float()
    return {f"{prefix}.weight": q, f"{prefix}.weight_scale": scale}, dense


def compressed_config(fmt: str, kind: str) -> dict[str, Any]:
    weights = dict(num_bits=8, type=kind, strategy="channel", symmetric=True, dynamic=False)
    return dict(
        quant_method="compressed-tensors",
        format=fmt,
        config_groups={"group_0": dict(targets=["Linear"], weights=weights)},
        ignore=["lm_head"],
    )


QUANT_CONFIGS: dict[str, tuple[dict[str, Any], Callable[..., Any]]] = {
    "awq-g32": (
        dict(quant_method="awq", bits=4, group_size=32, zero_point=True, version="gemm"),
        lambda gen, p, o, i: awq_layer(gen, p, o, i, 32),
    ),
    "gptq-g64": (
        dict(quant_method="gptq", bits=4, group_size=64, desc_act=False, sym=False),
        lambda gen, p, o, i: gptq_layer(gen, p, o, i, 64),
    ),
    "gptq-g32-act-order": (
        dict(quant_method="gptq", bits=4, group_size=32, desc_act=True, sym=False),
        lambda gen, p, o, i: gptq_layer(gen, p, o, i, 32, act_order=True),
    ),
    "gptq-v2-per-channel": (  # G = in: scales repeated into groups of 64 or 32
        dict(quant_method="gptq", bits=4, group_size=-1, checkpoint_format="gptq_v2"),
        lambda gen, p, o, i: gptq_layer(gen, p, o, i, i, v2=True),
    ),
    "gptq-8bit": (
        dict(quant_method="gptq", bits=8, group_size=-1, sym=True),
        lambda gen, p, o, i: gptq8_layer(gen, p, o, i),
    ),
    "fp8-per-tensor": (
        dict(quant_method="fp8", activation_scheme="dynamic"),
        lambda gen, p, o, i: fp8_layer(gen, p, o, i, (1,)),
    ),
    "fp8-block-one-column": (  # in <= 128: one block column, i.e. per channel
        dict(quant_method="fp8", activation_scheme="dynamic", weight_block_size=[128, 128]),
        lambda gen, p, o, i: fp8_layer(gen, p, o, i, (-(-o // 128), 1), "weight_scale_inv"),
    ),
    "compressed-tensors-fp8-channel": (
        compressed_config("float-quantized", "float"),
        lambda gen, p, o, i: compressed_layer(gen, p, o, i),
    ),
    "compressed-tensors-int8-channel": (
        compressed_config("int-quantized", "int"),
        lambda gen, p, o, i: compressed_int8_layer(gen, p, o, i),
    ),
}


def write_quantized_checkpoint(src: Path, dst: Path, fmt: str) -> tuple[Tensors, Tensors]:
    """The model directory `src` rewritten into `dst` in checkpoint format `fmt`: every layer
    matrix replaced by random integers in that format's on-disk layout. Returns (the tensors
    written, the dense weight each quantized matrix stands for)."""
    qconfig, make_layer = QUANT_CONFIGS[fmt]
    dst.mkdir()
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = qconfig
    (dst / "config.json").write_text(json.dumps(config))
    gen = torch.Generator().manual_seed(len(fmt))
    tensors: Tensors = {}
    dense: Tensors = {}
    for name, value in load_file(src / "model.safetensors").items():
        prefix = name.removesuffix(".weight")
        if name.endswith(".weight") and prefix.endswith(LINEAR_SUFFIXES):
            out, inp = value.shape
            layer, dense[name] = make_layer(gen, prefix, out, inp)
            tensors.update(layer)
        else:
            tensors[name] = value  # lm_head, embeddings and norms stay dense
    save_file(tensors, dst / "model.safetensors")
    return tensors, dense


@pytest.mark.parametrize("fmt", QUANT_CONFIGS, ids=list(QUANT_CONFIGS))
def test_checkpoint_loads_its_dequantized_weights(hf_model, tmp_path: Path, fmt: str) -> None:
    src, _ = hf_model("llama")
    dst = tmp_path / "model"
    tensors, dense = write_quantized_checkpoint(src, dst, fmt)

    model = load_model(dst)
    for i, lw in enumerate(model.weights.layers):
        attn, mlp = f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        qkv = torch.cat([dense[attn + f"{x}_proj.weight"] for x in "qkv"]).t()
        gate_up = torch.cat([dense[mlp + f"{x}_proj.weight"] for x in ("gate", "up")]).t()
        torch.testing.assert_close(lw.qkv, qkv, atol=0, rtol=0)
        torch.testing.assert_close(lw.o, dense[attn + "o_proj.weight"].t(), atol=0, rtol=0)
        torch.testing.assert_close(lw.gate_up, gate_up, atol=0, rtol=0)
        torch.testing.assert_close(lw.down, dense[mlp + "down_proj.weight"].t(), atol=0, rtol=0)
    torch.testing.assert_close(model.weights.lm_head, tensors["lm_head.weight"].t())


def converted(quant: dict[str, Any], tensors: Tensors, prefix: str, out: int, inp: int):
    return convert(parse_quant_config(quant), prefix, tensors.__getitem__, out, inp)


def test_awq_and_gptq_keep_their_integers_and_act_order() -> None:
    gen = torch.Generator().manual_seed(0)
    tensors, dense = awq_layer(gen, "l", 16, 128, 128)
    qw = converted(QUANT_CONFIGS["awq-g32"][0] | {"group_size": 128}, tensors, "l", 16, 128)
    assert (qw.scheme, qw.group_size, qw.qweight.shape) == (WeightScheme.INT4, 128, (16, 64))
    assert qw.zeros is not None and qw.zeros.dtype == torch.uint8 and qw.g_idx is None
    torch.testing.assert_close(qw.dequantize(), dense, atol=0, rtol=0)

    tensors, dense = gptq_layer(gen, "l", 8, 64, 32, act_order=True)
    qw = converted(QUANT_CONFIGS["gptq-g32-act-order"][0], tensors, "l", 8, 64)
    assert qw.g_idx is not None and torch.equal(qw.g_idx, tensors["l.g_idx"])
    torch.testing.assert_close(qw.dequantize(), dense, atol=0, rtol=0)


def test_gptq_symmetric_zeros_become_the_default_and_v1_zero_0_reads_16() -> None:
    gen = torch.Generator().manual_seed(1)
    tensors, _ = gptq_layer(gen, "l", 8, 64, 32)
    tensors["l.qzeros"] = gptq_pack_outputs(torch.full((2, 8), 7), 4)  # sym: 8 - 1
    qw = converted(QUANT_CONFIGS["gptq-g64"][0] | {"group_size": 32}, tensors, "l", 8, 64)
    assert qw.zeros is None  # 8, the format's default
    # v1 stores zero 0 as (0 - 1) & 15 = 15; its kernels add 1 without wrapping: 16.
    tensors["l.qzeros"] = gptq_pack_outputs(torch.full((2, 8), 15), 4)
    qw = converted(QUANT_CONFIGS["gptq-g64"][0] | {"group_size": 32}, tensors, "l", 8, 64)
    assert qw.zeros is not None and qw.zeros.dtype == torch.float32
    assert bool((qw.zeros == 16).all())


REFUSED = {
    "gptq-3bit": (dict(quant_method="gptq", bits=3), r"quantization_config.bits 3"),
    "gptq-marlin": (
        dict(quant_method="gptq", bits=4, checkpoint_format="marlin"),
        r"checkpoint_format 'marlin'",
    ),
    "gptq-8bit-groups": (
        dict(quant_method="gptq", bits=8, group_size=128),
        r"group_size must be -1",
    ),
    "awq-gemv": (dict(quant_method="awq", bits=4, version="gemv"), r"version 'gemv'"),
    "awq-no-zero-point": (dict(quant_method="awq", zero_point=False), r"zero_point"),
    "bitsandbytes": (dict(quant_method="bitsandbytes"), r"quant_method 'bitsandbytes'"),
    "compressed-pack": (
        dict(quant_method="compressed-tensors", format="pack-quantized"),
        r"format 'pack-quantized'",
    ),
    "compressed-block": (
        dict(
            quant_method="compressed-tensors",
            format="float-quantized",
            config_groups={"g": dict(weights=dict(num_bits=8, type="float", strategy="block"))},
        ),
        r"strategy 'block'",
    ),
}


@pytest.mark.parametrize("qc, match", REFUSED.values(), ids=list(REFUSED))
def test_unsupported_configs_are_refused_naming_the_field(qc: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        parse_quant_config(qc)


def test_layouts_the_format_cannot_hold_are_refused() -> None:
    gen = torch.Generator().manual_seed(2)
    # DeepSeek-V3's [128, 128] blocks over 256 inputs: two scales along a row.
    tensors = {
        "l.weight": torch.randn(128, 256, generator=gen).to(torch.float8_e4m3fn),
        "l.weight_scale_inv": torch.rand(1, 2, generator=gen),
    }
    fp8 = dict(quant_method="fp8", weight_block_size=[128, 128])
    with pytest.raises(ValueError, match=r"block-wise fp8 scales .*weight_block_size \[128, 128\]"):
        converted(fp8, tensors, "l", 128, 256)
    # act-order groups of 256 cannot be split into 128s.
    tensors, _ = gptq_layer(gen, "l", 8, 512, 256, act_order=True)
    quant = CheckpointQuant(parse_quant_config(dict(quant_method="gptq")).format, 4, 256, 1)
    with pytest.raises(ValueError, match=r"group_size 256 .*act-order"):
        convert(quant, "l", tensors.__getitem__, 8, 512)


def test_unquantized_checkpoint_is_unchanged(hf_model, tmp_path: Path) -> None:
    src, hf = hf_model("llama")
    dst = tmp_path / "model"
    shutil.copytree(src, dst)
    model = load_model(dst)
    ref = hf.model.layers[0].mlp.down_proj.weight
    torch.testing.assert_close(model.weights.layers[0].down, ref.t(), atol=0, rtol=0)
