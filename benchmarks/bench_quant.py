"""Quantized weights on the CPU (issue 28): what each matmul option costs on SmolLM2-135M's
shapes, and what each scheme costs the default model in accuracy, memory and speed.

    .venv/bin/python benchmarks/bench_quant.py [--model-dir DIR] [--threads 1]
        [--parts matmuls,accuracy,speed] [--schemes none,int8,int4,fp8,gguf-int4]
        [--ppl-tokens 51200]

1. matmuls: the 120 layer matrices (30 x qkv, o, gate_up, down) at M = 1, 16, 256 rows, per
   option: float32 `x @ w`, bfloat16 through oneDNN prepacked (today's CPU default), torch's
   packed W8A16 and W4A16 kernels (bfloat16 and float32 activations), int8/fp8 values cast
   to bfloat16 then a GEMM, int4 dequantized then a GEMM. Median of a few products each.
2. accuracy: SmolLM2-135M-Instruct as converted (its Q4_1 weights dequantized to float32:
   the unquantized model on the same weights), served in bfloat16 with each scheme
   (gguf-int4: its Q4_1 matrices as shipped, from model.gguf): perplexity over the first
   --ppl-tokens tokens of Python's own `pydoc_data/topics.py` text (the help topics,
   English prose and examples; windows of 1024 tokens, each scored from its second token),
   and greedy agreement with `none` over 16 64-token continuations of 32-token prompts
   taken from that text (fraction identical, mean first divergence).
3. memory and speed: weight bytes per scheme, batch-1 decode ms/token (64 tokens after a
   32-token prompt) and 16-request throughput (output tokens/s, 64 tokens each), float32
   beside; same process, same inputs.

Writes benchmarks/results/quant.json.
"""

# ruff: noqa: B023  (each timed lambda runs inside its loop iteration)
from __future__ import annotations

import argparse
import math
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # siblings import by name
from report import RESULTS_DIR, machine_info, median_ms, result_path, write_json

SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576)] * 30  # (in, out)
WINDOW = 1024


def bench_matmuls() -> list[dict[str, Any]]:
    from tandem.model.linear import MatmulKind, matmul, pack
    from tandem.quant.linear import QuantPath, Workspace, pack_quantized, quant_matmul
    from tandem.quant.weight import quantize_fp8, quantize_int4, quantize_int8

    g = torch.Generator().manual_seed(0)
    ws = [torch.randn(o, i, generator=g) * 0.02 for i, o in SHAPES]  # [out, in]
    w32 = [w.t().contiguous() for w in ws]
    onednn = [pack(w.bfloat16(), MatmulKind.ONEDNN) for w in w32]
    q8 = [quantize_int8(w) for w in ws]
    q4 = [quantize_int4(w, 64) for w in ws]
    f8 = [quantize_fp8(w) for w in ws]
    space = Workspace()
    p8 = [pack_quantized(q, torch.bfloat16, space) for q in q8]
    p4 = [pack_quantized(q, torch.bfloat16, space) for q in q4]
    p4f = [pack_quantized(q, torch.float32, space, QuantPath.INT4_PACKED) for q in q4]
    s8f = [q.scales for q in q8]
    rows = []
    for m in (1, 16, 256):
        x32 = [torch.randn(m, i, generator=g) for i, _ in SHAPES]
        x16 = [x.bfloat16() for x in x32]
        reps = 7 if m == 1 else 3
        r: dict[str, Any] = {"m": m}

        def each(fn: Callable[[int], object]) -> Callable[[], None]:
            return lambda: [fn(i) for i in range(len(SHAPES))]  # type: ignore[func-returns-value]

        def int4_kernel(i: int, xs: list[torch.Tensor], packs: list[Any]) -> torch.Tensor:
            p = packs[i]
            return torch.ops.aten._weight_int4pack_mm_for_cpu(
                xs[i], p.packed, p.group_size, p.packed_scales
            )

        r["fp32 x @ w"] = median_ms(each(lambda i: x32[i] @ w32[i]), reps)
        r["bf16 oneDNN prepacked"] = median_ms(
            each(lambda i: matmul(x16[i], onednn[i], MatmulKind.ONEDNN)), reps
        )
        r["int8 packed kernel, bf16 x"] = median_ms(
            each(lambda i: torch.ops.aten._weight_int8pack_mm(x16[i], q8[i].qweight,
                                                               p8[i].packed_scales)), reps
        )  # fmt: skip
        r["int8 cast to bf16 + GEMM"] = median_ms(
            each(lambda i: (x16[i] @ q8[i].qweight.to(torch.bfloat16).t()) * p8[i].packed_scales),
            reps,
        )
        r["int4 packed kernel, bf16 x"] = median_ms(each(lambda i: int4_kernel(i, x16, p4)), reps)
        r["int4 dequantized + GEMM (bf16)"] = median_ms(
            each(lambda i: x16[i] @ q4[i].dequantize(torch.bfloat16).t()), 1
        )
        r["fp8 cast to bf16 + GEMM"] = median_ms(
            each(lambda i: (x16[i] @ f8[i].qweight.to(torch.bfloat16).t()) * f8[i].scales), 1
        )
        if m == 1:  # float32 activations through the packed kernels: slow already at 1 row
            r["int8 packed kernel, fp32 x"] = median_ms(
                each(lambda i: torch.ops.aten._weight_int8pack_mm(x32[i], q8[i].qweight,
                                                                   s8f[i])), reps
            )  # fmt: skip
            r["int4 packed kernel, fp32 x"] = median_ms(
                each(lambda i: int4_kernel(i, x32, p4f)), reps
            )
        r["tandem int8 (quant_matmul)"] = median_ms(
            each(lambda i: quant_matmul(x16[i], p8[i])), reps
        )
        r["tandem int4 (quant_matmul)"] = median_ms(
            each(lambda i: quant_matmul(x16[i], p4[i])), reps
        )
        print(f"matmuls M={m}: " + ", ".join(f"{k} {v:.1f}" for k, v in r.items() if k != "m"),
              flush=True)  # fmt: skip
        rows.append(r)
    return rows


def without_gguf(model_dir: Path) -> Path:
    """A directory of links to `model_dir`'s files but its kept GGUF: int4 there quantizes
    the dense weights online instead of serving the GGUF's Q4_1 blocks."""
    import tempfile

    out = Path(tempfile.mkdtemp(prefix="bench-quant-"))
    for f in model_dir.iterdir():
        if f.name != "model.gguf":
            (out / f.name).symlink_to(f.resolve())
    return out


def engine_for(model_dir: Path, scheme: str, dtype: str = "bfloat16", group: int = 64) -> Any:
    from tandem.config import CacheConfig, EngineConfig, SchedulerConfig
    from tandem.engine.engine import LLMEngine

    if scheme != "gguf-int4":
        model_dir = without_gguf(model_dir)
    elif not (model_dir / "model.gguf").is_file():
        raise SystemExit(f"{model_dir} keeps no model.gguf (converted before it was kept): "
                         "fetch the model again into another --model-dir")  # fmt: skip

    quantization = "int4" if scheme == "gguf-int4" else scheme
    group = 32 if scheme == "gguf-int4" else group
    return LLMEngine(
        EngineConfig(
            model_dir=str(model_dir),
            dtype=dtype,
            quantization=quantization,
            quantization_group_size=group,
            attention_backend="torch",
            cache=CacheConfig(kv_cache_bytes=256 << 20),
            scheduler=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=2048),
        )
    )


def perplexity(engine: Any, ids: list[int]) -> float:
    """exp(mean NLL) over windows of WINDOW tokens, each a fresh sequence."""
    from tandem.engine.kv_cache import allocate_kv_cache
    from tandem.model.attention import AttentionMetadata, PrefillSpan

    model = engine.model
    block = 16
    kv = allocate_kv_cache(model.config, WINDOW // block, block, model.weights.embed.dtype,
                           torch.device("cpu"))  # fmt: skip
    nll, count = 0.0, 0
    for start in range(0, len(ids) - WINDOW + 1, WINDOW):
        window = torch.tensor(ids[start : start + WINDOW])
        pos = torch.arange(WINDOW)
        meta = AttentionMetadata(
            pos // block, pos % block,
            prefills=[PrefillSpan(0, WINDOW, WINDOW, torch.arange(WINDOW // block))],
        )  # fmt: skip
        hidden = model.forward(window, pos, meta, kv)
        logits = model.compute_logits(hidden[:-1])
        nll += torch.nn.functional.cross_entropy(logits, window[1:], reduction="sum").item()
        count += WINDOW - 1
    return math.exp(nll / count)


def continuations(engine: Any, prompts: list[list[int]]) -> list[list[int]]:
    from tandem.engine.sampling import SamplingParams

    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    return [c.token_ids for c in engine.generate(prompts, params)]


def speed(engine: Any, prompts: list[list[int]]) -> dict[str, float]:
    from tandem.engine.sampling import SamplingParams

    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    engine.generate([prompts[0]], SamplingParams(max_tokens=2))  # first-call set-up
    rid = "speed-1"
    engine.add_request(engine.spec(rid, prompts[0], params))
    engine.step()  # the prefill and the first token
    t0 = time.perf_counter()
    steps = 0
    while engine.get_request(rid) is not None and steps < 63:
        engine.step()
        steps += 1
    decode_ms = (time.perf_counter() - t0) * 1e3 / max(steps, 1)
    t0 = time.perf_counter()
    out = engine.generate(prompts, params)
    tps = sum(len(c.token_ids) for c in out) / (time.perf_counter() - t0)
    return {"decode_ms_per_token_bs1": decode_ms, "throughput_tok_s_bs16": tps}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--model-dir", type=Path, default=Path.home() / ".cache/tandem/models/SmolLM2-135M-Instruct"
    )
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--parts", default="matmuls,accuracy,speed")
    ap.add_argument("--schemes", default="none,int8,int4,fp8,gguf-int4")
    ap.add_argument("--ppl-tokens", type=int, default=51200)
    ap.add_argument("--int4-group", type=int, default=64, help="online int4's group size")
    ap.add_argument("--out", default="quant", help="results/<out>.json")
    args = ap.parse_args()  # fmt: skip
    torch.set_num_threads(args.threads)
    parts = set(args.parts.split(","))
    report: dict[str, Any] = {"machine": machine_info(), "threads": args.threads}
    if "matmuls" in parts:
        report["matmuls"] = bench_matmuls()
    if parts & {"accuracy", "speed"}:
        import pydoc_data.topics

        from tandem.tokenizer.tokenizer import Tokenizer

        text = "\n\n".join(pydoc_data.topics.topics[k] for k in sorted(pydoc_data.topics.topics))
        ids = Tokenizer.from_dir(args.model_dir).encode(text, add_special_tokens=False)
        ppl_ids = ids[: args.ppl_tokens]
        prompts = [ids[60_000 + 1000 * i : 60_000 + 1000 * i + 32] for i in range(16)]
        report["text"] = {"source": "pydoc_data/topics.py", "tokens": len(ids),
                          "ppl_tokens": len(ppl_ids)}  # fmt: skip
        schemes = args.schemes.split(",")
        rows: dict[str, dict[str, Any]] = {}
        ref_tokens: list[list[int]] | None = None
        for scheme in schemes:
            t0 = time.perf_counter()
            engine = engine_for(args.model_dir, scheme, group=args.int4_group)
            row: dict[str, Any] = {"weight_bytes": engine.weight_bytes}
            if "accuracy" in parts:
                row["perplexity"] = perplexity(engine, ppl_ids)
                tokens = continuations(engine, prompts)
                if scheme == "none":
                    ref_tokens = tokens
                if ref_tokens is not None:
                    same = [a == b for a, b in zip(tokens, ref_tokens, strict=True)]
                    first = [
                        next((j for j, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), 64)
                        for a, b in zip(tokens, ref_tokens, strict=True)
                    ]
                    row["greedy_identical"] = sum(same) / len(same)
                    row["first_divergence_mean"] = statistics.mean(first)
            if "speed" in parts:
                row.update(speed(engine, prompts))
            row["seconds"] = time.perf_counter() - t0
            print(f"{scheme}: {row}", flush=True)
            rows[scheme] = row
            del engine
        if "speed" in parts:
            engine = engine_for(args.model_dir, "none", "float32")
            rows["none (float32)"] = {"weight_bytes": engine.weight_bytes,
                                      **speed(engine, prompts)}  # fmt: skip
            if ref_tokens is not None:  # bfloat16's own noise: float32 against it
                tokens = continuations(engine, prompts)
                same = [a == b for a, b in zip(tokens, ref_tokens, strict=True)]
                rows["none (float32)"]["greedy_identical"] = sum(same) / len(same)
            print(f"none (float32): {rows['none (float32)']}", flush=True)
        report["schemes"] = rows
    report["int4_group"] = args.int4_group
    write_json(result_path(RESULTS_DIR, args.out), report, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
