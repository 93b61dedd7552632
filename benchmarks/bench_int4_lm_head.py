"""Online int4 on weights that are not already 4-bit (issue 28): the default model's layer
matrices are Q4_1 as shipped, so its only non-4-bit matrix, the token embedding (Q8_0 in the
GGUF) that is also its tied lm_head, is quantized here and the rest served as `none`.

    .venv/bin/python benchmarks/bench_int4_lm_head.py --model-dir DIR
        [--variants none,int4-g32,int4-g64,intzero-g32,intzero-g64] [--ppl-tokens 51200]

Variants: `int4-gN` is `tandem.quant.weight.quantize_int4` (min/max with a float zero point);
`intzero-gN` the integer-zero rule it replaced (range stretched to hold 0, zero point rounded
into 0..15, AWQ's and GPTQ's); `fp8`, `int8` the other schemes' quantizers. Perplexity as
`bench_quant.py` (same text, windows and function), lm_head replaced by the oneDNN-packed
bfloat16 of the variant's dequantization. lm_head is the matrix peers keep dense: a
worst-case single matrix, not a whole-model figure.

Writes benchmarks/results/int4_lm_head.json.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # siblings import by name
from bench_quant import engine_for, perplexity
from report import RESULTS_DIR, machine_info, result_path, write_json


def intzero_int4(w: torch.Tensor, group: int) -> torch.Tensor:
    """The integer-zero int4 rule, dequantized: [out, in] float32."""
    out, inp = w.shape
    wg = w.float().view(out, inp // group, group)
    lo = wg.amin(dim=2).clamp(max=0.0)
    hi = wg.amax(dim=2).clamp(min=0.0)
    scales = ((hi - lo) / 15.0).clamp_min(1e-12)
    zeros = torch.round(-lo / scales).clamp_(0, 15)
    q = torch.round(wg / scales[..., None] + zeros[..., None]).clamp_(0, 15)
    return ((q - zeros[..., None]) * scales[..., None]).view(out, inp)


def variant_weight(emb: torch.Tensor, variant: str) -> torch.Tensor:
    from tandem.quant.weight import WeightScheme, quantize

    if variant == "none":
        return emb
    name, _, group = variant.partition("-g")
    if name == "intzero":
        return intzero_int4(emb, int(group))
    return quantize(emb, WeightScheme(name), int(group or 128)).dequantize(torch.float32)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--model-dir", type=Path, default=Path.home() / ".cache/tandem/models/SmolLM2-135M-Instruct"
    )
    ap.add_argument("--variants", default="none,int4-g32,int4-g64,intzero-g32,intzero-g64")
    ap.add_argument("--ppl-tokens", type=int, default=51200)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    import pydoc_data.topics

    from safetensors.torch import load_file

    from tandem.model.linear import MatmulKind, pack
    from tandem.tokenizer.tokenizer import Tokenizer

    text = "\n\n".join(pydoc_data.topics.topics[k] for k in sorted(pydoc_data.topics.topics))
    ids = Tokenizer.from_dir(args.model_dir).encode(text, add_special_tokens=False)
    ids = ids[: args.ppl_tokens]
    tensors = load_file(str(args.model_dir / "model.safetensors"))
    emb = tensors["model.embed_tokens.weight"].float()  # [vocab, hidden]: lm_head's [out, in]
    engine = engine_for(args.model_dir, "none")
    rows: dict[str, dict[str, Any]] = {}
    for variant in args.variants.split(","):
        t0 = time.perf_counter()
        w = variant_weight(emb, variant)
        err = ((w - emb).norm() / emb.norm()).item()
        engine.model.weights.lm_head = pack(w.t().contiguous().bfloat16(), MatmulKind.ONEDNN)
        ppl = perplexity(engine, ids)
        rows[variant] = {"relative_rms_error": err, "perplexity": ppl,
                         "seconds": time.perf_counter() - t0}  # fmt: skip
        print(f"{variant}: {rows[variant]}", flush=True)
    report = {"machine": machine_info(), "ppl_tokens": len(ids), "lm_head": rows,
              "text": "pydoc_data/topics.py (CPython standard library, topics sorted)"}  # fmt: skip
    write_json(result_path(RESULTS_DIR, "int4_lm_head"), report, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
