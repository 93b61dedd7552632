"""Part 2, throughput: engine vs HF `generate` (static batches, left-padded) on workload W (64
requests, prompts 32-512, outputs 16-256 tokens) with a Llama-3-8B-shaped model of random bf16
weights; output tokens/s of both and their ratio. The engine is warmed up as a service does
(`warm_up()`: on CUDA it captures the decode steps' CUDA graphs). When the e2e or quant part
follows, the weights directory is left to them (`ctx.shared[SHARED_MODEL_DIR]`) instead of
being written again. Imports no grpc, redis or kubernetes."""

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

from .common import Context, Figures, free_memory, make_engine, sampling_params, sync
from .sizes import Sizes

# ctx.shared key of the saved Llama-3-8B-shaped weights directory (taken by e2e, then quant).
SHARED_MODEL_DIR = "llama_model_dir"


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


def run_hf_workload(
    model: Any,
    workload: Sequence[tuple[list[int], int]],
    batch_size: int,
    device: str,
    budget_s: float,
) -> Figures:
    """Static batches of `batch_size` requests of similar output length, left-padded, each
    generated greedily to its longest output; only each request's own length counts as
    output. Stops between batches past the budget."""
    order = sorted(range(len(workload)), key=lambda i: -workload[i][1])
    batches = [order[i : i + batch_size] for i in range(0, len(order), batch_size)]
    t0 = time.perf_counter()
    useful = generated = done = 0
    for batch in batches:
        if done and time.perf_counter() - t0 > budget_s:
            break
        prompts = [workload[i][0] for i in batch]
        n = max(workload[i][1] for i in batch)
        width = max(len(p) for p in prompts)
        ids = torch.zeros(len(batch), width, dtype=torch.long)
        mask = torch.zeros(len(batch), width, dtype=torch.long)
        for row, p in enumerate(prompts):
            ids[row, width - len(p) :] = torch.tensor(p)
            mask[row, width - len(p) :] = 1
        with torch.no_grad():
            model.generate(
                ids.to(device),
                attention_mask=mask.to(device),
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                pad_token_id=0,
            )
        useful += sum(workload[i][1] for i in batch)
        generated += n * len(batch)
        done += len(batch)
    sync(device)
    elapsed = time.perf_counter() - t0
    return {
        "output_tokens": useful,
        "generated_tokens_incl_padding": generated,
        "completed_requests": done,
        "seconds": round(elapsed, 3),
        "output_tokens_per_s": round(useful / elapsed, 1),
        "batch_size": batch_size,
        "truncated_by_budget": done < len(workload),
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
    figures["hf_build_s"] = round(time.perf_counter() - t0, 2)
    nparams = sum(p.numel() for p in hf.parameters())
    figures["num_params"] = nparams
    ctx.log(f"throughput: HF model, {nparams / 1e6:.1f}M params, in {figures['hf_build_s']} s")

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
    run_hf_workload(hf, warm, 2, dev, budget_s=60)
    half = max(10.0, (ctx.left_s() - 10) / 2)
    ctx.log(f"throughput: engine on W ({len(workload)} requests, budget {half:.0f} s)")
    figures["engine"] = run_engine_workload(engine, workload, dev, half)
    ctx.log(f"throughput: engine {figures['engine']}")
    del engine
    free_memory(dev)
    ctx.log(f"throughput: HF generate on W (batches of {s.tp_hf_batch_size})")
    figures["hf"] = run_hf_workload(hf, workload, s.tp_hf_batch_size, dev, ctx.left_s() - 10)
    ctx.log(f"throughput: HF {figures['hf']}")
    engine_tps = figures["engine"]["output_tokens_per_s"]
    hf_tps = figures["hf"]["output_tokens_per_s"]
    figures["ratio_engine_over_hf"] = round(engine_tps / hf_tps, 3) if hf_tps else None
    del hf
    free_memory(dev)
    return figures
