"""Part 1, startup: an engine built exactly as a `values-gpu.yaml` decode worker builds it
(the chart's `decode.config` as TANDEM_* variables through the workers' own flag parser: no
block count, KV sized by `gpu_memory_utilization` after a profile step at full batch), warmed
up as a worker does, then a few greedy requests token-identical to a single engine with an
explicit block count on the same weights. Every other part passes a block count, which skips
the profile path a deployed worker takes.

On `--cpu` the same path at tiny size: the chart's config with the device and dtype of the
CPU run (a CPU engine sizes KV by kv_cache_bytes: profiling is CUDA-only) and the torch
attention backend: the Triton backend under the interpreter did not finish warm-up at the
chart's decode budgets (2048-token steps, 256 rows) within 6 minutes on a 2-core machine.
tests/unit/test_attention_backend.py profiles the Triton backend under the interpreter."""

from __future__ import annotations

import random
import time

import yaml

from .common import (
    REPO_ROOT,
    Context,
    Figures,
    PartFailed,
    free_memory,
    make_engine,
    sampling_params,
)

VALUES_GPU = REPO_ROOT / "deploy" / "helm" / "tandem" / "values-gpu.yaml"


def worker_engine_config(ctx: Context, model_dir: str):  # type: ignore[no-untyped-def]
    """The EngineConfig a decode pod of values-gpu.yaml gets (its env through parse_config),
    with the model dir of this check, and on --cpu the CPU run's device and dtype."""
    from tandem.config import EngineConfig
    from tandem.services.common.runtime.flags import leaves, parse_config

    config = yaml.safe_load(VALUES_GPU.read_text())["decode"]["config"]
    names = {leaf.name for leaf in leaves(EngineConfig)}
    environ = {f"TANDEM_{k.upper()}": str(v) for k, v in config.items() if k in names}
    environ["TANDEM_MODEL_DIR"] = model_dir
    environ["TANDEM_ATTENTION_BACKEND"] = ctx.attention_backend if ctx.cuda else "torch"
    if not ctx.cuda:
        environ.update(TANDEM_DEVICE="cpu", TANDEM_DTYPE="float32", TANDEM_NUM_THREADS="1")
    return parse_config(EngineConfig, [], fixed={"role": "decode"}, environ=environ)


def check_startup(ctx: Context) -> Figures:
    from tandem.engine.engine import LLMEngine
    from tandem.weights.tiny import make_tiny_model

    s = ctx.sizes
    model_dir = make_tiny_model(ctx.tmp_dir / "startup-tiny", preset="tiny", seed=0)
    config = worker_engine_config(ctx, str(model_dir))
    assert config.cache.num_blocks is None  # the worker's path: sized, not given
    t0 = time.perf_counter()
    engine = LLMEngine(config)
    built_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    engine.warm_up()
    warm_s = time.perf_counter() - t0
    rng = random.Random(1)
    prompts = [
        rng.choices(range(5, 512), k=rng.randint(*s.serve_prompt_len))
        for _ in range(s.serve_num_requests)
    ]
    greedy = sampling_params(max_tokens=s.serve_max_tokens, temperature=0.0, ignore_eos=True)
    served = [engine.generate([p], greedy)[0].token_ids for p in prompts]
    figures: Figures = {
        "config": {
            "device": config.device,
            "dtype": config.resolved_dtype,
            "attention_backend": type(engine.model.attention).__name__,
            "gpu_memory_utilization": config.cache.gpu_memory_utilization,
            "max_num_seqs": config.scheduler.max_num_seqs,
            "max_num_batched_tokens": config.scheduler.max_num_batched_tokens,
        },
        "num_blocks": engine.num_blocks,
        "build_s": round(built_s, 2),
        "warm_up_s": round(warm_s, 2),
    }
    num_blocks = engine.num_blocks
    del engine
    free_memory(ctx.device)  # the sized engine took most of the device
    # The reference differs only in its block count: warmed up the same way, so on CUDA its
    # decode steps replay CUDA graphs too. (A graph sizes the decode kernel's split-K for the
    # longest context it may meet, an eager step for its actual one: a different reduction
    # order, so bf16 greedy tokens may part at near ties; that is `graphs_vs_eager` below.)
    reference = make_engine(
        model_dir,
        config.device,
        config.resolved_dtype,
        block_size=config.cache.block_size,
        num_blocks=min(num_blocks, s.serve_num_blocks),
        attention_backend=config.attention_backend,
        max_num_seqs=config.scheduler.max_num_seqs,
        max_num_batched_tokens=config.scheduler.max_num_batched_tokens,
    )
    reference.warm_up()
    expected = [reference.generate([p], greedy)[0].token_ids for p in prompts]
    del reference
    free_memory(ctx.device)
    figures["requests"] = [
        {"prompt_tokens": len(p), "identical": got == want}
        for p, got, want in zip(prompts, served, expected, strict=True)
    ]
    if ctx.cuda:
        figures["graphs_vs_eager"] = {
            dtype: graphs_vs_eager(ctx, model_dir, config, dtype, prompts, greedy)
            for dtype in ("float32", config.resolved_dtype)
        }
    if not all(r["identical"] for r in figures["requests"]):
        raise PartFailed("the worker-built engine's tokens differ from the single engine", figures)
    fp32 = figures.get("graphs_vs_eager", {}).get("float32")
    if fp32 is not None and fp32["identical"] != fp32["requests"]:
        raise PartFailed("fp32 decode steps replayed from CUDA graphs differ from eager", figures)
    return figures


def graphs_vs_eager(ctx: Context, model_dir, config, dtype: str, prompts, greedy) -> Figures:  # type: ignore[no-untyped-def]
    """Greedy tokens of the same engine config with CUDA graphs (warmed up) and without: in
    fp32 they must be identical (graphs replay the same kernels on the same inputs; only the
    decode split count differs, which moves results by ~1e-7); in bf16 the count of identical
    requests and where the others part are reported."""
    runs = []
    for graphs in (True, False):
        engine = make_engine(
            model_dir,
            config.device,
            dtype,
            block_size=config.cache.block_size,
            num_blocks=ctx.sizes.serve_num_blocks,
            attention_backend=config.attention_backend,
            cuda_graphs=graphs,
        )
        engine.warm_up()
        runs.append([engine.generate([p], greedy)[0].token_ids for p in prompts])
        del engine
        free_memory(ctx.device)
    with_graphs, eager = runs
    parted = [
        next((i for i, (a, b) in enumerate(zip(g, e, strict=True)) if a != b), None)
        for g, e in zip(with_graphs, eager, strict=True)
    ]
    figures: Figures = {
        "requests": len(prompts),
        "identical": sum(p is None for p in parted),
        "first_difference_at": [p for p in parted if p is not None],
    }
    ctx.log(f"startup: {dtype} graphs vs eager: {figures}")
    return figures
