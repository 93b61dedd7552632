"""The `hybrid` part's engine check: each hybrid family served on the device through the whole
engine -- gpt-oss (sliding / full layers, sinks, its MoE; and with its experts as shipped in
MXFP4, kept in 4 bits), Gemma 3 (local / global layers) and Qwen3-Next (Gated DeltaNet layers:
the delta-rule kernel, state checkpoints) -- token for token as transformers' greedy decoding
on the same random weights (float32, tests/hf_models.py's tiny shapes), with a prefix-cache hit
(from a state checkpoint for Qwen3-Next) and decodes past the windows. None of these paths
had run on a GPU before this check."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import torch

from .common import Context, make_engine

FAMILIES = ("gpt-oss", "gpt-oss-mxfp4", "gemma3", "qwen3-next")


def _mxfp4(model_dir: Path, hf: Any) -> None:
    """Rewrite `model_dir`'s experts in MXFP4 (random e2m1 values and scales, as OpenAI ships
    gpt-oss) and load the same values, dequantized, into `hf`."""
    from safetensors.torch import load_file, save_file

    from tandem.weights.families import dequantize_mxfp4

    tensors = load_file(str(model_dir / "model.safetensors"))
    gen = torch.Generator().manual_seed(4)
    state = hf.state_dict()
    for name in [n for n in tensors if n.endswith(("gate_up_proj", "down_proj"))]:
        *lead, inp, out = tensors.pop(name).shape  # [E, in, out]
        nib = torch.randint(0, 16, (*lead, out, inp // 32, 32), generator=gen, dtype=torch.uint8)
        blocks = nib[..., 0::2] | (nib[..., 1::2] << 4)
        scales = torch.randint(124, 129, (*lead, out, inp // 32), generator=gen).to(torch.uint8)
        tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales
        state[name] = dequantize_mxfp4(blocks, scales).transpose(1, 2).contiguous()
    save_file(tensors, str(model_dir / "model.safetensors"))
    raw = json.loads((model_dir / "config.json").read_text())
    raw["quantization_config"] = {"quant_method": "mxfp4"}
    (model_dir / "config.json").write_text(json.dumps(raw))
    hf.load_state_dict(state)


def check_hybrid_engines(ctx: Context, root: Path) -> dict[str, Any]:
    """Per family: greedy tokens of a few prompts (longer than the windows, two sharing a
    24-token prefix: the second's must be a 24-token hit) against transformers' on CPU.
    Returns {family: {"identical": bool, "prefix_hit_tokens": int, ...}}."""
    from tandem.engine.sampling import SamplingParams
    from tests.hf_models import build_hf_model

    out: dict[str, Any] = {}
    rng = random.Random(7)
    shared = rng.choices(range(256), k=24)
    prompts = [shared + [1, 2, 3], shared + [9, 8], rng.choices(range(256), k=13)]
    for family in FAMILIES:
        arch = family.removesuffix("-mxfp4")
        model_dir = root / family
        hf = build_hf_model(arch, model_dir)
        if family.endswith("mxfp4"):
            _mxfp4(model_dir, hf)
        engine = make_engine(model_dir, ctx.device, "float32", block_size=4, num_blocks=256)
        results = []
        params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
        for i, prompt in enumerate(prompts):
            [got] = engine.generate([prompt], params)
            ids = torch.tensor([prompt])
            with torch.no_grad():
                want = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12,
                                   min_new_tokens=12, do_sample=False)  # fmt: skip
            want = want[0, len(prompt) :].tolist()
            results.append({"prompt": i, "cached": got.num_cached_tokens,
                            "identical": got.token_ids == want})  # fmt: skip
        out[family] = {
            "identical": all(r["identical"] for r in results),
            "prefix_hit_tokens": results[1]["cached"],
            "requests": results,
        }
        del engine
    return out
