"""Part `quant`: weight quantization (fp8, int8, int4) and the FP8 KV cache on the device, each
through the path the model takes there (`tandem.quant.linear.pack_quantized` chooses
it once per matrix: `torch._scaled_mm` for fp8 on CUDA >= 8.9 with bf16 activations, the
Triton dequant-GEMM kernels of `tandem.kernels.quant_matmul` for int8 / int4, torch's packed CPU
kernels on a CPU). Three steps, each guarded: a step that raises is recorded and the later
ones still run.

1. Correctness first, on one random bf16 weight [N, K] (4096 x 4096; std 0.02, Llama's init)
   per scheme (int4: group 128), quantized by `tandem.quant.weight.quantize` (the reference
   quantizer), applied by `quant_matmul` to M = 1 / 16 / 512 / 4096 rows of bf16 activations and
   compared with x @ dequantize().T in float32: int8 and int4 (weight-only) against that;
   fp8 (W8A8, activations quantized per token at run time) against `fp8_reference_matmul`
   (the same product with `quantize_fp8_activations`' x), its distance from the unquantized
   product recorded beside. Tolerance: bf16's of tests/kernels/test_quant_matmul.py. The
   path each scheme took is recorded (`production_path`), and the Triton path is checked as
   well where it is not the production one (fp8 and int4 on CUDA; all three on a CPU, under
   Triton's interpreter). `_scaled_mm`'s rows (above FP8_TRITON_MAX_ROWS) are judged
   norm-wise (FP8_MMA_TOLERANCE). Then the FP8 KV cache: `write_kv` (bytes equal to
   `quantize_kv_reference`'s),
   `paged_decode_attention` and `paged_prefill_attention` over an e4m3 cache (K scale 0.5,
   V scale 0.25, as tests/kernels/test_fp8_kv_kernels.py) against `tandem.kernels.reference` over
   the dequantized cache, on the kernels part's ragged poisoned case (its helpers).
2. Speed of the linear alone in Llama-3-8B's shapes (qkv 6144 x 4096, o 4096 x 4096, gate_up
   28672 x 4096, down 4096 x 14336) at M = 1 / 16 / 64 / 256 / 4096: bf16 `F.linear` vs each
   scheme's production path and every candidate kernel (`candidates`: fp8's Triton W8A8
   kernel and `_scaled_mm`; int4's tinygemm, Triton kernel and dequantize + cuBLAS; int8's
   Triton kernel and dequantize + cuBLAS), and per scheme and row count the fastest summed
   over the shapes (`fastest_by_rows`: what FP8_TRITON_MAX_ROWS, TINYGEMM_MAX_ROWS and
   TRITON_MAX_ROWS should be). A scheme whose production path was wrong in step 1 is not
   timed. Medians of CUDA-event timings after warm-up, L2 flushed before each call.
3. The engine end to end, if the part's budget leaves room for it: e2e's config with room for
   quant_batch requests, on the throughput part's Llama-3-8B-shaped bf16 weights
   (`e2e_bench.weights_dir`), in bf16, then `quantization="fp8"` and `"int4"` (quantized as
   they load), then fp8 with `kv_cache_dtype="fp8"`: batch-1 ITL (`e2e_bench.measure_itl`,
   CUDA graphs on), ITL with quant_batch requests decoding (`measure_batch_itl`), prefill
   tokens/s of one 2048-token prompt (a single step; median of 3 prompts), and each one's
   ratio to bf16 against issue 40's targets (fp8 ITL <= 0.6x, int4 <= 0.4x). Each engine is
   freed before the next loads; one starts only with MIN_ENGINE_S of the budget left.

Wrong results (step 1), an engine that fails, or a decode step not served by a CUDA graph
fail the part; speeds are figures, not targets. With --cpu: tiny shapes, the kernels under
Triton's interpreter and the tiny throughput model in float32 (fp8 runs `fp8_decoded`
there): a smoke run, its times say nothing about speed. Triton is imported inside the part
only; no grpc, redis or kubernetes.
"""

from __future__ import annotations

import functools
import random
import shutil
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch

from .common import (
    Context,
    Figures,
    PartFailed,
    free_memory,
    median_time_s,
    sampling_params,
    sync,
)
from .e2e_bench import (
    BLOCK_SIZE,
    SHARED_MODEL_BUILDER,
    load_engine,
    measure_batch_itl,
    measure_itl,
    release_weights,
    step_bytes,
    weights_dir,
)
from .kernels_bench import (
    Shape,
    cdiv,
    check_decode,
    check_prefill,
    compare,
    sig,
    use_interpreter,
)
from .throughput import SHARED_MODEL_DIR

SCHEMES = ("fp8", "int8", "int4")
DTYPE = torch.bfloat16  # the activations' (the model's) dtype on both devices
WEIGHT_STD = 0.02  # Llama's initializer range
# (atol, rtol) of a bf16 product against its float32 reference: tests/kernels/
# test_quant_matmul.py's bf16 tolerance (output rounding plus fp32 summation order).
LINEAR_TOLERANCE = (4e-2, 2e-2)
# fp8 through `_scaled_mm` (FP8 tensor cores) from FP8_TRITON_MAX_ROWS rows: Hopper's FP8 MMA
# keeps fewer accumulator bits than fp32 between promotions, so a few of millions of outputs
# land past the element-wise tolerance (the 2026-12-04 run: 2 of 2,097,152 at M=512, 0.048
# against 0.04) while the whole is as close as the other paths (relative error 0.0019, a
# fourteenth of what the activations' own e4m3 rounding moves). Judged norm-wise instead:
FP8_MMA_TOLERANCE = {"relative_error": 5e-3, "max_abs_diff_over_max_ref": 1e-2}
K_SCALE, V_SCALE = 0.5, 0.25  # the FP8 KV scales of tests/kernels/test_fp8_kv_kernels.py
KV_SCALES = (K_SCALE, V_SCALE)
FP8 = torch.float8_e4m3fn
MIN_CASE_S = 5.0  # a timed linear case starts only with this much of the budget left
MIN_ENGINE_S = 20.0  # an engine (load, warm-up, measure) starts only with this much left
# Issue 40's targets: batch-1 ITL as a fraction of bf16's (half the weight bytes: ~0.55 at
# the roofline; a quarter: ~0.3)
ITL_RATIO_TARGETS = {"fp8": 0.6, "int4": 0.4}
SMOKE = "smoke: CPU tensors, Triton's interpreter, tiny shapes; times are not speeds"


def random_weight(n: int, k: int, device: str) -> torch.Tensor:
    """A bf16 [n, k] weight with Llama's initial spread."""
    return (torch.randn(n, k, device=device) * WEIGHT_STD).to(DTYPE)


def error_figures(y: torch.Tensor, ref: torch.Tensor) -> Figures:
    """max |y - ref|, that over max |ref|, and ||y - ref|| / ||ref|| (Frobenius)."""
    diff = (y.double() - ref.double()).abs()
    scale = float(ref.double().abs().max()) or 1.0
    norm = float(ref.double().norm()) or 1.0
    return {
        "max_abs_diff": sig(float(diff.max())),
        "max_abs_diff_over_max_ref": sig(float(diff.max()) / scale),
        "relative_error": sig(float(diff.norm()) / norm),
    }


# -- 1. correctness -------------------------------------------------------------------------


def check_linear(scheme: str, ctx: Context) -> Figures:
    """One scheme: its production path (and Triton's, where that is not it) at every row
    count of the sizes against the float32 reference."""
    import tandem.quant.linear as quant_linear
    from tandem.quant.linear import (
        QuantPath,
        Workspace,
        choose_path,
        pack_quantized,
        quant_matmul,
    )
    from tandem.quant.weight import WeightScheme, fp8_reference_matmul, quantize

    sz, dev = ctx.sizes, ctx.device
    # The references in true float32 (TF32 is off by default; kept off whatever ran before).
    torch.backends.cuda.matmul.allow_tf32 = False
    n, k = sz.quant_check_shape
    ws = WeightScheme(scheme)
    qw = quantize(random_weight(n, k, dev), ws, sz.quant_int4_group)
    deq = qw.dequantize(torch.float32)  # [n, k]
    production = choose_path(qw, qw.qweight.device, DTYPE)
    paths = [production, *([QuantPath.TRITON] if production is not QuantPath.TRITON else [])]
    record: Figures = {
        "shape": [n, k],
        "group_size": qw.group_size,
        "production_path": production.value,
        "judged_against": (
            "fp8_reference_matmul (x quantized per token)"
            if ws is WeightScheme.FP8
            else "x @ dequantize().T in float32"
        ),
        "paths": {},
        "passed": True,  # every path checked
        "production_passed": True,
    }
    for path in paths:
        cases: list[Figures] = []
        record["paths"][path.value] = {"production": path is production, "cases": cases}
        try:
            ql = pack_quantized(qw, DTYPE, Workspace(), path)
        except Exception as exc:
            ctx.log(traceback.format_exc().rstrip())
            cases.append({"passed": False, "error": f"pack: {type(exc).__name__}: {exc}"})
            record["passed"] = False
            record["production_passed"] &= path is not production
            continue
        for m in sz.quant_check_rows:
            case: Figures = {"m": m}
            cases.append(case)
            x = torch.randn(m, k, device=dev).to(DTYPE)
            exact = x.float() @ deq.t()  # [m, n]
            try:
                y = quant_matmul(x, ql).float()
                sync(dev)
            except Exception as exc:  # a launch or compile error on this device
                ctx.log(traceback.format_exc().rstrip())
                case.update(passed=False, error=f"{type(exc).__name__}: {exc}")
                record["passed"] = False
                record["production_passed"] &= path is not production
                continue
            ref = fp8_reference_matmul(x, qw) if ws is WeightScheme.FP8 else exact
            case.update(compare(y, ref, *LINEAR_TOLERANCE))
            case.update(error_figures(y, ref))
            if path is QuantPath.FP8_SCALED_MM and m > quant_linear.FP8_TRITON_MAX_ROWS:
                case["judged_by"] = FP8_MMA_TOLERANCE
                case["passed"] = all(case[key] <= tol for key, tol in FP8_MMA_TOLERANCE.items())
            if ws is WeightScheme.FP8:
                case["vs_unquantized_activations"] = error_figures(y, exact)
            record["passed"] &= case["passed"]
            if path is production:
                record["production_passed"] &= case["passed"]
            ctx.log(
                f"quant: {scheme} {path.value}{' (production)' if path is production else ''} "
                f"M={m}: {'ok' if case['passed'] else 'WRONG'}, max |diff| "
                f"{case['max_abs_diff']:.3g}, relative error {case['relative_error']:.3g}"
            )
    return record


def check_fp8_write_kv(shape: Shape, device: str, num_tokens: int = 37) -> Figures:
    from tandem.kernels.kv_write import write_kv
    from tandem.kernels.reference import quantize_kv_reference

    s = shape
    num_blocks = cdiv(num_tokens, s.block_size) + 4
    dims = (s.block_size, s.num_kv_heads, s.head_dim)
    cache = torch.zeros(num_blocks, 2, 2, *dims, dtype=torch.uint8, device=device)
    expected = cache.clone()
    # Wide values: some saturate at 448 x scale, some are e4m3 subnormals.
    k = (torch.randn(num_tokens, s.num_kv_heads, s.head_dim, device=device) * 100).to(s.dtype)
    v = (torch.randn_like(k, dtype=torch.float32) * 1e-2).to(s.dtype)
    slots = torch.randperm(num_blocks * s.block_size, device=device)[:num_tokens]
    block_ids, offsets = slots // s.block_size, slots % s.block_size
    write_kv(k, v, cache.view(FP8)[:, 1], block_ids, offsets, K_SCALE, V_SCALE)
    for i, (t, scale) in enumerate(((k, K_SCALE), (v, V_SCALE))):
        expected[block_ids, 1, i, offsets] = quantize_kv_reference(t, scale).view(torch.uint8)
    wrong = int((cache != expected).sum())
    return {
        "passed": wrong == 0,
        "bytes_differing": wrong,
        "error": None if wrong == 0 else f"{wrong} stored bytes differ from the reference",
    }


# -- 2. the linear's speed ------------------------------------------------------------------


def candidates(qw: Any, ql: Any, x: torch.Tensor, cuda: bool) -> dict[str, Callable[[], Any]]:
    """Every kernel that could serve this matrix at x's row count, by name, beside the
    production path (`quant_matmul`, which picks among them by rows): the timings that set
    FP8_TRITON_MAX_ROWS, TINYGEMM_MAX_ROWS and TRITON_MAX_ROWS."""
    from tandem.kernels.quant_matmul import quantized_linear
    from tandem.quant.linear import QuantPath, fp8_scaled_mm, quant_matmul
    from tandem.quant.weight import WeightScheme

    out: dict[str, Callable[[], Any]] = {"production": functools.partial(quant_matmul, x, ql)}
    fp8 = qw.scheme is WeightScheme.FP8
    out["triton"] = functools.partial(quantized_linear, x, qw, None, fp8)
    if not cuda:  # the smoke run: the CPU path and the kernels under the interpreter
        return out
    if fp8 and ql.path is QuantPath.FP8_SCALED_MM:
        out["scaled_mm"] = functools.partial(fp8_scaled_mm, x, ql)
    if ql.path is QuantPath.INT4_TINYGEMM:
        out["tinygemm"] = functools.partial(
            torch.ops.aten._weight_int4pack_mm, x, ql.packed, ql.group_size, ql.packed_scales
        )
    if not fp8:
        out["dequant_cublas"] = lambda: x @ qw.dequantize(x.dtype).t()
    return out


def fastest_by_rows(shapes: list[Figures], schemes: list[str]) -> Figures:
    """Per scheme and row count: each candidate's time summed over the shapes timed, and the
    fastest (what the row thresholds should pick)."""
    table: Figures = {}
    for scheme in schemes:
        by_rows: Figures = {}
        for shape in shapes:
            for case in shape.get("cases", []):
                kernels = case.get(scheme, {}).get("candidates_ms", {})
                row = by_rows.setdefault(str(case["m"]), {"total_ms": {}})
                for name, ms in kernels.items():
                    row["total_ms"][name] = round(row["total_ms"].get(name, 0.0) + ms, 4)
        for row in by_rows.values():
            totals = row["total_ms"]
            row["fastest"] = min(totals, key=totals.get) if totals else None
        table[scheme] = by_rows
    return table


def bench_linears(ctx: Context, schemes: list[str], flush: torch.Tensor | None) -> Figures:
    """Every shape x row count: bf16 F.linear and each scheme's production path."""
    from tandem.quant.linear import Workspace, pack_quantized
    from tandem.quant.weight import WeightScheme, quantize

    sz, dev = ctx.sizes, ctx.device
    shapes: list[Figures] = []
    for name, n, k in sz.quant_bench_shapes:
        shape: Figures = {"name": name, "n": n, "k": k, "cases": []}
        shapes.append(shape)
        if ctx.left_s() < MIN_CASE_S:
            shape["skipped"] = "out of the part's time budget"
            continue
        w = random_weight(n, k, dev)
        packed: dict[str, Any] = {}
        qws: dict[str, Any] = {}
        errors: dict[str, str] = {}
        for scheme in schemes:
            try:
                qws[scheme] = qw = quantize(w, WeightScheme(scheme), sz.quant_int4_group)
                packed[scheme] = pack_quantized(qw, DTYPE, Workspace())
            except Exception as exc:
                errors[scheme] = f"{type(exc).__name__}: {exc}"
        shape["weight_bytes"] = {
            "bf16": w.numel() * w.element_size(),
            **{scheme: ql.num_bytes() for scheme, ql in packed.items()},
        }
        shape["paths"] = {scheme: ql.path.value for scheme, ql in packed.items()}
        if errors:
            shape["errors"] = errors
        for m in sz.quant_bench_rows:
            case: Figures = {"m": m}
            shape["cases"].append(case)
            if ctx.left_s() < MIN_CASE_S:
                case["skipped"] = "out of the part's time budget"
                continue
            x = torch.randn(m, k, device=dev).to(DTYPE)
            time_s = functools.partial(median_time_s, device=dev, reps=sz.kn_reps, flush=flush)
            bf16_s = time_s(functools.partial(torch.nn.functional.linear, x, w))
            case["bf16_ms"] = round(bf16_s * 1e3, 4)
            line = [f"bf16 {bf16_s * 1e3:.4g} ms"]
            for scheme, ql in packed.items():
                kernels: Figures = {}
                try:
                    for kernel, fn in candidates(qws[scheme], ql, x, ctx.cuda).items():
                        kernels[kernel] = round(time_s(fn) * 1e3, 4)
                except Exception as exc:
                    ctx.log(traceback.format_exc().rstrip())
                    case[scheme] = {"error": f"{type(exc).__name__}: {exc}"}
                    line.append(f"{scheme} error")
                    continue
                seconds = kernels["production"] / 1e3
                case[scheme] = {
                    "ms": kernels["production"],
                    "speedup_vs_bf16": round(bf16_s / seconds, 3),
                    "candidates_ms": kernels,
                }
                others = ", ".join(f"{k} {v:.4g}" for k, v in kernels.items() if k != "production")
                line.append(f"{scheme} {seconds * 1e3:.4g} ms ({bf16_s / seconds:.2f}x; {others})")
            ctx.log(f"quant: {name} [{n}x{k}] M={m}: " + ", ".join(line))
            del x
        del w, packed, qws
        free_memory(dev)
    return {
        "shapes": shapes,
        "schemes": schemes,
        "speedup": "bf16 F.linear time / the scheme's production path time (> 1: faster)",
        "fastest_by_rows": fastest_by_rows(shapes, schemes),
    }


def bench_bf16_gemms(ctx: Context, flush: torch.Tensor | None) -> Figures:
    """bf16 projections at decode batches (rows <= 16 of quant_bench_rows), the engine's
    layout (`x @ w`, w [in, out]) and `F.linear`'s, against the split-K candidate
    (`tandem.kernels.gemv`, checked against the float32 product first), each as weight bytes
    read per second and that over the rate cuBLAS reaches on one large matrix (x @ w of
    16384 x 16384, the same rows) in this run."""
    from tandem.kernels.gemv import MAX_ROWS, splitk_matmul

    sz, dev = ctx.sizes, ctx.device
    rows = [m for m in sz.quant_bench_rows if m <= MAX_ROWS]
    time_s = functools.partial(median_time_s, device=dev, reps=sz.kn_reps, flush=flush)
    side = 16384 if ctx.cuda else 256
    big = random_weight(side, side, dev)
    limit: Figures = {"shape": [side, side]}
    for m in rows:
        x = torch.randn(m, side, device=dev).to(DTYPE)
        limit[str(m)] = sig(big.numel() * 2 / time_s(functools.partial(torch.matmul, x, big)) / 1e9)
    del big
    free_memory(dev)
    shapes: list[Figures] = []
    wrong: list[str] = []
    for name, n, k in sz.quant_bench_shapes:
        if ctx.left_s() < MIN_CASE_S:
            shapes.append({"name": name, "skipped": "out of the part's time budget"})
            continue
        w = random_weight(n, k, dev)  # [out, in]: F.linear's layout
        wt = w.t().contiguous()  # [in, out]: the engine's
        nbytes = w.numel() * w.element_size()
        shape: Figures = {"name": name, "n": n, "k": k, "weight_bytes": nbytes, "cases": []}
        shapes.append(shape)
        for m in rows:
            x = torch.randn(m, k, device=dev).to(DTYPE)
            check = compare(splitk_matmul(x, wt).float(), x.float() @ wt.float(), *LINEAR_TOLERANCE)
            case: Figures = {"m": m, "splitk_correct": check["passed"]}
            if not check["passed"]:
                wrong.append(f"splitk {name} M={m}: {check['error']}")
            kernels = {
                "engine_layout": functools.partial(torch.matmul, x, wt),
                "f_linear": functools.partial(torch.nn.functional.linear, x, w),
                "splitk": functools.partial(splitk_matmul, x, wt),
            }
            for kernel, fn in kernels.items():
                if kernel == "splitk" and not check["passed"]:
                    continue
                gb_s = nbytes / time_s(fn) / 1e9
                case[kernel] = {
                    "gb_s": sig(gb_s),
                    "of_large_matrix_rate": round(gb_s / limit[str(m)], 3),
                }
            shape["cases"].append(case)
            ctx.log(
                f"quant: bf16 {name} [{n}x{k}] M={m}: "
                + ", ".join(
                    f"{kk} {v['of_large_matrix_rate']}"
                    for kk, v in case.items()
                    if isinstance(v, dict)
                )  # fmt: skip
                + f" of cuBLAS's large-matrix {limit[str(m)]} GB/s"
            )
        del w, wt
        free_memory(dev)
    return {"large_matrix_gb_s": limit, "shapes": shapes, "wrong": wrong,
            "passed": not wrong}  # fmt: skip


# -- 3. the engine --------------------------------------------------------------------------


def measure_prefill(engine: Any, ctx: Context) -> Figures:
    """Prefill of one prompt of quant_prefill_len tokens, one step (it fits the step's token
    budget), each of quant_prefill_reps distinct random prompts (no prefix hit): median."""
    s, dev = ctx.sizes, ctx.device
    rng = random.Random(1)
    step_s: list[float] = []
    steps: list[int] = []
    for i in range(s.quant_prefill_reps):
        prompt = rng.choices(range(1, s.tp_shape["vocab_size"]), k=s.quant_prefill_len)
        params = sampling_params(max_tokens=1, temperature=0.0, ignore_eos=True)
        engine.add_request(engine.spec(f"prefill-{i}", prompt, params))
        t0 = time.perf_counter()
        n = 0
        while engine.has_unfinished():
            engine.step()
            n += 1
        sync(dev)
        step_s.append(time.perf_counter() - t0)
        steps.append(n)
    median = sorted(step_s)[len(step_s) // 2]
    return {
        "prompt_len": s.quant_prefill_len,
        "steps_per_prompt": steps,
        "prefill_ms": round(median * 1e3, 3),
        "prefill_ms_all": [round(t * 1e3, 3) for t in step_s],
        "tokens_per_s": sig(s.quant_prefill_len / median),
    }


def linear_path(engine: Any) -> str:
    """The first layer's qkv matrix: its QuantLinear path, or its dense dtype."""
    qkv = engine.model.weights.layers[0].qkv
    path = getattr(qkv, "path", None)
    return path.value if path is not None else f"dense {str(qkv.dtype).removeprefix('torch.')}"


def run_engine_case(ctx: Context, model_dir: Any, prompt: list[int], **config: Any) -> Figures:
    """Load and warm up one engine (e2e's config, room for quant_batch requests, plus
    `config`): batch-1 ITL, batch-quant_batch ITL, prefill; freed."""
    s = ctx.sizes
    rng = random.Random(2)
    prompts = [
        rng.choices(range(1, s.tp_shape["vocab_size"]), k=s.quant_batch_prompt_len)
        for _ in range(s.quant_batch)
    ]
    per_request = s.quant_batch_prompt_len + 1 + s.e2e_warm_steps + s.e2e_steps + s.quant_batch
    room = max(s.e2e_num_blocks, s.quant_batch * -(-per_request // BLOCK_SIZE) + 16)
    config = {"max_num_seqs": max(s.e2e_max_num_seqs, s.quant_batch), "num_blocks": room, **config}
    engine, figures = load_engine(ctx, model_dir, ctx.cuda, **config)
    try:
        figures["linear_path"] = linear_path(engine)
        figures["weight_bytes"] = step_bytes(engine)[1]
        itl, _ = measure_itl(engine, prompt, ctx)
        figures.update(itl)
        figures["batch"] = measure_batch_itl(engine, prompts, ctx)
        figures["prefill"] = measure_prefill(engine, ctx)
    finally:
        del engine
        free_memory(ctx.device)
    return figures


def bench_engine(ctx: Context) -> Figures:
    """fp8 (quantized at load), then bf16, then fp8 with an fp8 KV cache, on the same
    weights; each only with budget left."""
    s = ctx.sizes
    figures: Figures = {"dtype": s.tp_dtype, "prompt_len": s.e2e_prompt_len}
    model_dir, source = weights_dir(ctx, "quant")
    figures.update(source)
    prompt = random.Random(0).choices(range(1, s.tp_shape["vocab_size"]), k=s.e2e_prompt_len)
    # the unquantized engine is labelled by its dtype: bfloat16 (float32 in the CPU smoke run)
    try:
        for label, config in (
            (s.tp_dtype, {}),
            ("fp8", {"quantization": "fp8"}),
            ("int4", {"quantization": "int4"}),
            ("fp8_with_fp8_kv", {"quantization": "fp8", "kv_cache_dtype": "fp8"}),
        ):
            if ctx.left_s() < MIN_ENGINE_S:
                figures[label] = {"skipped": "out of the part's time budget"}
                ctx.log(f"quant: engine {label}: skipped, out of the part's time budget")
                continue
            try:
                figures[label] = record = run_engine_case(ctx, model_dir, prompt, **config)
            except Exception as exc:
                ctx.log(traceback.format_exc().rstrip())
                figures[label] = {"error": f"{type(exc).__name__}: {exc}"}
                free_memory(ctx.device)
                continue
            ctx.log(
                f"quant: engine {label} ({record['linear_path']}, "
                f"{record['weight_bytes'] / 2**20:.1f} MiB): ITL {record['itl_ms']} ms "
                f"({record['graph_replays']} graph replays), batch {record['batch']['batch']} "
                f"ITL {record['batch']['itl_ms']} ms, prefill "
                f"{record['prefill']['prompt_len']} tokens {record['prefill']['prefill_ms']} ms "
                f"= {record['prefill']['tokens_per_s']:.4g} tokens/s"
            )
    finally:
        release_weights(ctx, model_dir, source["weights_built_by"])  # the last: removed
    base = figures.get(s.tp_dtype, {})
    speedups: Figures = {}
    for label in ("fp8", "int4", "fp8_with_fp8_kv"):
        quant = figures.get(label, {})
        if "itl_ms" in base and "itl_ms" in quant:
            speedups[label] = {
                "itl": round(base["itl_ms"] / quant["itl_ms"], 3),
                "itl_ratio": round(quant["itl_ms"] / base["itl_ms"], 3),
                "batch_itl_ratio": round(quant["batch"]["itl_ms"] / base["batch"]["itl_ms"], 3),
                "prefill": round(
                    quant["prefill"]["tokens_per_s"] / base["prefill"]["tokens_per_s"], 3
                ),
            }
            target = ITL_RATIO_TARGETS.get(label)
            if target is not None:
                speedups[label]["itl_ratio_target"] = target
                met = quant["itl_ms"] / base["itl_ms"] <= target
                speedups[label]["met"] = met if ctx.cuda else None  # a smoke run: not judged
    figures[f"speedup_vs_{s.tp_dtype}"] = speedups
    e2e = ctx.results.get("e2e", {})
    if e2e.get("status") == "ok":
        figures["e2e_part_itl_ms"] = e2e["figures"]["graphs" if ctx.cuda else "eager"].get("itl_ms")
    return figures


# -- the part -------------------------------------------------------------------------------


def guarded(ctx: Context, name: str, fn: Callable[[], Figures]) -> Figures:
    """fn(), or {"passed": False, "error": ...} with its traceback logged."""
    try:
        return fn()
    except Exception as exc:
        ctx.log(traceback.format_exc().rstrip())
        return {"passed": False, "error": f"{name}: {type(exc).__name__}: {exc}"}


def check_quant(ctx: Context) -> Figures:
    sz, dev = ctx.sizes, ctx.device
    if not ctx.cuda:
        use_interpreter()
    from tandem.kernels import decode_attention, kv_write, prefill_attention, quant_matmul
    from tandem.weights.loader import DTYPES

    jitted = [quant_matmul._scaled_matmul_kernel, quant_matmul._int4_matmul_kernel]
    jitted += [kv_write._write_kv_kernel, decode_attention._decode_split_kernel]
    jitted.append(prefill_attention._prefill_kernel)
    if not ctx.cuda and not all(type(k).__name__ == "InterpretedFunction" for k in jitted):
        raise PartFailed(
            "the kernels were defined before TRITON_INTERPRET=1 was set, so they cannot run on "
            "CPU tensors: something imported kernels.* before this part",
            {},
        )
    figures: Figures = {
        "mode": "benchmark" if ctx.cuda else SMOKE,
        "activation_dtype": str(DTYPE).removeprefix("torch."),
        "weight_std": WEIGHT_STD,
        "linear_tolerance": {"atol": LINEAR_TOLERANCE[0], "rtol": LINEAR_TOLERANCE[1]},
        "compute_capability": (
            ".".join(map(str, torch.cuda.get_device_capability())) if ctx.cuda else None
        ),
    }
    torch.manual_seed(0)
    wrong: list[str] = []

    # 1. correctness: the linears, then the FP8 KV kernels
    linears: dict[str, Figures] = {}
    for scheme in SCHEMES:
        check = functools.partial(check_linear, scheme, ctx)
        linears[scheme] = record = guarded(ctx, scheme, check)
        paths = record.get("paths", {})
        for path, p in paths.items():
            for case in p["cases"]:
                if not case.get("passed"):
                    what = f"M={case['m']}" if "m" in case else "pack"
                    why = (
                        f"max |diff| {case['max_abs_diff']:.3g}"
                        if case.get("max_abs_diff") is not None
                        else str(case.get("error"))[:200]
                    )
                    wrong.append(f"{scheme} {path} {what} ({why})")
        if not paths:
            wrong.append(f"{scheme}: {record.get('error')}")
        ctx.log(
            f"quant: {scheme}: production path {record.get('production_path')}: "
            f"{'ok' if record.get('production_passed') else 'WRONG'}; every path checked: "
            f"{'ok' if record['passed'] else 'WRONG'}"
        )
    figures["linear_correctness"] = linears
    free_memory(dev)

    shape = Shape(
        sz.kn_num_q_heads, sz.kn_num_kv_heads, sz.kn_head_dim, sz.kn_block_size, DTYPES[sz.kn_dtype]
    )
    checks: dict[str, Callable[[], Figures]] = {
        "write_kv": lambda: check_fp8_write_kv(shape, dev),
        "decode": lambda: check_decode(shape, sz.kn_check_context_lens, dev, KV_SCALES),
        "prefill": lambda: check_prefill(shape, sz.kn_check_chunks, dev, KV_SCALES),
    }
    kv: Figures = {
        "shape": {**shape._asdict(), "dtype": sz.kn_dtype},
        "k_scale": K_SCALE,
        "v_scale": V_SCALE,
    }
    for name, check in checks.items():
        kv[name] = record = guarded(ctx, name, check)
        if not record["passed"]:
            wrong.append(f"fp8 KV {name}")
        diff = record.get("max_abs_diff")
        detail = f", max |diff| {diff:.3g}" if diff is not None else ""
        ctx.log(
            f"quant: fp8 KV {name} vs tandem.kernels.reference: "
            f"{'ok' if record['passed'] else 'WRONG'}{detail}"
            + (f": {record['error']}" if record.get("error") else "")
        )
    figures["fp8_kv_correctness"] = kv
    free_memory(dev)

    # 2. the linear's speed: the schemes whose production path was right
    timed = [s for s in SCHEMES if linears[s].get("production_passed")]
    flush = (
        torch.empty(sz.kn_flush_bytes, dtype=torch.uint8, device=dev) if sz.kn_flush_bytes else None
    )
    bench = functools.partial(bench_linears, ctx, timed, flush)
    figures["linear_speed"] = guarded(ctx, "linear speed", bench)
    del bench
    gemms = guarded(ctx, "bf16 gemms", functools.partial(bench_bf16_gemms, ctx, flush))
    figures["bf16_gemms"] = gemms
    if not gemms.get("passed", False):
        wrong.append(f"bf16 gemms: {gemms.get('wrong') or gemms.get('error')}")
    del flush
    free_memory(dev)

    # 3. the engine, fp8 vs bf16
    if ctx.left_s() < MIN_ENGINE_S:
        figures["engine"] = {"skipped": "out of the part's time budget"}
        ctx.log("quant: engine: skipped, out of the part's time budget")
        left = ctx.shared.pop(SHARED_MODEL_DIR, None)
        ctx.shared.pop(SHARED_MODEL_BUILDER, None)
        if left is not None:
            shutil.rmtree(left, ignore_errors=True)
    else:
        figures["engine"] = engine = guarded(ctx, "engine", lambda: bench_engine(ctx))
        if "error" in engine:
            wrong.append(str(engine["error"]))
        for label, e in engine.items():
            if not isinstance(e, dict):
                continue
            if "error" in e:
                wrong.append(f"engine {label}: {e['error']}")
            elif ctx.cuda and "graph_replays" in e and e["graph_replays"] < e["steps"] - 1:
                wrong.append(
                    f"engine {label}: {e['graph_replays']} CUDA graph replays for "
                    f"{e['steps'] - 1} decode steps"
                )
    if not ctx.cuda:
        figures["note"] = "not judged as speed: a smoke run"
    if wrong:
        raise PartFailed(f"wrong or failed on {dev}: " + "; ".join(wrong), figures)
    return figures
