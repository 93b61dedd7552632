"""Part `e2e`: batch-1 inter-token latency (ITL) of the engine on the throughput part's
Llama-3-8B-shaped model (random bf16 weights), against the memory roofline.

- ITL: the median wall-clock time of an `engine.step()` over `e2e_steps` decode steps of one
  greedy request (after the prefill step and `e2e_warm_steps` untimed ones). A step returns
  its sampled token to the host, so its wall time is the latency a client sees per token.
- Two engines of the same config (explicit `num_blocks`, both `warm_up()`ed), one after the
  other (the first freed before the second loads): CUDA graphs on (captured in warm-up; the
  part counts the replays, so a step that ran eagerly is visible) and `cuda_graphs=False`.
- Roofline: a decode step reads every weight once, except the embedding table (one row per
  token; counted when tied to the LM head), so ITL_roofline = those bytes / the device copy
  bandwidth (bytes read + written by `copy_`, measured here). Target ITL_roofline /
  ITL_measured (graphs on) >= 0.8 (issue 40). The KV read at this context (~0.5% of the
  bytes) is left out.
- Where the time goes: `profile_steps` decode steps of the graphs engine (eager on a CPU)
  under `torch.profiler`, each kernel's device time (CPU: each op's own time) summed by
  category (`kernel_category`: gemm, attention, kv_write, moe, norm_rope_act, sampling,
  copy, other), as shares of the profiled total and milliseconds per step.

The weights directory comes from the throughput part when it ran first (`SHARED_MODEL_DIR`),
else this part builds and writes it; either way it removes it, unless the quant part follows
(`release_weights`: quant takes it, then removes it). With --cpu: the tiny fp32
model with attention_backend "torch"; CUDA graphs do not exist there (reported as skipped),
and the figures are a smoke run, not performance. Imports no grpc, redis or kubernetes.
"""

from __future__ import annotations

import logging
import random
import shutil
import statistics
import time
from pathlib import Path
from typing import Any

from .common import (
    Context,
    Figures,
    PartFailed,
    copy_bandwidth,
    free_memory,
    make_engine,
    sampling_params,
    sync,
)
from .throughput import SHARED_MODEL_DIR, build_random_llama, save_sharded

# ctx.shared key of the part that wrote SHARED_MODEL_DIR's directory (absent: throughput)
SHARED_MODEL_BUILDER = "llama_model_builder"

ROOFLINE_TARGET = 0.8  # ITL_roofline / ITL_measured, graphs on (issue 40)
PROFILE_STEPS = 16
# kernel_category: the first category one of whose words is in a kernel's (or op's) name,
# lower-cased; our Triton kernels by their function names, cuBLAS/CUTLASS by theirs.
CATEGORIES = (
    ("attention", ("decode_split", "decode_reduce", "_decode", "prefill_kernel", "flash",
                   "attention", "sdpa", "fmha")),
    ("kv_write", ("write_kv",)),
    ("moe", ("fused_moe", "gate_up_kernel", "down_kernel", "grouped_mm")),
    ("gemm", ("gemm", "nvjet", "cutlass", "xmma", "matmul", "int4pack", "scaled_mm",
              "aten::mm", "aten::addmm", "aten::bmm", "aten::linear", "cublas", "mkldnn",
              "onednn", "packed")),
    ("sampling", ("argmax", "softmax", "topk", "sort", "sample", "multinomial", "cumsum")),
    ("norm_rope_act", ("rms", "norm", "rope", "rotary", "silu", "swiglu", "act_and_mul")),
    ("copy", ("memcpy", "memset", "copy", "fill", "cat", "index")),
)  # fmt: skip
BLOCK_SIZE = 16
SMOKE = "smoke: tiny model on a CPU; the times are not performance figures"


def weights_dir(ctx: Context, part: str = "e2e") -> tuple[Path, Figures]:
    """The throughput part's saved weights if it left them, else built and written here
    (by `part`, for the log and the directory's name)."""
    from tandem.weights.loader import DTYPES

    shared = ctx.shared.pop(SHARED_MODEL_DIR, None)
    builder = ctx.shared.pop(SHARED_MODEL_BUILDER, "throughput")
    if shared is not None and Path(shared).is_dir():
        return Path(shared), {
            "weights_from": f"the {builder} part's directory",
            "weights_built_by": builder,
        }
    s, dev = ctx.sizes, ctx.device
    t0 = time.perf_counter()
    hf = build_random_llama(s.tp_shape, DTYPES[s.tp_dtype], dev)
    sync(dev)
    build_s = time.perf_counter() - t0
    need = sum(p.numel() * p.element_size() for p in hf.parameters())
    free = shutil.disk_usage(ctx.tmp_dir).free
    if free < 1.2 * need:
        raise RuntimeError(
            f"{ctx.tmp_dir} has {free / 2**30:.1f} GiB free, need {need / 2**30:.1f}"
        )
    out = ctx.tmp_dir / f"{part}-model"
    t0 = time.perf_counter()
    save_sharded(hf, out)
    del hf
    free_memory(dev)
    figures = {
        "weights_from": "built by this part",
        "weights_built_by": part,
        "hf_build_s": round(build_s, 2),
        "weights_write_s": round(time.perf_counter() - t0, 2),
    }
    ctx.log(f"{part}: built and wrote the weights ({figures})")
    return out, figures


def release_weights(ctx: Context, model_dir: Path, builder: str, *takers: str) -> None:
    """Leave the weights directory (written by the part `builder`) to a later part of
    `takers` selected in this run (it takes it with `weights_dir`), else remove it."""
    if any(part in ctx.parts for part in takers):
        ctx.shared[SHARED_MODEL_DIR] = model_dir
        ctx.shared[SHARED_MODEL_BUILDER] = builder
    else:
        shutil.rmtree(model_dir, ignore_errors=True)


def step_bytes(engine: Any) -> tuple[int, int]:
    """(weight bytes a decode step reads, all weight bytes): all but the embedding table,
    unless the LM head is that table."""
    weights = engine.model.weights
    total = weights.num_bytes()
    tied = weights.lm_head.data_ptr() == weights.embed.data_ptr()
    embed = weights.embed.numel() * weights.embed.element_size()
    return (total if tied else total - embed), total


def measure_itl(engine: Any, prompt: list[int], ctx: Context) -> tuple[Figures, list[int]]:
    """One greedy request: per-step wall times; ITL over the decode steps after the warm
    ones. Returns (figures, generated tokens)."""
    s, dev = ctx.sizes, ctx.device
    n = 1 + s.e2e_warm_steps + s.e2e_steps
    params = sampling_params(max_tokens=n, temperature=0.0, ignore_eos=True)
    engine.add_request(engine.spec("itl", prompt, params))
    graphs = engine.runner.graphs
    replays = 0
    if graphs is not None:
        replay = graphs.replay

        def counted(*args: Any, **kwargs: Any) -> Any:
            nonlocal replays
            replays += 1
            return replay(*args, **kwargs)

        graphs.replay = counted  # counts the steps served by a graph (instance attribute)
    step_s: list[float] = []
    tokens: list[int] = []
    try:
        while engine.has_unfinished():
            t0 = time.perf_counter()
            for out in engine.step():
                tokens.extend(out.new_token_ids)
            sync(dev)
            step_s.append(time.perf_counter() - t0)
    finally:
        if graphs is not None:
            del graphs.replay
    decode_s = sorted(step_s[1 + s.e2e_warm_steps :])  # step 0: the prompt's prefill
    figures = {
        "itl_ms": round(statistics.median(decode_s) * 1e3, 3),
        "itl_ms_min": round(decode_s[0] * 1e3, 3),
        "itl_ms_p90": round(decode_s[int(0.9 * (len(decode_s) - 1))] * 1e3, 3),
        "prefill_step_ms": round(step_s[0] * 1e3, 3),
        "timed_steps": len(decode_s),
        "graph_replays": replays,
        "steps": len(step_s),
    }
    return figures, tokens


def measure_batch_itl(engine: Any, prompts: list[list[int]], ctx: Context) -> Figures:
    """`prompts` decoding together, greedy: ITL over the steps where every one of them is
    decoding (after their prefills and e2e_warm_steps more), median of e2e_steps steps."""
    s, dev = ctx.sizes, ctx.device
    n = 1 + s.e2e_warm_steps + s.e2e_steps + len(prompts)  # room for staggered prefills
    params = sampling_params(max_tokens=n, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(engine.spec(f"batch-{i}", prompt, params))
    started: set[str] = set()
    step_s: list[float] = []
    warm = 0
    while engine.has_unfinished() and len(step_s) < s.e2e_steps:
        t0 = time.perf_counter()
        outs = engine.step()
        sync(dev)
        elapsed = time.perf_counter() - t0
        all_decoding = len(started) == len(prompts)  # before this step: decode rows only
        started.update(out.request_id for out in outs if out.new_token_ids)
        if all_decoding:
            if warm < s.e2e_warm_steps:
                warm += 1
            else:
                step_s.append(elapsed)
    for i in range(len(prompts)):
        engine.abort(f"batch-{i}")
    while engine.has_unfinished():
        engine.step()
    if not step_s:
        raise RuntimeError(f"no step had all {len(prompts)} requests decoding")
    return {
        "batch": len(prompts),
        "prompt_len": len(prompts[0]),
        "itl_ms": round(statistics.median(step_s) * 1e3, 3),
        "itl_ms_min": round(min(step_s) * 1e3, 3),
        "timed_steps": len(step_s),
        "output_tokens_per_s": round(len(prompts) / statistics.median(step_s), 1),
    }


def load_engine(
    ctx: Context, model_dir: Path, cuda_graphs: bool, **config: Any
) -> tuple[Any, Figures]:
    """Load and warm up one engine of this part's config (`config`: more EngineConfig or
    SchedulerConfig fields, e.g. quantization, or this config's own replaced, e.g.
    num_blocks, max_num_seqs). Returns (engine, figures)."""
    s, dev = ctx.sizes, ctx.device
    t0 = time.perf_counter()
    num_blocks = config.pop("num_blocks", s.e2e_num_blocks)
    engine = make_engine(
        model_dir,
        dev,
        s.tp_dtype,
        **{
            "block_size": BLOCK_SIZE,
            "num_blocks": num_blocks,
            "max_model_len": min(num_blocks * BLOCK_SIZE, s.tp_shape["max_position_embeddings"]),
            "max_num_seqs": s.e2e_max_num_seqs,
            "max_num_batched_tokens": s.e2e_max_num_batched_tokens,
            "attention_backend": ctx.attention_backend if ctx.cuda else "torch",
            "cuda_graphs": cuda_graphs,
            **config,
        },
    )
    sync(dev)
    load_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    logging.getLogger("tandem").setLevel(logging.INFO)  # the graph capture's line
    try:
        engine.warm_up()
    finally:
        logging.getLogger("tandem").setLevel(logging.WARNING)
    sync(dev)
    warm_s = time.perf_counter() - t0
    graphs = engine.runner.graphs
    figures: Figures = {
        "load_s": round(load_s, 2),
        "warm_up_s": round(warm_s, 2),
        "attention_backend": type(engine.model.attention).__name__,
        "cuda_graph_sizes": list(graphs.sizes) if graphs is not None else None,
    }
    return engine, figures


def run_engine(
    ctx: Context, model_dir: Path, cuda_graphs: bool, prompt: list[int], profiled: bool = False
) -> tuple[Figures, list[int], tuple[int, int]]:
    """Load, warm up, measure (and with `profiled`, profile), free one engine. Returns
    (figures, tokens, step_bytes)."""
    engine, figures = load_engine(ctx, model_dir, cuda_graphs)
    graphs = engine.runner.graphs
    itl, tokens = measure_itl(engine, prompt, ctx)
    figures.update(itl)
    if profiled:
        figures["profile"] = profile_shares(engine, prompt, ctx)
        shares = ", ".join(f"{c} {v:.0%}" for c, v in figures["profile"]["share"].items())
        ctx.log(f"e2e: profile ({figures['profile']['measured']}): {shares}")
    nbytes = step_bytes(engine)
    del engine, graphs
    free_memory(ctx.device)
    return figures, tokens, nbytes


def kernel_category(name: str) -> str:
    """The category of a kernel or op name (CATEGORIES' first match), else "other"."""
    low = name.lower()
    for category, words in CATEGORIES:
        if any(w in low for w in words):
            return category
    return "other"


def profile_shares(engine: Any, prompt: list[int], ctx: Context) -> Figures:
    """PROFILE_STEPS decode steps of one greedy request under torch.profiler (after its
    prefill and e2e_warm_steps): device time per kernel category on CUDA (CPU: each op's own
    CPU time), as shares of the total and ms per step, and the ten largest kernels."""
    from torch.profiler import ProfilerActivity, profile

    s, dev = ctx.sizes, ctx.device
    params = sampling_params(
        max_tokens=2 + s.e2e_warm_steps + PROFILE_STEPS, temperature=0.0, ignore_eos=True
    )
    engine.add_request(engine.spec("profile", prompt, params))
    for _ in range(1 + s.e2e_warm_steps):
        engine.step()
    sync(dev)
    activities = [ProfilerActivity.CUDA] if ctx.cuda else [ProfilerActivity.CPU]
    with profile(activities=activities) as prof:
        for _ in range(PROFILE_STEPS):
            engine.step()
        sync(dev)
    while engine.has_unfinished():
        engine.step()
    per_kernel: dict[str, float] = {}
    for event in prof.key_averages():
        us = event.self_device_time_total if ctx.cuda else event.self_cpu_time_total
        if us > 0:
            per_kernel[event.key] = per_kernel.get(event.key, 0.0) + us
    total = sum(per_kernel.values()) or 1.0
    by_category: dict[str, float] = {}
    for name, us in per_kernel.items():
        category = kernel_category(name)
        by_category[category] = by_category.get(category, 0.0) + us
    top = sorted(per_kernel.items(), key=lambda kv: -kv[1])[:10]
    return {
        "steps": PROFILE_STEPS,
        "measured": "device time per kernel" if ctx.cuda else "CPU time per op (self)",
        "ms_per_step": round(total / PROFILE_STEPS / 1e3, 4),
        "share": {c: round(us / total, 4) for c, us in sorted(by_category.items())},
        "ms_per_step_by_category": {
            c: round(us / PROFILE_STEPS / 1e3, 4) for c, us in sorted(by_category.items())
        },
        "top_kernels": [
            {"name": n[:120], "category": kernel_category(n), "share": round(us / total, 4)}
            for n, us in top
        ],
    }


def check_e2e(ctx: Context) -> Figures:
    s, dev = ctx.sizes, ctx.device
    figures: Figures = {
        "mode": "benchmark" if ctx.cuda else SMOKE,
        "model_shape": s.tp_shape,
        "dtype": s.tp_dtype,
        "prompt_len": s.e2e_prompt_len,
        "engine": {
            "num_blocks": s.e2e_num_blocks,
            "block_size": BLOCK_SIZE,
            "max_num_seqs": s.e2e_max_num_seqs,
            "max_num_batched_tokens": s.e2e_max_num_batched_tokens,
        },
    }
    figures["copy"] = copy_bandwidth(dev, s.kn_copy_bytes, reps=s.kn_reps)
    free_memory(dev)
    ctx.log(f"e2e: device copy {figures['copy']['gb_s']} GB/s (read + written)")
    model_dir, source = weights_dir(ctx)
    figures.update(source)
    rng = random.Random(0)
    prompt = rng.choices(range(1, s.tp_shape["vocab_size"]), k=s.e2e_prompt_len)
    try:
        tokens: dict[str, list[int]] = {}
        if ctx.cuda:
            figures["graphs"], tokens["graphs"], nbytes = run_engine(
                ctx, model_dir, True, prompt, profiled=True
            )
            g = figures["graphs"]
            ctx.log(f"e2e: CUDA graphs: ITL {g['itl_ms']} ms ({g['graph_replays']} replays)")
            if not g["cuda_graph_sizes"] or g["graph_replays"] < g["steps"] - 1:
                raise PartFailed(
                    f"CUDA graphs: sizes {g['cuda_graph_sizes']}, {g['graph_replays']} replays "
                    f"for {g['steps'] - 1} decode steps: decode steps did not replay graphs",
                    figures,
                )
        else:
            figures["graphs"] = {
                "status": "skipped",
                "reason": "CUDA graphs need CUDA; the CPU engine runs attention_backend torch",
            }
        figures["eager"], tokens["eager"], nbytes = run_engine(
            ctx, model_dir, False, prompt, profiled=not ctx.cuda
        )
        ctx.log(f"e2e: eager: ITL {figures['eager']['itl_ms']} ms")
    finally:
        release_weights(ctx, model_dir, source["weights_built_by"], "quant")

    measured = figures["graphs"] if ctx.cuda else figures["eager"]
    if ctx.cuda:
        figures["graphs_speedup"] = round(figures["eager"]["itl_ms"] / measured["itl_ms"], 3)
        # Not a check: a split-K count that differs with the graph's block-table width changes
        # fp32 summation order, and random weights give near-ties that greedy can flip.
        figures["tokens_identical_graphs_vs_eager"] = tokens["graphs"] == tokens["eager"]
    read_bytes, total_bytes = nbytes
    roofline_s = read_bytes / (figures["copy"]["gb_s"] * 1e9)
    ratio = roofline_s * 1e3 / measured["itl_ms"]
    figures["roofline"] = {
        "weight_bytes": total_bytes,
        "weight_bytes_read_per_step": read_bytes,
        "itl_roofline_ms": round(roofline_s * 1e3, 3),
        "itl_measured_ms": measured["itl_ms"],
        "measured_with": "cuda graphs" if ctx.cuda else "eager (CPU)",
        "ratio": round(ratio, 3),
        "target": ROOFLINE_TARGET,
        "met": ratio >= ROOFLINE_TARGET if ctx.cuda else None,
    }
    if not ctx.cuda:
        figures["roofline"].update(met=None, note="not judged: a smoke run")
    ctx.log(
        f"e2e: roofline {figures['roofline']['itl_roofline_ms']} ms / measured "
        f"{measured['itl_ms']} ms = {ratio:.2f} (target {ROOFLINE_TARGET})"
    )
    return figures
