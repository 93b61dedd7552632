"""The GPU check: what only a GPU can tell about the engine, as one prepared script.

    scripts/gpu-check [--cpu] [--parts parity,throughput,nixl,serve] [--out DIR]

Parts (each guarded: a failing part is recorded and the others still run):
  parity      the engine against HuggingFace transformers on the same random weights (a tiny
              Llama and a tiny Qwen3): fp32 greedy token-identical to HF `generate`; bf16
              per-step log-softmax within a tolerance of HF bf16; a prefix-cache hit and a
              chunked prefill give the same tokens; temperature sampling runs and a seeded
              request reproduces its tokens alone, in a batch and in a fresh engine.
  throughput  engine vs HF `generate` (static batches, left-padded) on workload W (64
              requests, prompts 32-512, outputs 16-256 tokens) with a Llama-3-8B-shaped
              model of random bf16 weights; output tokens/s of both and their ratio.
  nixl        a NIXL read of KV blocks from a second process (VRAM -> VRAM; DRAM with --cpu)
              against a same-device copy of the same blocks, in GB/s (bytes moved / s).
              Skipped if nixl is not importable.
  serve       1 prefill + 1 decode worker + router as processes (static addresses, no Redis),
              greedy requests through `TandemClient`, token-identical to one `LLMEngine`.
              Skipped if the gRPC stack or nixl does not import.

Modes: default CUDA (full sizes, bf16 where stated, each part with a time budget so the run
stays under ~8 minutes on one H200); `--cpu`: device cpu, tiny sizes, ~1 minute (CI).

Output: timestamped progress on stdout, `<out>/gpu-check.log` (the same, plus tracebacks and
worker log tails), `<out>/gpu-check.json` (environment, and per part: status ok / failed /
skipped, reason, duration, figures), rewritten after every part. Exit status 1 if a part
failed. Parity and throughput import no grpc, redis or kubernetes.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import gc
import importlib
import importlib.metadata
import importlib.util
import json
import logging
import math
import multiprocessing
import os
import platform
import random
import select
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
PARTS = ("parity", "throughput", "nixl", "serve")
JSON_NAME, LOG_NAME = "gpu-check.json", "gpu-check.log"

Figures = dict[str, Any]


# -- sizes ---------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Sizes:
    """Everything that differs between the CUDA run and the --cpu smoke run."""

    device: str
    # parity: HF config fields shared by the tiny models, and the workload
    parity_shape: dict[str, Any]
    parity_qwen3_head_dim: int
    parity_block_size: int
    parity_num_prompts: int
    parity_prompt_len: tuple[int, int]
    parity_max_tokens: int
    parity_chunk_tokens: int  # max_num_batched_tokens of the chunked engine (< every prompt)
    parity_bf16_prompt_len: int
    parity_bf16_max_tokens: int
    # throughput: the model shape, dtype and workload W
    tp_shape: dict[str, Any]
    tp_dtype: str
    tp_num_requests: int
    tp_prompt_len: tuple[int, int]
    tp_output_len: tuple[int, int]
    tp_hf_batch_size: int
    tp_max_num_batched_tokens: int
    # nixl: one KV block [num_layers, 2, block_size, num_kv_heads, head_dim] (bf16)
    nixl_block_shape: tuple[int, int, int, int, int]
    nixl_owner_blocks: int
    nixl_read_blocks: tuple[int, ...]
    nixl_reps: int
    # serve
    serve_dtype: str
    serve_num_requests: int
    serve_prompt_len: tuple[int, int]
    serve_max_tokens: int
    serve_num_blocks: int
    # seconds per part; throughput's engine and HF runs each stop at half of theirs
    budget_s: dict[str, float] = field(default_factory=dict)


CUDA_SIZES = Sizes(
    device="cuda",
    parity_shape=dict(
        vocab_size=2048,
        hidden_size=512,
        intermediate_size=1024,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
    ),
    parity_qwen3_head_dim=128,
    parity_block_size=16,
    parity_num_prompts=8,
    parity_prompt_len=(65, 300),
    parity_max_tokens=32,
    parity_chunk_tokens=64,
    parity_bf16_prompt_len=100,
    parity_bf16_max_tokens=16,
    # Llama-3-8B (rope scaling left out: it changes no cost)
    tp_shape=dict(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=8192,
        rope_theta=500000.0,
        rms_norm_eps=1e-5,
    ),
    tp_dtype="bfloat16",
    tp_num_requests=64,
    tp_prompt_len=(32, 512),
    tp_output_len=(16, 256),
    tp_hf_batch_size=16,
    tp_max_num_batched_tokens=8192,
    # Llama-3-8B's KV block: 2 MiB
    nixl_block_shape=(32, 2, 16, 8, 128),
    nixl_owner_blocks=1024,
    nixl_read_blocks=(32, 512),  # 512- and 8192-token prompts
    nixl_reps=10,
    serve_dtype="bfloat16",
    serve_num_requests=4,
    serve_prompt_len=(100, 600),
    serve_max_tokens=32,
    serve_num_blocks=1024,
    budget_s=dict(parity=120, throughput=420, nixl=90, serve=150),
)

CPU_SIZES = Sizes(
    device="cpu",
    parity_shape=dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
    ),
    parity_qwen3_head_dim=24,  # q width 96 != hidden 64: catches a head_dim taken from hidden
    parity_block_size=4,
    parity_num_prompts=4,
    parity_prompt_len=(9, 40),
    parity_max_tokens=8,
    parity_chunk_tokens=8,
    parity_bf16_prompt_len=16,
    parity_bf16_max_tokens=6,
    tp_shape=dict(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
    ),
    tp_dtype="float32",
    tp_num_requests=8,
    tp_prompt_len=(8, 64),
    tp_output_len=(4, 16),
    tp_hf_batch_size=4,
    tp_max_num_batched_tokens=512,
    nixl_block_shape=(4, 2, 16, 4, 64),  # 64 KiB
    nixl_owner_blocks=512,
    nixl_read_blocks=(256,),
    nixl_reps=5,
    serve_dtype="float32",
    serve_num_requests=3,
    serve_prompt_len=(20, 80),
    serve_max_tokens=8,
    serve_num_blocks=256,
    budget_s=dict(parity=60, throughput=60, nixl=60, serve=120),
)


# -- plumbing ------------------------------------------------------------------------------


class PartSkipped(Exception):
    """The part cannot run here (a missing optional package); not a failure."""


class PartFailed(Exception):
    """The part ran and a check failed; `figures` holds what it measured."""

    def __init__(self, reason: str, figures: Figures) -> None:
        super().__init__(reason)
        self.figures = figures


class Log:
    """Timestamped progress lines on stdout (flushed) and in the log file."""

    def __init__(self, path: Path) -> None:
        self.t0 = time.perf_counter()
        self.file = path.open("a", encoding="utf-8")

    def __call__(self, msg: str) -> None:
        stamp = f"{datetime.now().strftime('%H:%M:%S')} +{time.perf_counter() - self.t0:6.1f}s"
        for line in msg.splitlines() or [""]:
            text = f"[{stamp}] {line}"
            print(text, flush=True)
            self.file.write(text + "\n")
        self.file.flush()

    def close(self) -> None:
        self.file.close()


@dataclass(slots=True)
class Context:
    sizes: Sizes
    log: Log
    tmp_dir: Path
    deadline: float = math.inf  # of the running part (time.monotonic)

    @property
    def device(self) -> str:
        return self.sizes.device

    @property
    def cuda(self) -> bool:
        return self.sizes.device.startswith("cuda")

    def left_s(self) -> float:
        return self.deadline - time.monotonic()


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _run(cmd: Sequence[str], timeout_s: float = 10) -> str | None:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip()


def environment(device: str) -> Figures:
    """Versions, device, driver and clocks (where readable), git commit."""
    env: Figures = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "torch_threads": torch.get_num_threads(),
        "cuda_available": torch.cuda.is_available(),
    }
    for dist in ("transformers", "safetensors", "numpy", "nixl", "grpcio", "protobuf"):
        env[dist] = _version(dist)
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    if device.startswith("cuda") and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env["device_name"] = props.name
        env["device_memory_gib"] = round(props.total_memory / 2**30, 1)
        env["compute_capability"] = f"{props.major}.{props.minor}"
        fields = "driver_version,clocks.sm,clocks.max.sm,clocks.mem,power.limit,temperature.gpu"
        smi = _run(["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader"])
        if smi:
            values = [v.strip() for v in smi.splitlines()[0].split(",")]
            env["nvidia_smi"] = dict(zip(fields.split(","), values, strict=False))
    else:
        env["device_name"] = "cpu"
    env["git_commit"] = _run(["git", "-C", str(REPO_ROOT), "rev-parse", "HEAD"])
    status = _run(["git", "-C", str(REPO_ROOT), "status", "--porcelain"])
    env["git_dirty"] = None if status is None else bool(status)
    return env


# -- part 1: parity ------------------------------------------------------------------------

ARCHS = ("llama", "qwen3")
# bf16 check (see _bf16_logits): the engine's log-softmax may differ from HF bf16's by at most
# BF16_REL x (HF bf16's own distance from the fp32 reference) + BF16_ABS. Two correct bf16
# implementations round at different places (fused QKV, RoPE, attention kernel), so each sits
# at about bf16's rounding error from the fp32 truth and from each other; 2x allows for both
# errors adding up, and the floor absorbs runs where HF bf16 happens to land very close.
BF16_REL, BF16_ABS = 2.0, 0.05


def build_hf_model(arch: str, shape: dict[str, Any], qwen3_head_dim: int, out: Path) -> Any:
    """A tiny random HF model (seeded), saved with save_pretrained; returned in fp32 on CPU."""
    import transformers

    common = dict(
        shape,
        initializer_range=0.1,  # wide logits: greedy decoding never sits on a near-tie
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=0,
    )
    torch.manual_seed(0 if arch == "llama" else 1)
    if arch == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    else:
        config = transformers.Qwen3Config(**common, head_dim=qwen3_head_dim)
        model = transformers.Qwen3ForCausalLM(config)
    with torch.no_grad():
        # Norm weights != 1, so an implementation that ignores one is caught.
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.normal_(1.0, 0.2)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    model.save_pretrained(out)
    return model.float().eval()


def hf_greedy(model: Any, prompt: list[int], n: int, device: str) -> list[int]:
    with torch.no_grad():
        ids = torch.tensor([prompt], device=device)
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            pad_token_id=0,
        )
    return [int(t) for t in out[0, len(prompt) :].tolist()]


def hf_log_softmax(model: Any, ids: list[int], device: str) -> torch.Tensor:
    """[len(ids), vocab] float32 log-softmax of the logits after each position."""
    with torch.no_grad():
        logits = model(torch.tensor([ids], device=device)).logits[0]
    return torch.log_softmax(logits.float(), dim=-1).cpu()


class LogitRecorder:
    """Wraps the engine's sampler; keeps each sampled row's logits with its position."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.rows: list[tuple[int, torch.Tensor]] = []  # (tokens before, logits [vocab])

    def __call__(self, logits: torch.Tensor, rows: Sequence[Any]) -> Any:
        for i, row in enumerate(rows):
            n = len(row.prompt_token_ids) + len(row.output_token_ids)
            self.rows.append((n, logits[i].detach().float().cpu()))
        return self.inner(logits, rows)


def make_engine(model_dir: Path, device: str, dtype: str, **overrides: Any) -> Any:
    """An engine with an explicit block count (no memory profiling), prefix caching on.

    overrides: block_size, num_blocks, max_num_batched_tokens, max_num_seqs.
    """
    from tandem.config import CacheConfig, EngineConfig, SchedulerConfig
    from tandem.engine.engine import LLMEngine

    cache = CacheConfig(
        block_size=overrides.pop("block_size"), num_blocks=overrides.pop("num_blocks", 512)
    )
    scheduler = SchedulerConfig(**overrides)
    return LLMEngine(
        EngineConfig(
            model_dir=str(model_dir),
            dtype=dtype,
            device=device,
            cache=cache,
            scheduler=scheduler,
        )
    )


def run_requests(engine: Any, requests: Sequence[tuple[str, list[int], Any]]) -> dict[str, Any]:
    """Add (id, prompt, params) requests together and step until done; id -> Request."""
    added = {rid: engine.add_request(rid, prompt, params) for rid, prompt, params in requests}
    while engine.has_unfinished():
        engine.step()
    engine.check_integrity()
    return added


def _subcheck(ctx: Context, results: Figures, name: str, fn: Callable[[], Figures]) -> None:
    """Run one sub-check; record {passed, ...details} or {passed: False, error}."""
    t0 = time.perf_counter()
    try:
        details = fn()
    except Exception as exc:
        ctx.log(f"  {name}: ERROR {type(exc).__name__}: {exc}")
        ctx.log(traceback.format_exc().rstrip())
        details = {"passed": False, "error": f"{type(exc).__name__}: {exc}"}
    details["duration_s"] = round(time.perf_counter() - t0, 2)
    results[name] = details
    verdict = "passed" if details["passed"] else "FAILED"
    extra = {k: v for k, v in details.items() if k not in ("passed", "error") and _short(v)}
    ctx.log(f"  {name}: {verdict} {extra}")


def _short(value: Any) -> bool:
    return not isinstance(value, list | dict) or len(str(value)) < 80


def check_parity(ctx: Context) -> Figures:
    import transformers

    transformers.logging.set_verbosity_error()
    s, dev = ctx.sizes, ctx.device
    if ctx.cuda:
        # fp32 must mean fp32 on both sides (TF32 would turn greedy ties into flips).
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    results: Figures = {}
    rng = random.Random(0)
    vocab = s.parity_shape["vocab_size"]
    prompts = [
        rng.choices(range(1, vocab), k=rng.randint(*s.parity_prompt_len))
        for _ in range(s.parity_num_prompts)
    ]
    bs = s.parity_block_size
    greedy = _sampling_params(max_tokens=s.parity_max_tokens, temperature=0.0, ignore_eos=True)
    for arch in ARCHS:
        model_dir = ctx.tmp_dir / f"parity-{arch}"
        hf = build_hf_model(arch, s.parity_shape, s.parity_qwen3_head_dim, model_dir).to(dev)
        ctx.log(f"parity {arch}: HF model in {model_dir}")
        hf_tokens = [hf_greedy(hf, p, s.parity_max_tokens, dev) for p in prompts]

        def fp32_greedy(arch: str = arch, hf_tokens: list[list[int]] = hf_tokens) -> Figures:
            engine = make_engine(model_dir, dev, "float32", block_size=bs)
            done = engine.generate(prompts, greedy)
            return _compare_tokens([d.token_ids for d in done], hf_tokens, "HF generate")

        def chunked(hf_tokens: list[list[int]] = hf_tokens) -> Figures:
            budget = s.parity_chunk_tokens
            assert all(len(p) > budget for p in prompts), "every prompt must be split"
            engine = make_engine(
                model_dir, dev, "float32", block_size=bs, max_num_batched_tokens=budget
            )
            done = engine.generate(prompts, greedy)
            figures = _compare_tokens([d.token_ids for d in done], hf_tokens, "HF generate")
            figures["chunk_tokens"] = budget
            figures["engine_steps"] = engine.num_steps
            return figures

        def prefix_hit(hf_tokens: list[list[int]] = hf_tokens) -> Figures:
            engine = make_engine(model_dir, dev, "float32", block_size=bs)
            prompt = prompts[0]
            [first] = engine.generate([prompt], greedy)
            [second] = engine.generate([prompt], greedy)
            engine.check_integrity()
            hit = second.num_cached_tokens
            return {
                "passed": hit >= bs and first.token_ids == second.token_ids == hf_tokens[0],
                "prompt_tokens": len(prompt),
                "cached_tokens_second": hit,
                "cached_tokens_first": first.num_cached_tokens,
                "identical_to_first": first.token_ids == second.token_ids,
                "identical_to_hf": second.token_ids == hf_tokens[0],
            }

        def bf16(hf: Any = hf) -> Figures:
            return _bf16_logits(ctx, model_dir, hf, rng_seed=len(arch))

        _subcheck(ctx, results, f"{arch}/fp32_greedy", fp32_greedy)
        _subcheck(ctx, results, f"{arch}/chunked_prefill", chunked)
        _subcheck(ctx, results, f"{arch}/prefix_cache_hit", prefix_hit)
        _subcheck(ctx, results, f"{arch}/bf16_logits", bf16)
        if arch == "llama":
            _subcheck(ctx, results, "llama/sampling", lambda: _sampling(ctx, model_dir, prompts))
        del hf
        _free_memory(dev)
    failed = [name for name, r in results.items() if not r["passed"]]
    figures = {
        "sub_checks": results,
        "models": {
            "shape": s.parity_shape,
            "qwen3_head_dim": s.parity_qwen3_head_dim,
            "block_size": bs,
        },
        "prompt_lens": [len(p) for p in prompts],
        "max_tokens": s.parity_max_tokens,
        "bf16_rule": f"max|dlogsoftmax| <= {BF16_REL} x HF-bf16-vs-fp32 + {BF16_ABS}",
    }
    if failed:
        raise PartFailed(f"sub-checks failed: {', '.join(failed)}", figures)
    return figures


def _sampling_params(**kwargs: Any) -> Any:
    from tandem.engine.sampling import SamplingParams

    return SamplingParams(**kwargs)


def _compare_tokens(got: list[list[int]], want: list[list[int]], what: str) -> Figures:
    mismatched = [i for i, (g, w) in enumerate(zip(got, want, strict=True)) if g != w]
    figures: Figures = {"passed": not mismatched, "num_prompts": len(want)}
    if mismatched:
        i = mismatched[0]
        first = next(k for k, (a, b) in enumerate(zip(got[i], want[i], strict=False)) if a != b)
        figures["mismatched_prompts"] = mismatched
        figures["first_mismatch"] = f"prompt {i}, token {first}: engine {got[i]}, {what} {want[i]}"
    return figures


def _bf16_logits(ctx: Context, model_dir: Path, hf_fp32: Any, rng_seed: int) -> Figures:
    """Engine bf16 vs HF bf16 log-softmax at every sampled step (teacher-forced on the
    engine's own greedy tokens), each also measured against the fp32 HF reference."""
    s, dev = ctx.sizes, ctx.device
    rng = random.Random(rng_seed)
    prompt = rng.choices(range(1, s.parity_shape["vocab_size"]), k=s.parity_bf16_prompt_len)
    engine = make_engine(model_dir, dev, "bfloat16", block_size=s.parity_block_size)
    recorder = LogitRecorder(engine.runner.sampler)
    engine.runner.sampler = recorder
    n = s.parity_bf16_max_tokens
    [done] = engine.generate([prompt], _sampling_params(max_tokens=n, temperature=0.0))
    full = prompt + done.token_ids
    hf_bf16 = copy.deepcopy(hf_fp32).to(torch.bfloat16)
    ref32 = hf_log_softmax(hf_fp32, full, dev)
    ref16 = hf_log_softmax(hf_bf16, full, dev)
    assert len(recorder.rows) == n, f"recorded {len(recorder.rows)} steps, expected {n}"
    d_engine_hf16 = d_engine_fp32 = d_hf16_fp32 = 0.0
    agree = 0
    for pos, logits in recorder.rows:  # logits after `pos` tokens predict token `pos`
        ours = torch.log_softmax(logits, dim=-1)
        d_engine_hf16 = max(d_engine_hf16, (ours - ref16[pos - 1]).abs().max().item())
        d_engine_fp32 = max(d_engine_fp32, (ours - ref32[pos - 1]).abs().max().item())
        d_hf16_fp32 = max(d_hf16_fp32, (ref16[pos - 1] - ref32[pos - 1]).abs().max().item())
        agree += int(ours.argmax().item() == ref16[pos - 1].argmax().item())
    tol = BF16_REL * d_hf16_fp32 + BF16_ABS
    return {
        "passed": d_engine_hf16 <= tol and d_engine_fp32 <= tol,
        "steps": n,
        "max_abs_dlogsoftmax_engine_vs_hf_bf16": round(d_engine_hf16, 4),
        "max_abs_dlogsoftmax_engine_vs_hf_fp32": round(d_engine_fp32, 4),
        "max_abs_dlogsoftmax_hf_bf16_vs_hf_fp32": round(d_hf16_fp32, 4),
        "tolerance": round(tol, 4),
        "argmax_agreement_with_hf_bf16": f"{agree}/{n}",
    }


def _sampling(ctx: Context, model_dir: Path, prompts: list[list[int]]) -> Figures:
    """A seeded request gives the same tokens alone, batched with unseeded temperature
    requests, and in a fresh engine; the unseeded ones run to their length."""
    s, dev = ctx.sizes, ctx.device
    n, vocab = s.parity_max_tokens, s.parity_shape["vocab_size"]
    seeded = _sampling_params(
        max_tokens=n, temperature=0.8, top_k=40, top_p=0.95, seed=1234, ignore_eos=True
    )
    free = _sampling_params(max_tokens=n, temperature=1.0, ignore_eos=True)
    engine = make_engine(model_dir, dev, "float32", block_size=s.parity_block_size)
    alone = run_requests(engine, [("seeded-alone", prompts[0], seeded)])["seeded-alone"]
    batch = run_requests(
        engine,
        [("free-0", prompts[1], free), ("seeded-batched", prompts[0], seeded)]
        + [("free-1", prompts[2], free)],
    )
    fresh = make_engine(model_dir, dev, "float32", block_size=s.parity_block_size)
    again = run_requests(fresh, [("seeded-fresh", prompts[0], seeded)])["seeded-fresh"]
    other_seed = dataclasses.replace(seeded, seed=4321)
    other = run_requests(fresh, [("other-seed", prompts[0], other_seed)])["other-seed"]
    tokens = list(alone.output_token_ids)
    unseeded = [list(batch[r].output_token_ids) for r in ("free-0", "free-1")]
    ok_free = all(len(t) == n and all(0 <= x < vocab for x in t) for t in unseeded)
    return {
        "passed": ok_free
        and tokens == list(batch["seeded-batched"].output_token_ids)
        and tokens == list(again.output_token_ids),
        "seeded_tokens": tokens,
        "same_in_batch": tokens == list(batch["seeded-batched"].output_token_ids),
        "same_in_fresh_engine": tokens == list(again.output_token_ids),
        "unseeded_ran": ok_free,
        "other_seed_differs": tokens != list(other.output_token_ids),  # information only
    }


def _free_memory(device: str) -> None:
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


# -- part 2: throughput --------------------------------------------------------------------


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
        params = _sampling_params(max_tokens=n, temperature=0.0, ignore_eos=True)
        ids.append(engine.add_request(f"w{i}", prompt, params).request_id)
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
        if time.perf_counter() - t0 > budget_s:
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
    from tandem.model.loader import DTYPES

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
    ctx.log(f"throughput: HF model {nparams / 1e9:.2f}B params in {figures['hf_build_s']} s")

    model_dir = ctx.tmp_dir / "throughput-model"
    need = nparams * dtype.itemsize
    free = shutil.disk_usage(ctx.tmp_dir).free
    if free < 1.2 * need:
        raise RuntimeError(f"{ctx.tmp_dir} has {free / 2**30:.1f} GiB free, need {need / 2**30:.1f}")
    t0 = time.perf_counter()
    written = save_sharded(hf, model_dir)
    figures["weights_write_s"] = round(time.perf_counter() - t0, 2)
    figures["weights_gib"] = round(written / 2**30, 2)
    ctx.log(f"throughput: wrote {written / 2**30:.2f} GiB in {figures['weights_write_s']} s")

    t0 = time.perf_counter()
    engine = make_engine(
        model_dir,
        dev,
        s.tp_dtype,
        block_size=block_size,
        num_blocks=num_blocks,
        max_num_seqs=len(workload),
        max_num_batched_tokens=s.tp_max_num_batched_tokens,
    )
    sync(dev)
    figures["engine_load_s"] = round(time.perf_counter() - t0, 2)
    figures["engine_num_blocks"] = num_blocks
    ctx.log(f"throughput: engine loaded in {figures['engine_load_s']} s")
    shutil.rmtree(model_dir, ignore_errors=True)

    warm = [(list(range(1, 33)), 4), (list(range(2, 50)), 4)]
    run_engine_workload(engine, warm, dev, budget_s=60)
    run_hf_workload(hf, warm, 2, dev, budget_s=60)
    half = max(10.0, (ctx.left_s() - 10) / 2)
    ctx.log(f"throughput: engine on W ({len(workload)} requests, budget {half:.0f} s)")
    figures["engine"] = run_engine_workload(engine, workload, dev, half)
    ctx.log(f"throughput: engine {figures['engine']}")
    del engine
    _free_memory(dev)
    ctx.log(f"throughput: HF generate on W (batches of {s.tp_hf_batch_size})")
    figures["hf"] = run_hf_workload(hf, workload, s.tp_hf_batch_size, dev, ctx.left_s() - 10)
    ctx.log(f"throughput: HF {figures['hf']}")
    figures["ratio_engine_over_hf"] = round(
        figures["engine"]["output_tokens_per_s"] / figures["hf"]["output_tokens_per_s"], 3
    )
    del hf
    _free_memory(dev)
    return figures


# -- part 3: nixl --------------------------------------------------------------------------

NIXL_OWNER, NIXL_READER = "gpu-check-owner", "gpu-check-reader"


def configure_nixl_env() -> None:
    """What a service does before it creates a transport (UCX settings, NIXL's logger)."""
    try:
        from services.common.process import configure_native_libraries
    except ImportError:
        # services.common.process imports the gRPC health/reflection packages, which the GPU
        # machine lacks; these are its two effects.
        from tandem.transfer.nixl import UCX_ENV_DEFAULTS

        for key, value in UCX_ENV_DEFAULTS.items():
            os.environ.setdefault(key, value)
        if not os.environ.get("NIXL_LOG_LEVEL"):
            logging.getLogger("nixl").setLevel(logging.WARNING)
        return
    configure_native_libraries()


def kv_contents(shape: Sequence[int], device: str, seed: int = 0) -> torch.Tensor:
    """Random bf16 bit patterns, the same in any process on the same kind of device."""
    gen = torch.Generator(device=device).manual_seed(seed)
    bits = torch.randint(
        -(2**15), 2**15, tuple(shape), dtype=torch.int16, generator=gen, device=device
    )
    return bits.view(torch.bfloat16)


def _nixl_owner(conn: Connection, device: str, shape: tuple[int, ...]) -> None:
    """Owner process: register a known KV cache, export on request, poll() in between."""
    configure_nixl_env()
    from tandem.transfer import make_transport

    cache = kv_contents(shape, device)
    transport = make_transport("nixl", NIXL_OWNER)
    transport.register(cache)
    conn.send("ready")
    while True:
        transport.poll()
        try:
            if not conn.poll(100e-6):
                continue
            cmd, arg = conn.recv()
        except (EOFError, OSError):  # the reader went away
            break
        if cmd == "export":
            conn.send(transport.export(arg))
        elif cmd == "stop":
            break
    transport.close()


class NixlOwner:
    def __init__(self, device: str, shape: tuple[int, ...], timeout_s: float) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_nixl_owner, args=(child, device, shape), daemon=True)
        self.proc.start()
        child.close()
        if not self.conn.poll(timeout_s):
            raise RuntimeError(f"NIXL owner process not ready after {timeout_s:.0f} s")
        assert self.conn.recv() == "ready"

    def export(self, block_ids: Sequence[int]) -> Any:
        self.conn.send(("export", list(block_ids)))
        if not self.conn.poll(60):
            raise RuntimeError("NIXL owner did not answer export")
        return self.conn.recv()

    def stop(self) -> None:
        with contextlib.suppress(OSError):
            self.conn.send(("stop", None))
        self.proc.join(30)
        if self.proc.is_alive():
            self.proc.kill()
        self.conn.close()


def _time_s(fn: Callable[[], Any], device: str) -> float:
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t0


def check_nixl(ctx: Context) -> Figures:
    if importlib.util.find_spec("nixl") is None:
        raise PartSkipped("nixl is not importable (carry its wheel: see GPU.md)")
    s, dev = ctx.sizes, ctx.device
    configure_nixl_env()  # before the owner starts: it inherits the environment
    from tandem.transfer import make_transport

    block_shape = s.nixl_block_shape
    owner_shape = (s.nixl_owner_blocks, *block_shape)
    reader_blocks = max(s.nixl_read_blocks)
    block_bytes = math.prod(block_shape) * 2
    memory = "VRAM" if ctx.cuda else "DRAM"
    ctx.log(
        f"nixl: owner {s.nixl_owner_blocks} blocks of {block_bytes / 2**20:.2f} MiB in "
        f"{memory}, reader {reader_blocks} blocks"
    )
    src = kv_contents(owner_shape, dev)  # the owner's bytes, regenerated here
    dst = torch.zeros((reader_blocks, *block_shape), dtype=torch.bfloat16, device=dev)
    owner = NixlOwner(dev, owner_shape, timeout_s=max(30.0, ctx.left_s() - 30))
    reader = make_transport("nixl", NIXL_READER)
    cases = []
    try:
        reader.register(dst)
        rng = random.Random(0)
        for n in s.nixl_read_blocks:
            for layout in ("contiguous", "scattered"):
                if layout == "contiguous":
                    start = rng.randrange(0, s.nixl_owner_blocks - n + 1)
                    remote_ids = list(range(start, start + n))
                else:
                    remote_ids = rng.sample(range(s.nixl_owner_blocks), n)
                cases.append(_nixl_case(ctx, owner, reader, src, dst, remote_ids, layout))
    finally:
        reader.close()
        owner.stop()
    return {
        "memory_type": memory,
        "block_shape": list(block_shape),
        "block_bytes": block_bytes,
        "dtype": "bfloat16",
        "reps": s.nixl_reps,
        "gbps_unit": "1e9 bytes moved per second (median); a copy also reads them",
        "cases": cases,
    }


def _nixl_case(
    ctx: Context,
    owner: NixlOwner,
    reader: Any,
    src: torch.Tensor,
    dst: torch.Tensor,
    remote_ids: list[int],
    layout: str,
) -> Figures:
    dev, n = ctx.device, len(remote_ids)
    local_ids = list(range(n))
    remote = owner.export(remote_ids)
    index = torch.tensor(remote_ids, device=dev)
    expected = src[index]
    out = dst[:n]

    def nixl_read() -> None:
        reader.read(remote, local_ids)

    def copy_blocks() -> None:
        torch.index_select(src, 0, index, out=out)

    def bits(t: torch.Tensor) -> torch.Tensor:
        return t.view(torch.int16)  # random bit patterns include NaNs: compare bits

    for fn, what in ((nixl_read, "NIXL read"), (copy_blocks, "device copy")):
        out.zero_()
        fn()
        sync(dev)
        if not torch.equal(bits(out), bits(expected)):
            raise RuntimeError(f"{what} of {n} {layout} blocks returned wrong data")
    nixl_s, copy_s = [], []
    for _ in range(ctx.sizes.nixl_reps):
        nixl_s.append(_time_s(nixl_read, dev))
        copy_s.append(_time_s(copy_blocks, dev))
    if not torch.equal(bits(out), bits(expected)):
        raise RuntimeError(f"wrong data after the timed copies of {n} {layout} blocks")
    nbytes = n * src[0].numel() * src.element_size()
    nixl_gbps = nbytes / statistics.median(nixl_s) / 1e9
    copy_gbps = nbytes / statistics.median(copy_s) / 1e9
    case = {
        "blocks": n,
        "layout": layout,
        "mib": round(nbytes / 2**20, 1),
        "descriptors": reader.last_num_descriptors,
        "nixl_gbps": round(nixl_gbps, 2),
        "copy_gbps": round(copy_gbps, 2),
        "ratio_nixl_over_copy": round(nixl_gbps / copy_gbps, 3),
        "nixl_ms_median": round(statistics.median(nixl_s) * 1e3, 3),
        "copy_ms_median": round(statistics.median(copy_s) * 1e3, 3),
    }
    ctx.log(f"  nixl {n} {layout} blocks: {case}")
    return case


# -- part 4: serve -------------------------------------------------------------------------

SERVE_IMPORTS = (
    "grpc",
    "grpc_health.v1.health",
    "grpc_reflection.v1alpha.reflection",
    "tandem.v1.router_pb2",
    "tandem.client",
    "nixl",
)


class Service:
    """`python -m module args` with stderr in a log file; `address` from its READY line."""

    def __init__(self, module: str, args: Sequence[str], log_path: Path) -> None:
        self.module, self.log_path = module, log_path
        env = dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p
        )
        self.proc = subprocess.Popen(
            [sys.executable, "-m", module, *args],
            stdout=subprocess.PIPE,
            stderr=log_path.open("w"),
            text=True,
            cwd=REPO_ROOT,
            env=env,
        )
        self.address = ""

    def wait_ready(self, deadline: float) -> str:
        assert self.proc.stdout is not None
        while not self.address:
            left = deadline - time.monotonic()
            if left <= 0 or self.proc.poll() is not None:
                state = "exited" if self.proc.poll() is not None else "timed out"
                raise RuntimeError(f"{self.module} {state} before READY:\n{self.tail()}")
            ready, _, _ = select.select([self.proc.stdout], [], [], min(left, 1.0))
            if ready:
                line = self.proc.stdout.readline()
                if line.startswith("READY"):
                    self.address = line.split()[-1]
        return self.address

    def tail(self, n: int = 25) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(f"    {self.module}: {line}" for line in lines[-n:])

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def check_serve(ctx: Context) -> Figures:
    for module in SERVE_IMPORTS:
        try:
            importlib.import_module(module)
        except Exception as exc:  # ImportError, or generated code refusing its runtime
            raise PartSkipped(f"cannot import {module}: {type(exc).__name__}: {exc}") from None
    from tandem.client import TandemClient
    from tandem.model.tiny import make_tiny_model

    s, dev = ctx.sizes, ctx.device
    model_dir = make_tiny_model(ctx.tmp_dir / "serve-tiny", preset="tiny", seed=0)
    engine_flags = ["--model-dir", str(model_dir), "--device", dev, "--dtype", s.serve_dtype]
    engine_flags += ["--num-blocks", str(s.serve_num_blocks), "--redis-url", ""]
    if not ctx.cuda:
        engine_flags += ["--num-threads", "1"]  # three processes share two cores in CI
    services: list[Service] = []
    ok = False
    try:
        for role in ("prefill", "decode"):
            args = [*engine_flags, "--port", "0", "--worker-id", f"gpu-check-{role}"]
            services.append(Service(f"services.{role}", args, ctx.tmp_dir / f"{role}.log"))
        prefill, decode = services
        # The reference engine loads while the workers start.
        reference = make_engine(
            model_dir, dev, s.serve_dtype, block_size=16, num_blocks=s.serve_num_blocks
        )
        deadline = time.monotonic() + max(30.0, ctx.left_s() - 30)
        p_addr, d_addr = prefill.wait_ready(deadline), decode.wait_ready(deadline)
        router_args = ["--model-dir", str(model_dir), "--port", "0", "--redis-url", ""]
        router_args += ["--prefill-addresses", p_addr, "--decode-addresses", d_addr]
        router_args += ["--disagg-min-uncached-tokens", "0"]
        services.append(Service("services.router", router_args, ctx.tmp_dir / "router.log"))
        r_addr = services[-1].wait_ready(deadline)
        ctx.log(f"serve: prefill {p_addr}, decode {d_addr}, router {r_addr}")

        rng = random.Random(0)
        prompts = [
            rng.choices(range(5, 512), k=rng.randint(*s.serve_prompt_len))
            for _ in range(s.serve_num_requests)
        ]
        n = s.serve_max_tokens
        greedy = _sampling_params(max_tokens=n, temperature=0.0, ignore_eos=True)
        results = []
        # One at a time, here and on the reference: each step then has the same batch
        # composition on both sides (bf16 GEMMs may pick shape-dependent kernels).
        with TandemClient(r_addr, timeout_s=120) as client:
            for p in prompts:
                results.append(client.generate(p, max_tokens=n, temperature=0.0, ignore_eos=True))
        expected = [reference.generate([p], greedy)[0].token_ids for p in prompts]
        recomputed = (ctx.tmp_dir / "decode.log").read_text().count("recomputing locally")
        requests = [
            {
                "prompt_tokens": len(p),
                "identical": r.token_ids == want,
                "disaggregated": r.disaggregated,
                "finish_reason": r.finish_reason,
                "first_token_ms": round(r.first_token_ms, 1),
                "total_ms": round(r.total_ms, 1),
            }
            for p, r, want in zip(prompts, results, expected, strict=True)
        ]
        figures: Figures = {
            "dtype": s.serve_dtype,
            "max_tokens": n,
            "requests": requests,
            "kv_pulls_recomputed": recomputed,
        }
        problems = []
        if not all(r["identical"] for r in requests):
            problems.append("tokens differ from the single engine")
        if not all(r["disaggregated"] for r in requests):
            problems.append("not every request was disaggregated")
        if recomputed:
            problems.append(f"{recomputed} KV pulls failed and were recomputed")
        if problems:
            raise PartFailed("; ".join(problems), figures)
        ok = True
        return figures
    finally:
        for service in reversed(services):
            service.stop()
        if not ok:
            for service in services:
                ctx.log(f"serve: last lines of {service.log_path.name}:\n{service.tail()}")


# -- main ----------------------------------------------------------------------------------

PART_FNS: dict[str, Callable[[Context], Figures]] = {
    "parity": check_parity,
    "throughput": check_throughput,
    "nixl": check_nixl,
    "serve": check_serve,
}


def run_part(name: str, ctx: Context) -> Figures:
    """Run one part under its budget; never raises."""
    budget = ctx.sizes.budget_s.get(name, 300.0)
    ctx.deadline = time.monotonic() + budget
    ctx.log(f"== {name} (budget {budget:.0f} s)")
    t0 = time.perf_counter()
    record: Figures = {"status": "ok", "reason": None, "budget_s": budget, "figures": {}}
    try:
        record["figures"] = PART_FNS[name](ctx)
    except PartSkipped as exc:
        record.update(status="skipped", reason=str(exc))
    except PartFailed as exc:
        record.update(status="failed", reason=str(exc), figures=exc.figures)
    except Exception as exc:
        ctx.log(traceback.format_exc().rstrip())
        record.update(status="failed", reason=f"{type(exc).__name__}: {exc}")
    finally:
        _free_memory(ctx.device)
    record["duration_s"] = round(time.perf_counter() - t0, 2)
    if record["duration_s"] > budget:
        ctx.log(f"{name}: over its budget ({record['duration_s']:.0f} s > {budget:.0f} s)")
    reason = f": {record['reason']}" if record["reason"] else ""
    ctx.log(f"== {name}: {record['status']} in {record['duration_s']:.1f} s{reason}")
    return record


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="scripts/gpu-check", description=(__doc__ or "").split("\n\n")[0]
    )
    parser.add_argument("--cpu", action="store_true", help="device cpu, tiny sizes (CI)")
    parser.add_argument(
        "--parts", default=",".join(PARTS), help=f"comma-separated subset of {','.join(PARTS)}"
    )
    parser.add_argument(
        "--out", type=Path, default=None, help="output dir (default: $OUT, else ./gpu-check-out)"
    )
    args = parser.parse_args(argv)
    args.parts = [p for p in args.parts.split(",") if p]
    unknown = [p for p in args.parts if p not in PARTS]
    if unknown or not args.parts:
        parser.error(f"--parts must name some of {', '.join(PARTS)}; got {args.parts}")
    if args.out is None:
        args.out = Path(os.environ.get("OUT") or "gpu-check-out")
    return args


@contextlib.contextmanager
def _tmp_dir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="gpu-check-"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    sizes = CPU_SIZES if args.cpu else CUDA_SIZES
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / LOG_NAME).unlink(missing_ok=True)
    log = Log(args.out / LOG_NAME)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if args.cpu:
        # One intra-op thread: a 2-thread OpenMP pool on a loaded 2-core CI machine was seen
        # to hang in a tiny matmul (tests/conftest.py), and tiny sizes gain nothing from more.
        torch.set_num_threads(1)
    started = time.perf_counter()
    report: Figures = {
        "mode": sizes.device,
        "command": " ".join(["scripts/gpu-check", *(sys.argv[1:] if argv is None else argv)]),
        "started_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "environment": environment(sizes.device),
        "sizes": dataclasses.asdict(sizes),
        "parts": {},
    }
    log(f"gpu-check: mode {sizes.device}, parts {','.join(args.parts)}, out {args.out}")
    env = report["environment"]
    log(
        f"torch {env['torch']} (cuda {env['torch_cuda']}), transformers {env['transformers']}, "
        f"triton {env['triton']}, nixl {env['nixl']}, device {env['device_name']}"
    )

    def write() -> None:
        report["duration_s"] = round(time.perf_counter() - started, 2)
        statuses = [p["status"] for p in report["parts"].values()]
        report["ok"] = "failed" not in statuses
        (args.out / JSON_NAME).write_text(json.dumps(report, indent=2, default=str) + "\n")

    with _tmp_dir() as tmp:
        ctx = Context(sizes=sizes, log=log, tmp_dir=tmp)
        for name in PARTS:
            if name not in args.parts:
                report["parts"][name] = {"status": "skipped", "reason": "not selected (--parts)"}
            elif not args.cpu and not torch.cuda.is_available():
                reason = "CUDA is not available (use --cpu for the CPU smoke run)"
                report["parts"][name] = {"status": "failed", "reason": reason}
                log(f"== {name}: failed: {reason}")
            else:
                report["parts"][name] = run_part(name, ctx)
            write()
    summary = ", ".join(f"{n} {p['status']}" for n, p in report["parts"].items())
    log(f"gpu-check: {summary}; {report['duration_s']:.1f} s; wrote {args.out / JSON_NAME}")
    log.close()
    return 0 if report["ok"] else 1
