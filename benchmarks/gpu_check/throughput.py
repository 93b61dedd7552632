"""Part throughput: the engine's output tokens/s on workload W (64 requests at once, prompts
32-512, outputs 16-256 tokens) with a Llama-3-8B-shaped model of random bf16 weights, and its
fraction of the workload's roofline measured in the same run (`workload_roofline`: the decode
steps' weight and KV reads at the device-copy rate plus the prompts' matmul FLOPs at the
measured bf16 GEMM rate; a lower bound on any engine's time). HF `generate` is no longer run
(the engine's 12.7x over it was met and it cost 44 s). The engine is warmed up as a service
does (`warm_up()`: on CUDA it captures the decode steps' CUDA graphs). When the e2e or quant
part follows, the weights directory is left to them (`ctx.shared[SHARED_MODEL_DIR]`)
instead of being written again. Imports no grpc, redis or kubernetes."""

from __future__ import annotations

import json
import logging
import random
import shutil
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from .common import (
    Context,
    Figures,
    copy_bandwidth,
    free_memory,
    make_engine,
    median_time_s,
    sampling_params,
    sync,
)
from .sizes import Sizes

# ctx.shared key of the saved Llama-3-8B-shaped weights directory (taken by e2e, then quant).
SHARED_MODEL_DIR = "llama_model_dir"
ROOFLINE_TARGET = 0.6  # issue 41: W's output tokens/s at >= 0.6 of its roofline


def make_workload(sizes: Sizes, seed: int = 0) -> list[tuple[list[int], int]]:
    """W: (prompt token ids, output length) per request, seeded."""
    rng = random.Random(seed)
    vocab = sizes.tp_shape["vocab_size"]
    return [
        (
            rng.choices(range(1, vocab), k=rng.randint(*sizes.tp_prompt_len)),
            rng.randint(*sizes.tp_output_len),
        )
        for _ in range(sizes.tp_num_requests)
    ]


def build_random_llama(shape: dict[str, Any], dtype: torch.dtype, device: str) -> Any:
    """An HF Llama with random weights, created directly on `device` in `dtype`."""
    import transformers

    config = transformers.LlamaConfig(
        **shape, eos_token_id=None, bos_token_id=None, pad_token_id=0, tie_word_embeddings=False
    )
    config.architectures = ["LlamaForCausalLM"]
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model.eval()


def save_sharded(model: Any, out: Path, shard_bytes: int = 2 << 30) -> int:
    """config.json + safetensors shards with an index (what `save_pretrained` writes, minus
    its extra copies); returns the bytes written. The engine loads only from a directory."""
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    model.config.save_pretrained(out)
    weight_map: dict[str, str] = {}
    shard: dict[str, torch.Tensor] = {}
    shard_size = total = 0
    names: list[str] = []

    def flush() -> None:
        nonlocal shard, shard_size
        if shard:
            name = f"model-{len(names) + 1:05d}.safetensors"
            save_file(shard, str(out / name), metadata={"format": "pt"})
            names.append(name)
            weight_map.update(dict.fromkeys(shard, name))
        shard, shard_size = {}, 0

    for name, tensor in model.state_dict().items():
        shard[name] = tensor.detach().to("cpu").contiguous()
        nbytes = tensor.numel() * tensor.element_size()
        shard_size += nbytes
        total += nbytes
        if shard_size >= shard_bytes:
            flush()
    flush()
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    return total


def run_engine_workload(
    engine: Any, workload: Sequence[tuple[list[int], int]], device: str, budget_s: float
) -> Figures:
    """All requests at t=0 (offline throughput); stops early (aborting) past the budget."""
    ids = []
    for i, (prompt, n) in enumerate(workload):
        params = sampling_params(max_tokens=n, temperature=0.0, ignore_eos=True)
        ids.append(engine.add_request(engine.spec(f"w{i}", prompt, params)).request_id)
    sync(device)
    t0 = time.perf_counter()
    tokens = steps = 0
    truncated = False
    while engine.has_unfinished():
        for out in engine.step():
            tokens += len(out.new_token_ids)
        steps += 1
        if time.perf_counter() - t0 > budget_s:
            truncated = True
            for rid in ids:
                engine.abort(rid)
            break
    sync(device)
    elapsed = time.perf_counter() - t0
    return {
        "output_tokens": tokens,
        "seconds": round(elapsed, 3),
        "output_tokens_per_s": round(tokens / elapsed, 1),
        "steps": steps,
        "truncated_by_budget": truncated,
    }


def matmul_tflop_s(device: str, n: int, dtype: torch.dtype, reps: int) -> float:
    """bf16 GEMM rate of one n x n x n product (the compute roofline of a prefill)."""
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    seconds = median_time_s(lambda: a @ b, device, reps=reps)
    return 2 * n**3 / seconds / 1e12


def workload_roofline(
    workload: Sequence[tuple[list[int], int]],
    shape: dict[str, Any],
    weight_read_bytes: int,
    dtype_bytes: int,
    copy_gb_s: float,
    tflop_s: float,
) -> Figures:
    """The least time any engine needs for W with every request admitted at once: as many
    decode steps as the longest output, each reading the weights once; every output token
    reading its request's KV so far; every prompt token's 2 x params FLOPs (attention's
    left out: a lower bound)."""
    head_dim = shape["hidden_size"] // shape["num_attention_heads"]
    kv_token = 2 * shape["num_hidden_layers"] * shape["num_key_value_heads"] * head_dim
    kv_token *= dtype_bytes
    steps = max(n for _, n in workload)
    kv_reads = sum(kv_token * (len(p) * n + n * (n - 1) // 2) for p, n in workload)
    prompt_tokens = sum(len(p) for p, _ in workload)
    flops = 2 * (weight_read_bytes // dtype_bytes) * prompt_tokens
    bw = copy_gb_s * 1e9
    terms = {
        "weights_s": steps * weight_read_bytes / bw,
        "kv_s": kv_reads / bw,
        "prefill_flops_s": flops / (tflop_s * 1e12),
    }
    return {
        **{k: round(v, 4) for k, v in terms.items()},
        "roofline_s": round(sum(terms.values()), 4),
        "decode_steps": steps,
        "copy_gb_s": copy_gb_s,
        "matmul_tflop_s": round(tflop_s, 1),
    }


def check_throughput(ctx: Context) -> Figures:
    import transformers

    transformers.logging.set_verbosity_error()
    from tandem.weights.loader import DTYPES

    s, dev = ctx.sizes, ctx.device
    dtype = DTYPES[s.tp_dtype]
    workload = make_workload(s)
    block_size = 16
    # Room for every request at once (no preemption) plus the warm-up.
    num_blocks = sum(-(-(len(p) + n) // block_size) for p, n in workload) + 64
    figures: Figures = {
        "model_shape": s.tp_shape,
        "dtype": s.tp_dtype,
        "workload": {
            "num_requests": len(workload),
            "prompt_len_range": list(s.tp_prompt_len),
            "output_len_range": list(s.tp_output_len),
            "prompt_tokens": sum(len(p) for p, _ in workload),
            "output_tokens": sum(n for _, n in workload),
        },
    }
    t0 = time.perf_counter()
    hf = build_random_llama(s.tp_shape, dtype, dev)
    sync(dev)
    figures["weights_build_s"] = round(time.perf_counter() - t0, 2)
    nparams = sum(p.numel() for p in hf.parameters())
    embed = hf.get_input_embeddings().weight
    tied = hf.get_output_embeddings().weight.data_ptr() == embed.data_ptr()
    weight_read_bytes = (nparams - (0 if tied else embed.numel())) * dtype.itemsize
    figures["num_params"] = nparams
    ctx.log(f"throughput: model, {nparams / 1e6:.1f}M params, in {figures['weights_build_s']} s")

    model_dir = ctx.tmp_dir / "throughput-model"
    need = nparams * dtype.itemsize
    free = shutil.disk_usage(ctx.tmp_dir).free
    if free < 1.2 * need:
        raise RuntimeError(
            f"{ctx.tmp_dir} has {free / 2**30:.1f} GiB free, need {need / 2**30:.1f}"
        )
    t0 = time.perf_counter()
    written = save_sharded(hf, model_dir)
    figures["weights_write_s"] = round(time.perf_counter() - t0, 2)
    figures["weights_gib"] = round(written / 2**30, 2)
    ctx.log(f"throughput: wrote {written / 2**20:.1f} MiB in {figures['weights_write_s']} s")

    t0 = time.perf_counter()
    logging.getLogger("tandem").setLevel(logging.INFO)  # the loader's and KV cache's figures
    engine = make_engine(
        model_dir,
        dev,
        s.tp_dtype,
        block_size=block_size,
        num_blocks=num_blocks,
        max_num_seqs=len(workload),
        max_num_batched_tokens=s.tp_max_num_batched_tokens,
        attention_backend=ctx.attention_backend,
    )
    sync(dev)
    logging.getLogger("tandem").setLevel(logging.WARNING)
    figures["engine_load_s"] = round(time.perf_counter() - t0, 2)
    figures["engine_num_blocks"] = num_blocks
    ctx.log(f"throughput: engine loaded in {figures['engine_load_s']} s")
    if "e2e" in ctx.parts or "quant" in ctx.parts:
        # e2e (then quant) loads the same weights; the last of them removes them
        ctx.shared[SHARED_MODEL_DIR] = model_dir
    else:
        shutil.rmtree(model_dir, ignore_errors=True)
    t0 = time.perf_counter()
    logging.getLogger("tandem").setLevel(logging.INFO)  # the graph capture's line
    engine.warm_up()
    logging.getLogger("tandem").setLevel(logging.WARNING)
    figures["engine_warm_up_s"] = round(time.perf_counter() - t0, 2)
    graphs = engine.runner.graphs
    figures["engine_cuda_graph_sizes"] = list(graphs.sizes) if graphs is not None else None

    warm = [(list(range(1, 33)), 4), (list(range(2, 50)), 4)]
    run_engine_workload(engine, warm, dev, budget_s=60)
    budget = max(10.0, ctx.left_s() - 15)
    ctx.log(f"throughput: engine on W ({len(workload)} requests, budget {budget:.0f} s)")
    figures["engine"] = run_engine_workload(engine, workload, dev, budget)
    ctx.log(f"throughput: engine {figures['engine']}")
    del engine
    free_memory(dev)
    copy = copy_bandwidth(dev, s.kn_copy_bytes, reps=s.kn_reps)
    tflop_s = matmul_tflop_s(dev, s.tp_matmul_n, dtype, reps=s.kn_reps)
    free_memory(dev)
    roof = workload_roofline(
        workload, s.tp_shape, weight_read_bytes, dtype.itemsize, copy["gb_s"], tflop_s
    )
    engine_s = figures["engine"]["seconds"]
    roof["fraction"] = round(roof["roofline_s"] / engine_s, 3) if engine_s else None
    roof["target"] = ROOFLINE_TARGET
    roof["met"] = (
        None
        if not ctx.cuda or roof["fraction"] is None
        else (roof["fraction"] >= ROOFLINE_TARGET and not figures["engine"]["truncated_by_budget"])
    )
    figures["workload_roofline"] = roof
    ctx.log(
        f"throughput: roofline {roof['roofline_s']} s (weights {roof['weights_s']}, KV "
        f"{roof['kv_s']}, prefill {roof['prefill_flops_s']}) / engine {engine_s} s = "
        f"{roof['fraction']} (target {ROOFLINE_TARGET})"
    )
    del hf
    free_memory(dev)
    return figures
