"""The CPU engine's building blocks on the default model (issue 24), in one process.

    python benchmarks/bench_cpu_engine.py [--threads 1,2]
        [--parts matmuls,engine,attention,kernel,prefill]
        [--model-dir DIR] [--results-dir DIR]

1. matmuls: SmolLM2-135M's 121 weight matrices (30 x qkv, o, gate_up, down, and lm_head),
   one product each per "step", at M = 1, 4, 16 rows (decode batches) and 256 (a prefill
   chunk): float32 `x @ w` (the plain path), bfloat16 `x @ w`, and bfloat16 through oneDNN
   with the weights prepacked (`tandem.model.linear`). Median of 15 steps.
2. engine: `LLMEngine` decode steps (median of 30) at batch 1, 4 and 16 with 256-token
   prompts, and the prefill of those prompts, per dtype (float32, bfloat16) and thread count.
3. attention: bfloat16 decode steps at batch 1, 4 and 16 with the CPU paths: the native
   paged decode kernel with the fused residual-add+RMSNorm and RoPE calls (the default), the
   native kernel alone, torch ops with block-diagonal products, torch ops with per-head
   products (`BLOCK_DIAGONAL_MAX_KV_HEADS` 0, the previous session's path); alternated every
   5 steps in one engine (median of 30 each); the process's CPU time per step (at 1 thread,
   the step's time without what other jobs on a shared box take).
4. kernel: the native decode kernel alone, its AVX512-BF16 path against its plain loops,
   over an engine-shaped cache (30 layers interleaved per block, blocks scattered), 1, 4 and
   16 rows of ~300 keys, process CPU time per 30-layer call.
5. prefill: the levers on a bfloat16 prefill that were measured and not taken. (a) a
   256-token prefill with 1 and 2 torch threads, the other core idle and then busy with one
   CPU-bound process (what the router and clients are to a worker on a 2-core box), wall
   ms; (b) the 120 layer matrices packed for oneDNN with batch hint 1 (served) and 256, at
   1-1024 rows, and for each layout the row counts whose rows differ bitwise from the same
   rows inside a 300-row product (batch invariance), for SmolLM2's shapes, the `small` tiny
   preset's and Llama-3-8B's;
   (c) the 256-token causal attention of 30 layers: SDPA (served), SDPA with K/V repeated
   per query head, and SDPA in float32.

Same process, same inputs, alternating nothing but the variant: ratios are what to read
(the machine is shared). Writes <results-dir>/cpu_engine.json.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # siblings import by name
from report import RESULTS_DIR, machine_info, median_ms, write_json

from tandem.model.linear import MatmulKind, matmul, pack

# SmolLM2-135M: hidden 576, intermediate 1536, 9 q / 3 kv heads of 64, 30 layers, vocab 49152.
SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576)] * 30 + [(576, 49152)]


def _middle(values: list[float]) -> float:
    """The median of alternated timings (the upper middle of an even count)."""
    return sorted(values)[len(values) // 2]


def _packed_for(w: torch.Tensor, batch_hint: int) -> torch.Tensor:
    """`w` [in, out] in oneDNN's layout for `batch_hint` rows (`pack` always uses 1)."""
    return torch.ops.mkldnn._reorder_linear_weight(w.t().contiguous(), batch_hint)


def bench_matmuls(threads: int) -> list[dict[str, Any]]:
    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(0)
    w32 = [torch.randn(i, o, generator=g) * 0.02 for i, o in SHAPES]
    w16 = [w.bfloat16() for w in w32]
    packed = [pack(w, MatmulKind.ONEDNN) for w in w16]
    rows = []
    for m in (1, 4, 16, 256):
        shapes = SHAPES if m <= 16 else SHAPES[:-1]  # a prefill chunk needs no lm_head
        x32 = [torch.randn(m, i, generator=g) for i, _ in shapes]
        x16 = [x.bfloat16() for x in x32]
        reps = 15 if m <= 16 else 5

        def products(xs: list[torch.Tensor], ws: list[torch.Tensor], kind: MatmulKind) -> None:
            for x, w in zip(xs, ws, strict=False):  # no lm_head for a prefill chunk
                matmul(x, w, kind)

        f32 = median_ms(lambda: products(x32, w32, MatmulKind.PLAIN), reps)  # noqa: B023
        b16 = median_ms(lambda: products(x16, w16, MatmulKind.PLAIN), reps)  # noqa: B023
        one = median_ms(lambda: products(x16, packed, MatmulKind.ONEDNN), reps)  # noqa: B023
        row = {
            "threads": threads,
            "m": m,
            "fp32_ms": f32,
            "bf16_plain_ms": b16,
            "bf16_onednn_ms": one,
        }
        row["onednn_speedup_vs_fp32"] = f32 / one
        print(
            f"matmuls threads={threads} M={m}: fp32 {f32:.1f} ms, bf16 x@w {b16:.1f} ms, "
            f"bf16 oneDNN {one:.1f} ms ({f32 / one:.2f}x)",
            flush=True,
        )
        rows.append(row)
    return rows


def bench_engine(model_dir: Path, dtype: str, threads: int) -> dict[str, Any]:
    from tandem.config import EngineConfig
    from tandem.engine.engine import LLMEngine
    from tandem.engine.sampling import SamplingParams

    engine = LLMEngine(EngineConfig(model_dir=str(model_dir), dtype=dtype, num_threads=threads))
    engine.warm_up()
    params = SamplingParams(max_tokens=300, temperature=0.0, ignore_eos=True)
    out: dict[str, Any] = {"dtype": dtype, "threads": threads, "matmul": engine.model.matmul.value}
    for bs in (1, 4, 16):
        ids = [f"r{bs}-{i}" for i in range(bs)]
        for i, rid in enumerate(ids):
            engine.add_request(engine.spec(rid, list(range(100 + i, 356 + i)), params))
        t0 = time.perf_counter()
        while engine.scheduler.waiting or any(
            (r := engine.get_request(rid)) is not None and not r.output_token_ids for rid in ids
        ):
            engine.step()
        out[f"prefill_bs{bs}_ms"] = (time.perf_counter() - t0) * 1e3
        out[f"decode_step_bs{bs}_ms"] = median_ms(engine.step, 30)
        for rid in ids:
            engine.abort(rid)
    print(
        f"engine {dtype} threads={threads} ({out['matmul']}): "
        + ", ".join(f"{k} {v:.1f}" for k, v in out.items() if k.endswith("_ms")),
        flush=True,
    )
    return out


def bench_attention(model_dir: Path, threads: int) -> dict[str, Any]:
    from tandem.config import EngineConfig
    from tandem.engine.engine import LLMEngine
    from tandem.engine.sampling import SamplingParams
    from tandem.model import attention

    default = attention.BLOCK_DIAGONAL_MAX_KV_HEADS
    engine = LLMEngine(
        EngineConfig(model_dir=str(model_dir), dtype="bfloat16", num_threads=threads)
    )
    backend = engine.model.attention
    native = backend.decode_kernel
    fused = engine.model.fused_ops  # the residual add + RMSNorm and RoPE calls
    # (name, decode kernel, block-diagonal limit, fused norm/RoPE library)
    variants = [
        ("native", native, default, fused),
        ("native_unfused", native, default, None),
        ("block_diagonal", None, default, None),
        ("per_head", None, 0, None),
    ]
    engine.warm_up()
    params = SamplingParams(max_tokens=300, temperature=0.0, ignore_eos=True)
    out: dict[str, Any] = {"threads": threads}
    for bs in (1, 4, 16):
        ids = [f"a{bs}-{i}" for i in range(bs)]
        for i, rid in enumerate(ids):
            engine.add_request(engine.spec(rid, list(range(100 + i, 356 + i)), params))
        for _ in range(3):  # the prefill, then a few decode steps
            engine.step()
        times: dict[str, list[float]] = {name: [] for name, *_ in variants}
        for _ in range(6):
            for name, kernel, limit, norm in variants:
                if name.startswith("native") and kernel is None:
                    continue  # no C compiler here
                backend.decode_kernel = kernel
                engine.model.fused_ops = norm
                attention.BLOCK_DIAGONAL_MAX_KV_HEADS = limit
                for _ in range(5):
                    t0 = time.process_time()  # CPU time: robust to the box's other jobs
                    engine.step()
                    times[name].append(time.process_time() - t0)
        attention.BLOCK_DIAGONAL_MAX_KV_HEADS = default
        backend.decode_kernel = native
        engine.model.fused_ops = fused
        for name, ts in times.items():
            if ts:
                out[f"decode_step_bs{bs}_{name}_cpu_ms"] = _middle(ts) * 1e3
        for rid in ids:
            engine.abort(rid)
    print(
        f"attention threads={threads}: "
        + ", ".join(f"{k} {v:.1f}" for k, v in out.items() if k.endswith("_ms")),
        flush=True,
    )
    return out


def bench_kernel(rows_list: tuple[int, ...] = (1, 4, 16), ctx: int = 300) -> dict[str, Any]:
    """The native decode kernel alone over an engine-shaped cache (every layer's K and V
    interleaved per block, blocks scattered, the cache far larger than L3), 30 layers called
    in turn as a step does: the AVX512-BF16 path against the plain loops, alternated,
    process CPU time per 30-layer call (median of 9), 1 thread."""
    from tandem.kernels import cpu_ops

    lib = cpu_ops.load()
    if lib is None:
        return {"skipped": "no C compiler"}
    torch.set_num_threads(1)
    layers, q_heads, kv_heads, dim, bs = 30, 9, 3, 64, 16
    gen = torch.Generator().manual_seed(0)
    out: dict[str, Any] = {"bf16_dot": cpu_ops.has_bf16_dot(lib), "context": ctx}
    for rows in rows_list:
        per_row = -(-ctx // bs)
        num_blocks = rows * per_row + 64
        cache = torch.randn(num_blocks, layers, 2, bs, kv_heads, dim, generator=gen).bfloat16()
        tables = torch.randperm(num_blocks, generator=gen)[: rows * per_row].view(rows, -1)
        lens = torch.tensor([ctx - (i * 7) % 40 for i in range(rows)], dtype=torch.int64)
        qs = [torch.randn(rows, q_heads, dim, generator=gen).bfloat16() for _ in range(layers)]
        times: dict[str, list[float]] = {"vector": [], "plain": []}
        for _ in range(9):
            for name in times:
                t0 = time.process_time()
                for layer in range(layers):
                    kv = cache[:, layer]
                    cpu_ops.decode_attention(
                        lib, qs[layer], kv[:, 0], kv[:, 1], tables, lens, dim**-0.5,
                        vector=name == "vector",
                    )  # fmt: skip
                times[name].append(time.process_time() - t0)
        for name, ts in times.items():
            out[f"rows{rows}_{name}_cpu_ms"] = _middle(ts) * 1e3
    print(
        "kernel: " + ", ".join(f"{k} {v:.2f}" for k, v in out.items() if k.endswith("_ms")),
        flush=True,
    )
    return out


def _prefill_ms(engine: Any, first_id: int, tokens: int = 256, reps: int = 6) -> float:
    """Median wall ms of `reps` prefills of distinct `tokens`-token prompts (no prefix hit)."""
    from tandem.engine.sampling import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    times = []
    for r in range(reps):
        rid = f"pf{first_id + r}"
        prompt = [(1000 + 7 * j + 131 * (first_id + r)) % 40000 for j in range(tokens)]
        engine.add_request(engine.spec(rid, prompt, params))
        t0 = time.perf_counter()
        while (req := engine.get_request(rid)) is not None and not req.output_token_ids:
            engine.step()
        times.append((time.perf_counter() - t0) * 1e3)
        engine.abort(rid)
    return _middle(times)


def _invariance_breaks(w: torch.Tensor, hint: int, rows: list[int]) -> list[int]:
    """Row counts m for which x[:m]'s product differs bitwise from rows [:m] of x's (300)."""
    packed = _packed_for(w, hint)
    x = torch.randn(300, w.shape[0], generator=torch.Generator().manual_seed(1)).bfloat16()
    linear = torch.ops.mkldnn._linear_pointwise
    full = linear(x, packed, None, "none", [], "")
    alone = {m: linear(x[:m].contiguous(), packed, None, "none", [], "") for m in rows}
    return [m for m in rows if not torch.equal(alone[m], full[:m])]


def bench_prefill(model_dir: Path) -> dict[str, Any]:
    import subprocess

    import torch.nn.functional as F

    from tandem.config import EngineConfig
    from tandem.engine.engine import LLMEngine

    out: dict[str, Any] = {}
    # (a) threads, the other core idle / busy
    engine = LLMEngine(EngineConfig(model_dir=str(model_dir), dtype="bfloat16", num_threads=1))
    engine.warm_up()
    _prefill_ms(engine, 0, reps=2)
    next_id = 100
    for load in ("idle", "busy"):
        busy = None
        if load == "busy":
            busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
            time.sleep(0.5)
        try:
            for _ in range(2):  # alternated
                for threads in (1, 2):
                    torch.set_num_threads(threads)
                    ms = _prefill_ms(engine, next_id, reps=3)
                    next_id += 10
                    out.setdefault(f"threads{threads}_other_core_{load}_ms", []).append(ms)
        finally:
            if busy is not None:
                busy.kill()
                busy.wait()
    torch.set_num_threads(1)
    del engine
    # (b) oneDNN batch hints: speed and batch invariance
    gen = torch.Generator().manual_seed(0)
    mats = [(torch.randn(k, n, generator=gen) * 0.03).bfloat16() for k, n in SHAPES[:-1]]
    linear = torch.ops.mkldnn._linear_pointwise
    packs = {hint: [_packed_for(w, hint) for w in mats] for hint in (1, 256)}
    for m in (1, 16, 64, 256, 1024):
        xs = [torch.randn(m, w.shape[0], generator=gen).bfloat16() for w in mats]
        times: dict[int, list[float]] = {hint: [] for hint in packs}
        for _ in range(5):
            for hint, ws in packs.items():
                t0 = time.process_time()
                for x, w in zip(xs, ws, strict=True):
                    linear(x, w, None, "none", [], "")
                times[hint].append(time.process_time() - t0)
        for hint, ts in times.items():
            out[f"layer_matmuls_hint{hint}_rows{m}_cpu_ms"] = _middle(ts) * 1e3
    rows = list(range(1, 41)) + [64, 100, 128, 256]
    shapes = {"smollm2": [(576, 960), (576, 576), (576, 3072), (1536, 576), (576, 49152)],
              "tiny_small": [(512, 256), (512, 512), (512, 1536), (1536, 512), (512, 8192)],
              "llama3_8b": [(4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096)]}  # fmt: skip
    for model, model_shapes in shapes.items():
        for k, n in model_shapes:
            w = (torch.randn(k, n, generator=gen) * 0.03).bfloat16()
            for hint in (1, 256):
                out[f"invariance_{model}_{k}x{n}_hint{hint}_differs_at"] = _invariance_breaks(
                    w, hint, rows
                )
    # (c) prefill attention, 30 layers of 256 tokens (9 query heads, 3 KV heads, 64 dims)
    n, scale = 256, 64**-0.5
    q = torch.randn(1, 9, n, 64, generator=gen).bfloat16()
    k, v = (torch.randn(1, 3, n, 64, generator=gen).bfloat16() for _ in range(2))
    sdpa = F.scaled_dot_product_attention
    variants = {
        "sdpa_gqa": lambda: sdpa(q, k, v, is_causal=True, scale=scale, enable_gqa=True),
        "sdpa_repeated_kv": lambda: sdpa(
            q, k.repeat_interleave(3, 1), v.repeat_interleave(3, 1), is_causal=True, scale=scale
        ),
        "sdpa_float32": lambda: sdpa(
            q.float(), k.float(), v.float(), is_causal=True, scale=scale, enable_gqa=True
        ),
    }
    attn_times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(5):
        for name, fn in variants.items():
            t0 = time.process_time()
            for _ in range(30):
                fn()
            attn_times[name].append(time.process_time() - t0)
    for name, ts in attn_times.items():
        out[f"attention_{name}_30_layers_cpu_ms"] = _middle(ts) * 1e3
    for key, value in out.items():
        print(f"prefill: {key} {value}", flush=True)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", default="1,2")
    ap.add_argument("--parts", default="matmuls,engine,attention,kernel")
    ap.add_argument("--model-dir", type=Path, default=None)
    ap.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    args = ap.parse_args()
    threads = [int(t) for t in args.threads.split(",")]
    if args.model_dir is None:
        from tandem.services.cli.model import ensure_default_model

        args.model_dir = ensure_default_model()
    parts = set(args.parts.split(","))
    matmuls = [row for t in threads for row in bench_matmuls(t)] if "matmuls" in parts else []
    engines = [
        bench_engine(args.model_dir, d, t)
        for t in threads
        for d in ("float32", "bfloat16")
        if "engine" in parts
    ]
    attentions = [bench_attention(args.model_dir, t) for t in threads if "attention" in parts]
    kernel = bench_kernel() if "kernel" in parts else {}
    prefill = bench_prefill(args.model_dir) if "prefill" in parts else {}
    result = {
        "command": "python benchmarks/bench_cpu_engine.py " + " ".join(sys.argv[1:]),
        "machine": machine_info(model_dir=str(args.model_dir)),
        "matmuls": matmuls,
        "engine": engines,
        "attention": attentions,
        "kernel": kernel,
        "prefill": prefill,
    }
    name = (
        "cpu_engine.json"
        if parts >= {"matmuls", "engine", "attention", "kernel"}
        else ("cpu_engine-" + "-".join(sorted(parts)) + ".json")
    )
    write_json(args.results_dir / name, result, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
