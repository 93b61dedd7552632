"""Engine benchmarks on CPU: throughput vs HF transformers, batch-1 decode vs the memory
roofline, time to first token with a shared prefix, and the loader's peak memory.

    python benchmarks/bench_engine.py [throughput|roofline|prefix|loader|all] [--quick]
        [--model-dir DIR] [--results-dir DIR] [--threads N] [--hf-batch-sizes 16,64]

Progress goes to stderr, a markdown table to stdout, JSON to <results-dir>/<name>.json and a
plot of whatever results exist to <results-dir>/engine.png. `--quick` shrinks every workload
(smoke test, well under a minute), `--threads N` sets torch's thread count for both
systems and `--hf-batch-sizes` replaces the HF batch sizes of the throughput benchmark (e.g.
`16` alone, for a bigger model whose full run would take too long); each suffixes the file
names (`-quick`, `-tN`, `-hf16`) so that such a run never overwrites the numbers of a default
run.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # siblings import by name
from report import REPO_ROOT, RESULTS_DIR, machine_info, result_path, verdict, write_json

from tandem.config import CacheConfig, EngineConfig, SchedulerConfig
from tandem.engine.engine import LLMEngine
from tandem.engine.request import Request
from tandem.engine.sampling import SamplingParams
from tandem.model.config import ModelConfig
from tandem.model.linear import MatmulKind, matmul
from tandem.model.llama import LayerWeights, ModelWeights
from tandem.weights.loader import load_weights, safetensors_files
from tandem.weights.tiny import SPECIAL_TOKENS, make_tiny_model

DEFAULT_MODEL_DIR = REPO_ROOT / ".cache" / "models" / "small"
# Special tokens take the first ids; random prompts avoid them so no BOS/EOS lands mid-prompt.
FIRST_ORDINARY_ID = len(SPECIAL_TOKENS)
BENCHMARKS = ("throughput", "roofline", "prefix", "loader")
# Targets from the issue; the direction of each comparison is fixed by the metric.
TARGET_THROUGHPUT_RATIO = 2.0  # Tandem tokens/s over the best HF batch size, at least
TARGET_ROOFLINE_FRACTION = 0.5  # roofline step time over measured step time, at least
TARGET_TTFT_RATIO = 0.25  # TTFT with the prefix cached over TTFT without, at most
TARGET_LOADER_PEAK_RATIO = 1.25  # peak RSS growth while loading over weight bytes, at most
MIB = 1 << 20

_START = time.perf_counter()


def log(msg: str) -> None:
    """Progress line on stderr (stdout carries only the markdown report)."""
    print(f"[{time.perf_counter() - _START:7.1f}s] {msg}", file=sys.stderr, flush=True)


@dataclass(frozen=True, slots=True)
class Sizes:
    """Workload sizes of one mode (full or --quick)."""

    num_prompts: int
    prompt_len: tuple[int, int]  # inclusive range
    output_len: tuple[int, int]  # inclusive range
    hf_batch_sizes: tuple[int, ...]
    agree_requests: int  # requests whose greedy tokens are checked against HF at batch 1
    agree_tokens: int  # at most this many tokens of each
    bw_mib: int
    bw_reps: int
    decode_prompt_len: int
    decode_max_tokens: int
    decode_warmup_steps: int
    decode_timed_steps: int
    prefix_len: int
    suffix_len: int
    prefix_trials: int
    loader_reps: int  # fresh processes per loader
    # Tandem's model dtype (--dtype): float32 compares with HF in float32 token for token;
    # "auto" is what a user gets (bfloat16 through oneDNN on a CPU that runs it natively).
    dtype: str = "float32"

    def __post_init__(self) -> None:
        # The prefill step yields the first token; every later step must still decode one,
        # or the timed loop would time empty steps.
        needed = 1 + self.decode_warmup_steps + self.decode_timed_steps
        if self.decode_max_tokens < needed:
            raise ValueError(f"decode_max_tokens must be >= {needed}")


FULL = Sizes(
    num_prompts=64,
    prompt_len=(32, 512),
    output_len=(16, 256),
    hf_batch_sizes=(16, 64),
    agree_requests=4,
    agree_tokens=32,
    bw_mib=1024,
    bw_reps=20,
    decode_prompt_len=128,
    decode_max_tokens=300,
    decode_warmup_steps=20,
    decode_timed_steps=200,
    prefix_len=1024,
    suffix_len=32,
    prefix_trials=3,
    loader_reps=3,
)
QUICK = Sizes(
    num_prompts=8,
    prompt_len=(16, 64),
    output_len=(4, 16),
    hf_batch_sizes=(4, 8),
    agree_requests=2,
    agree_tokens=8,
    bw_mib=64,
    bw_reps=4,
    decode_prompt_len=32,
    decode_max_tokens=40,
    decode_warmup_steps=3,
    decode_timed_steps=20,
    prefix_len=128,
    suffix_len=16,
    prefix_trials=3,
    loader_reps=1,
)


# -- setup ---------------------------------------------------------------------------------


def ensure_model(model_dir: Path) -> Path:
    if (model_dir / "config.json").is_file() and (model_dir / "model.safetensors").is_file():
        return model_dir
    log(f"generating the 'small' preset model into {model_dir}")
    return make_tiny_model(model_dir, preset="small", seed=0, progress=log)


def vocab_size(model_dir: Path) -> int:
    return int(json.loads((model_dir / "config.json").read_text())["vocab_size"])


def make_engine(model_dir: Path, dtype: str) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model_dir=str(model_dir),
            dtype=dtype,
            cache=CacheConfig(kv_cache_bytes=1 << 30),
            scheduler=SchedulerConfig(max_num_seqs=64, max_num_batched_tokens=2048),
        )
    )


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


def random_tokens(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(FIRST_ORDINARY_ID, vocab) for _ in range(n)]


def machine_extra() -> dict[str, Any]:
    """This script's fields of the results' `machine` (report.machine_info)."""
    extra: dict[str, Any] = {
        "torch_version": torch.__version__,
        "torch_threads": torch.get_num_threads(),
    }
    if "transformers" in sys.modules:
        extra["transformers_version"] = sys.modules["transformers"].__version__
    return extra


class Stopwatch:
    """Wall time, plus what the shared machine was doing meanwhile.

    cpu_util = process CPU seconds / (wall seconds x torch threads). Well below 1 means our
    threads waited for cores that other processes held, so the wall time is inflated; the
    1-minute load average before and after says the same from the outside.
    """

    def __enter__(self) -> Stopwatch:
        self._load_before = os.getloadavg()[0]
        self._cpu0 = time.process_time()
        self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.wall = time.perf_counter() - self._t0
        cpu = time.process_time() - self._cpu0
        self.stats = {
            "wall_s": self.wall,
            "cpu_s": cpu,
            "cpu_util": cpu / (self.wall * torch.get_num_threads()),
            "loadavg_1m_before": self._load_before,
            "loadavg_1m_after": os.getloadavg()[0],
        }

    def elapsed(self) -> float:
        return time.perf_counter() - self._t0


def percentile(values: Sequence[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


# -- 1. throughput -------------------------------------------------------------------------


def make_workload(sizes: Sizes, vocab: int) -> list[tuple[list[int], int]]:
    """(prompt, requested output length) per request, deterministic from Random(0)."""
    rng = random.Random(0)
    lengths = [
        (rng.randint(*sizes.prompt_len), rng.randint(*sizes.output_len))
        for _ in range(sizes.num_prompts)
    ]
    return [(random_tokens(rng, p, vocab), o) for p, o in lengths]


def run_tandem(
    model_dir: Path, workload: list[tuple[list[int], int]], dtype: str
) -> dict[str, Any]:
    log("throughput: loading Tandem engine")
    engine = make_engine(model_dir, dtype)
    # One short request first, so one-time costs (allocator growth, kernel selection) are
    # not billed to the timed run; HF gets the same courtesy.
    engine.add_request(engine.spec("warmup", workload[0][0][:16], greedy(4)))
    while engine.has_unfinished():
        engine.step()

    log(f"throughput: Tandem, {len(workload)} requests added at once")
    tokens: dict[str, list[int]] = {}
    requests: list[Request] = []
    steps = 0
    with Stopwatch() as watch:
        for i, (prompt, out_len) in enumerate(workload):
            requests.append(engine.add_request(engine.spec(f"r{i}", prompt, greedy(out_len))))
            tokens[f"r{i}"] = []
        last_log = 0.0
        while engine.has_unfinished():
            for out in engine.step():
                tokens[out.request_id].extend(out.new_token_ids)
            steps += 1
            now = watch.elapsed()
            if now - last_log >= 5.0:
                done = sum(len(t) for t in tokens.values())
                log(f"throughput: Tandem step {steps}, {done} tokens, {now:.1f}s")
                last_log = now
    wall = watch.wall

    for (_, out_len), req in zip(workload, requests, strict=True):
        got = len(tokens[req.request_id])
        if got != out_len:
            raise RuntimeError(f"{req.request_id}: asked for {out_len} tokens, got {got}")
    useful = sum(out_len for _, out_len in workload)
    log(
        f"throughput: Tandem {useful} tokens in {wall:.1f}s = {useful / wall:.1f} tok/s "
        f"(cpu util {watch.stats['cpu_util']:.2f})"
    )
    result = {
        **watch.stats,
        "output_tokens": useful,
        "tokens_per_s": useful / wall,
        "tokens_per_cpu_s": useful / watch.stats["cpu_s"],
        "steps": steps,
        "preemptions": sum(r.num_preemptions for r in requests),
        "tokens": tokens,  # for the agreement check; popped before the JSON is written
    }
    del engine
    gc.collect()
    return result


def hf_generate(
    model: Any, prompts: Sequence[Sequence[int]], new_tokens: int, fixed_length: bool
) -> list[list[int]]:
    """Greedy HF generation, left-padded with an attention mask; returns new tokens only."""
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)  # pad id 0
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = torch.tensor(prompt)
        mask[row, width - len(prompt) :] = 1
    kwargs: dict[str, Any] = {"max_new_tokens": new_tokens, "do_sample": False, "pad_token_id": 0}
    if fixed_length:
        # Every row runs the batch's longest request: that is what static batching costs.
        kwargs["min_new_tokens"] = new_tokens
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, **kwargs)
    return [row[width:].tolist() for row in out]


def run_hf(model: Any, workload: list[tuple[list[int], int]], batch_size: int) -> dict[str, Any]:
    log(f"throughput: HF generate, batch size {batch_size}")
    batches = []
    with Stopwatch() as watch:
        for start in range(0, len(workload), batch_size):
            batch = workload[start : start + batch_size]
            longest = max(out_len for _, out_len in batch)
            with Stopwatch() as batch_watch:
                outs = hf_generate(model, [p for p, _ in batch], longest, fixed_length=True)
            if any(len(o) != longest for o in outs):
                raise RuntimeError(f"HF made {[len(o) for o in outs]} tokens, not {longest} each")
            batches.append({"size": len(batch), "new_tokens": longest, **batch_watch.stats})
            log(
                f"throughput: HF bs{batch_size} batch {len(batches)}: "
                f"{len(batch)} x {longest} tokens in {batch_watch.wall:.1f}s "
                f"(cpu util {batch_watch.stats['cpu_util']:.2f})"
            )
    # Only each request's own requested tokens count; padding the batch to its longest
    # request is waste that static batching pays for.
    useful = sum(out_len for _, out_len in workload)
    generated = sum(b["size"] * b["new_tokens"] for b in batches)
    log(f"throughput: HF bs{batch_size} {useful} useful tokens in {watch.wall:.1f}s")
    return {
        "batch_size": batch_size,
        **watch.stats,
        "output_tokens": useful,
        "generated_tokens": generated,
        "tokens_per_s": useful / watch.wall,
        "tokens_per_cpu_s": useful / watch.stats["cpu_s"],
        "batches": batches,
    }


def check_agreement(
    model: Any,
    workload: list[tuple[list[int], int]],
    tandem_tokens: dict[str, list[int]],
    sizes: Sizes,
    eos_ids: set[int],
) -> dict[str, Any]:
    """Tandem's greedy tokens vs HF's unpadded batch-1 greedy generation."""
    rows = []
    for i in range(sizes.agree_requests):
        prompt, out_len = workload[i]
        n = min(sizes.agree_tokens, out_len)
        # No min_new_tokens: that would suppress EOS and change the argmax. HF may stop at
        # EOS instead (Tandem ignores it), so compare the tokens HF did produce.
        hf = hf_generate(model, [prompt], n, fixed_length=False)[0]
        ours = tandem_tokens[f"r{i}"][: len(hf)]
        stopped_early = len(hf) < n
        ok = ours == hf and (not stopped_early or hf[-1] in eos_ids)
        mismatch = next((j for j, (a, b) in enumerate(zip(ours, hf, strict=True)) if a != b), None)
        rows.append({"request": f"r{i}", "compared": len(hf), "agree": ok, "first_diff": mismatch})
        log(f"throughput: agreement r{i}: {len(hf)} tokens, agree={ok}")
    return {"agree": "yes" if all(r["agree"] for r in rows) else "no", "requests": rows}


def bench_throughput(model_dir: Path, sizes: Sizes) -> dict[str, Any]:
    workload = make_workload(sizes, vocab_size(model_dir))
    tandem = run_tandem(model_dir, workload, sizes.dtype)
    tandem_tokens = tandem.pop("tokens")

    from transformers import AutoModelForCausalLM  # slow import: only this benchmark needs it

    log("throughput: loading HF model")
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model.eval()
    hf_generate(model, [workload[0][0][:16]], 4, fixed_length=True)  # warm-up, as for Tandem
    hf_runs = [run_hf(model, workload, bs) for bs in sizes.hf_batch_sizes]
    eos = model.generation_config.eos_token_id
    eos_ids = set(eos if isinstance(eos, list) else [eos] if eos is not None else [])
    agreement = check_agreement(model, workload, tandem_tokens, sizes, eos_ids)
    del model
    gc.collect()

    best = max(hf_runs, key=lambda r: r["tokens_per_s"])
    ratio = tandem["tokens_per_s"] / best["tokens_per_s"]
    prompt_lens = [len(p) for p, _ in workload]
    return {
        "workload": {
            "num_prompts": len(workload),
            "prompt_tokens": sum(prompt_lens),
            "output_tokens": sum(o for _, o in workload),
            "max_prompt_len": max(prompt_lens),
            "max_output_len": max(o for _, o in workload),
        },
        "tandem": tandem,
        "hf": hf_runs,
        "best_hf_batch_size": best["batch_size"],
        "ratio_vs_best_hf": ratio,
        # Secondary, less sensitive to other processes taking cores mid-run: tokens per
        # second of CPU time this process actually got (spin-waiting still counts).
        "cpu_time_ratio_vs_best_hf": tandem["tokens_per_cpu_s"]
        / max(r["tokens_per_cpu_s"] for r in hf_runs),
        "target": TARGET_THROUGHPUT_RATIO,
        "pass": ratio >= TARGET_THROUGHPUT_RATIO,
        "correctness": agreement,
    }


# -- 2. roofline ---------------------------------------------------------------------------


class ReadBandwidth:
    """Bytes read per second by torch.sum over one float32 buffer, with torch's current thread
    count: batch-1 decode streams every weight once through the same threads, so this is the
    rate its roofline is bounded by. Sampled at several points of a run; the figure is the
    best sample, not the median: the roofline is what the memory system can do, and on a
    shared machine other jobs only ever slow a sample down, for seconds at a time.
    """

    def __init__(self, mib: int) -> None:
        # Initialized: untouched pages all map the shared zero page, which reads from cache.
        self.buf = torch.rand(mib * MIB // 4)
        self.buf.sum()
        self.times: list[float] = []

    def sample(self, reps: int) -> float:
        """Take `reps` samples; returns the best bandwidth so far."""
        for _ in range(reps):
            t0 = time.perf_counter()
            self.buf.sum()
            self.times.append(time.perf_counter() - t0)
        return self.bytes_per_s()

    def bytes_per_s(self) -> float:
        return self.buf.nbytes / min(self.times)

    def result(self) -> dict[str, Any]:
        return {
            "bytes": self.buf.nbytes,
            "threads": torch.get_num_threads(),
            "best_s": min(self.times),
            "median_s": statistics.median(self.times),
            "bytes_per_s": self.bytes_per_s(),
            "times_s": self.times,
        }


def matmul_times(weights: ModelWeights, kind: MatmulKind, reps: int) -> tuple[list[float], int]:
    """Seconds per pass of the batch-1 products of every matrix a decode step multiplies by
    (all but the embedding, which it indexes), as the model applies them (`kind`), and their
    bytes: a decode step with everything but the weight matmuls taken away, which splits the
    gap to the roofline in two."""
    mats = [t for lw in weights.layers for t in (lw.qkv, lw.o, lw.gate_up, lw.down)]
    mats.append(weights.lm_head)
    # A plain matrix is stored [in, out]; a oneDNN-packed one reports [out, in].
    in_dim = 1 if kind is MatmulKind.ONEDNN else 0
    xs = [torch.randn(1, w.shape[in_dim], dtype=w.dtype) for w in mats]  # x: [1, in]
    times = []
    with torch.inference_mode():
        for _ in range(reps + 1):  # the first pass is a warm-up
            t0 = time.perf_counter()
            for x, w in zip(xs, mats, strict=True):
                matmul(x, w, kind)
            times.append(time.perf_counter() - t0)
    return times[1:], sum(w.numel() * w.element_size() for w in mats)


def bench_roofline(model_dir: Path, sizes: Sizes) -> dict[str, Any]:
    log("roofline: loading Tandem engine")
    engine = make_engine(model_dir, sizes.dtype)
    weight_bytes = engine.model.weights.num_bytes()
    embed = engine.model.weights.embed
    kind = engine.model.matmul
    dtype = str(embed.dtype).removeprefix("torch.")
    # A packed lm_head is a copy (opaque to data_ptr): the step reads it whole either way.
    lm_head = engine.model.weights.lm_head
    lm_head_ptr = None if kind is MatmulKind.ONEDNN else lm_head.data_ptr()
    prompt = random_tokens(random.Random(1), sizes.decode_prompt_len, vocab_size(model_dir))
    threads = torch.get_num_threads()

    log(f"roofline: read bandwidth ({sizes.bw_mib} MiB, {threads} threads)")
    bandwidth = ReadBandwidth(sizes.bw_mib)
    log(f"roofline: {bandwidth.sample(sizes.bw_reps) / 1e9:.2f} GB/s")

    engine.add_request(engine.spec("decode", prompt, greedy(sizes.decode_max_tokens)))
    engine.step()  # the prefill
    for _ in range(sizes.decode_warmup_steps):
        engine.step()
    log(f"roofline: timing {sizes.decode_timed_steps} batch-1 decode steps")
    times = []
    for i in range(sizes.decode_timed_steps):
        if i and i % max(1, sizes.decode_timed_steps // 4) == 0:
            # Bandwidth samples between the decode chunks too (untimed for decode): more
            # chances to catch the machine quiet.
            bandwidth.sample(sizes.bw_reps // 4)
        t0 = time.perf_counter()
        outs = engine.step()
        times.append(time.perf_counter() - t0)
        if len(outs) != 1 or len(outs[0].new_token_ids) != 1:
            raise RuntimeError(f"a timed decode step returned {outs}")
    step = statistics.median(times)
    log(f"roofline: median step {step * 1e3:.2f} ms")
    engine.abort("decode")
    mm_times, mm_bytes = matmul_times(
        engine.model.weights, engine.model.matmul, sizes.decode_timed_steps
    )
    mm_step = statistics.median(mm_times)
    log(f"roofline: the step's matmuls alone, median {mm_step * 1e3:.2f} ms")
    del engine
    gc.collect()

    bw = bandwidth.sample(sizes.bw_reps)
    log(f"roofline: read bandwidth, best of {len(bandwidth.times)}: {bw / 1e9:.2f} GB/s")
    roofline = weight_bytes / bw
    fraction = roofline / step
    # Decode reads one row of the embedding table, not all of it; unless lm_head is the same
    # table (tied embeddings, as SmolLM2's), which the step reads whole.
    touched = weight_bytes
    if lm_head_ptr != embed.data_ptr():
        touched += embed[0].nbytes - embed.numel() * embed.element_size()
    return {
        "weight_bytes": weight_bytes,
        "threads": threads,
        "dtype": dtype,
        "matmul": kind.value,
        "bandwidth": bandwidth.result(),
        "bandwidth_bytes_per_s": bw,
        "roofline_step_s": roofline,
        "step_s_median": step,
        "step_s_p10": percentile(times, 0.1),
        "step_s_p90": percentile(times, 0.9),
        "step_times_s": times,
        "fraction": fraction,
        "target": TARGET_ROOFLINE_FRACTION,
        "pass": fraction >= TARGET_ROOFLINE_FRACTION,
        # Other readings of the same measurement, for context (not the target figure): the
        # bytes decode actually reads (one embedding row, not the table), and the fastest
        # tenth of steps instead of the median.
        "alt_fraction_touched_bytes": touched / bw / step,
        "alt_fraction_p10_step": roofline / percentile(times, 0.1),
        "touched_weight_bytes": touched,
        # The same step's weight matmuls alone (batch-1 x @ w, nothing else): how far torch's
        # GEMV is from the bandwidth, and how much of the step is everything else.
        "matmul_bytes": mm_bytes,
        "matmul_step_s_median": mm_step,
        "matmul_times_s": mm_times,
        "matmul_fraction": mm_bytes / bw / mm_step,
        "matmul_share_of_step": mm_step / step,
    }


# -- 3. prefix -----------------------------------------------------------------------------


def time_to_first_token(engine: LLMEngine, rid: str, prompt: list[int]) -> tuple[float, Request]:
    """Seconds from add_request to the end of the step that returns rid's first token."""
    t0 = time.perf_counter()
    request = engine.add_request(engine.spec(rid, prompt, greedy(1)))
    first = None
    while first is None:
        if not engine.has_unfinished():
            raise RuntimeError(f"{rid} finished without a first token")
        for out in engine.step():
            if out.request_id == rid and out.new_token_ids:
                first = time.perf_counter()
    while engine.has_unfinished():
        engine.step()
    return first - t0, request


def bench_prefix(model_dir: Path, sizes: Sizes) -> dict[str, Any]:
    log("prefix: loading Tandem engine")
    engine = make_engine(model_dir, sizes.dtype)
    vocab = vocab_size(model_dir)
    rng = random.Random(2)

    def pair(engine: LLMEngine, tag: str) -> tuple[float, float, Request, Request]:
        prefix = random_tokens(rng, sizes.prefix_len, vocab)
        suffix_a = random_tokens(rng, sizes.suffix_len, vocab)
        suffix_b = random_tokens(rng, sizes.suffix_len, vocab)
        ttft_a, req_a = time_to_first_token(engine, f"{tag}-a", prefix + suffix_a)
        ttft_b, req_b = time_to_first_token(engine, f"{tag}-b", prefix + suffix_b)
        return ttft_a, ttft_b, req_a, req_b

    # A discarded pair on its own prefix warms both paths (full prefill, cached prefix), so
    # a cold first prefill does not inflate A and flatter the ratio.
    pair(engine, "warmup")
    trials: list[dict[str, Any]] = []
    for i in range(sizes.prefix_trials):
        ttft_a, ttft_b, req_a, req_b = pair(engine, f"t{i}")
        trials.append(
            {
                "ttft_a_s": ttft_a,
                "ttft_b_s": ttft_b,
                "ratio": ttft_b / ttft_a,
                "a_cached_tokens": req_a.num_cached_tokens,
                "b_cached_tokens": req_b.num_cached_tokens,
            }
        )
        log(
            f"prefix: trial {i}: A {ttft_a * 1e3:.1f} ms, B {ttft_b * 1e3:.1f} ms "
            f"(B cached {req_b.num_cached_tokens} tokens), ratio {ttft_b / ttft_a:.3f}"
        )
    del engine
    gc.collect()
    ratio = statistics.median(t["ratio"] for t in trials)
    return {
        "prefix_len": sizes.prefix_len,
        "suffix_len": sizes.suffix_len,
        "trials": trials,
        "ttft_a_s_median": statistics.median(t["ttft_a_s"] for t in trials),
        "ttft_b_s_median": statistics.median(t["ttft_b_s"] for t in trials),
        "b_cached_tokens": [t["b_cached_tokens"] for t in trials],
        "ratio_median": ratio,
        "target": TARGET_TTFT_RATIO,
        "pass": ratio <= TARGET_TTFT_RATIO,
    }


# -- 4. loader -----------------------------------------------------------------------------


def load_weights_read_all(
    model_dir: Path, config: ModelConfig, dtype: torch.dtype, device: torch.device
) -> ModelWeights:
    """The loader as it was up to commit 57f122e, kept as this benchmark's baseline: read
    every tensor into a dict (safetensors' own reader), then build fused, transposed copies
    while the dict still holds the sources. Shape checks left out: same files as the new one.
    """
    from safetensors import safe_open

    tensors: dict[str, torch.Tensor] = {}
    for f in safetensors_files(model_dir):
        with safe_open(str(f), framework="pt", device="cpu") as handle:
            for name in handle.keys():
                tensors[name] = handle.get_tensor(name).to(device=device, dtype=dtype)

    def fused_t(*names: str) -> torch.Tensor:
        return torch.cat([tensors[n] for n in names]).t().contiguous()

    layers = []
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        a = p + "self_attn."
        layers.append(
            LayerWeights(
                input_norm=tensors[p + "input_layernorm.weight"],
                qkv=fused_t(a + "q_proj.weight", a + "k_proj.weight", a + "v_proj.weight"),
                qkv_bias=(
                    torch.cat([tensors[a + f"{x}_proj.bias"] for x in "qkv"])
                    if config.qkv_bias
                    else None
                ),
                q_norm=tensors[a + "q_norm.weight"] if config.qk_norm else None,
                k_norm=tensors[a + "k_norm.weight"] if config.qk_norm else None,
                o=fused_t(a + "o_proj.weight"),
                post_norm=tensors[p + "post_attention_layernorm.weight"],
                gate_up=fused_t(p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"),
                down=fused_t(p + "mlp.down_proj.weight"),
            )
        )
    embed = tensors["model.embed_tokens.weight"]
    tied = config.tie_word_embeddings
    return ModelWeights(
        embed=embed,
        layers=layers,
        final_norm=tensors["model.norm.weight"],
        lm_head=embed.t() if tied else fused_t("lm_head.weight"),
    )


LOADERS = {
    "read-all": load_weights_read_all,  # baseline: every tensor first, then fused copies
    "streaming": load_weights,  # tandem.weights.loader
}


def proc_status_kib(field: str) -> int:
    """A `kB` field of /proc/self/status (VmRSS: resident now; VmHWM: resident at peak)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def loader_child(loader: str, model_dir: str, threads: int) -> None:
    """Run in a fresh interpreter by `bench_loader`: load once, print what it cost as JSON.

    Everything but the load itself (imports, config, torch's lazy first-op setup) happens
    before the baseline, and VmHWM is reset to the current RSS just before loading, so the
    peak is the load's own.
    """
    torch.set_num_threads(threads)
    import safetensors  # noqa: F401  (the baseline loader's import, before the baseline)

    path = Path(model_dir)
    config = ModelConfig.from_dir(path)
    torch.ones(8).sum()
    gc.collect()
    try:
        Path("/proc/self/clear_refs").write_text("5")  # "5": reset the peak RSS (Linux 4.0+)
        hwm_reset = True
    except OSError:
        hwm_reset = False
    rss_before = proc_status_kib("VmRSS")
    hwm_before = proc_status_kib("VmHWM")
    t0 = time.perf_counter()
    weights = LOADERS[loader](path, config, torch.float32, torch.device("cpu"))
    load_s = time.perf_counter() - t0
    result = {
        "loader": loader,
        "hwm_reset": hwm_reset,
        "rss_before_kib": rss_before,
        "hwm_before_kib": hwm_before,
        "hwm_after_kib": proc_status_kib("VmHWM"),
        "rss_after_kib": proc_status_kib("VmRSS"),
        "weight_bytes": weights.num_bytes(),
        "load_s": load_s,
    }
    print(json.dumps(result))


def run_loader_child(loader: str, model_dir: Path) -> dict[str, Any]:
    env = dict(os.environ)
    here = str(Path(__file__).resolve().parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (here, env.get("PYTHONPATH")) if p)
    code = (
        "import sys, bench_engine as b; b.loader_child(sys.argv[1], sys.argv[2], int(sys.argv[3]))"
    )
    argv = [sys.executable, "-c", code, loader, str(model_dir), str(torch.get_num_threads())]
    out = subprocess.run(argv, env=env, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        raise RuntimeError(f"loader child {loader} failed:\n{out.stderr[-4000:]}")
    r: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    r["peak_growth_bytes"] = (r["hwm_after_kib"] - r["rss_before_kib"]) * 1024
    r["retained_bytes"] = (r["rss_after_kib"] - r["rss_before_kib"]) * 1024
    r["peak_ratio"] = r["peak_growth_bytes"] / r["weight_bytes"]
    r["retained_ratio"] = r["retained_bytes"] / r["weight_bytes"]
    return r


def bench_loader(model_dir: Path, sizes: Sizes) -> dict[str, Any]:
    """Peak resident-memory growth while loading float32 weights on CPU, over weight bytes,
    each load in a fresh process, the two loaders alternating."""
    file_bytes = 0
    for f in safetensors_files(model_dir):
        # Into the page cache first, so the first load does not pay for the disk.
        with f.open("rb") as fh:
            while chunk := fh.read(64 * MIB):
                file_bytes += len(chunk)
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in LOADERS}
    for rep in range(sizes.loader_reps):
        for name in LOADERS:
            r = run_loader_child(name, model_dir)
            runs[name].append(r)
            log(
                f"loader: {name} #{rep}: peak +{r['peak_growth_bytes'] / MIB:.0f} MiB = "
                f"{r['peak_ratio']:.2f}x the weights, retained {r['retained_ratio']:.2f}x, "
                f"{r['load_s']:.2f}s"
            )
    summary = {
        name: {
            "peak_ratio_median": statistics.median(r["peak_ratio"] for r in rs),
            "retained_ratio_median": statistics.median(r["retained_ratio"] for r in rs),
            "load_s_median": statistics.median(r["load_s"] for r in rs),
            "weight_bytes": rs[0]["weight_bytes"],
        }
        for name, rs in runs.items()
    }
    ratio = summary["streaming"]["peak_ratio_median"]
    return {
        "dtype": "float32",
        "file_bytes": file_bytes,
        "loaders": summary,
        "runs": runs,
        "peak_ratio": ratio,
        "baseline_peak_ratio": summary["read-all"]["peak_ratio_median"],
        "target": TARGET_LOADER_PEAK_RATIO,
        "pass": ratio <= TARGET_LOADER_PEAK_RATIO,
    }


# -- reporting -----------------------------------------------------------------------------


def variant_suffix(
    quick: bool,
    threads: int | None,
    hf_batch_sizes: tuple[int, ...] | None = None,
    dtype: str = "float32",
) -> str:
    """File-name suffix of a non-default run, so it never overwrites the default results."""
    hf = f"-hf{'-'.join(map(str, hf_batch_sizes))}" if hf_batch_sizes else ""
    dt = "" if dtype == "float32" else f"-{dtype}"
    return ("-quick" if quick else "") + (f"-t{threads}" if threads else "") + hf + dt


def markdown(name: str, r: dict[str, Any]) -> str:
    if name == "throughput":
        lines = [
            "| system | wall (s) | output tokens/s | CPU util | tokens per CPU-s |",
            "|---|---:|---:|---:|---:|",
        ]
        systems = [("Tandem (continuous batching)", r["tandem"])]
        systems += [(f"HF generate bs{hf['batch_size']}", hf) for hf in r["hf"]]
        for label, run in systems:
            lines.append(
                f"| {label} | {run['wall_s']:.1f} | {run['tokens_per_s']:.1f} "
                f"| {run['cpu_util']:.2f} | {run['tokens_per_cpu_s']:.1f} |"
            )
        lines.append(
            f"\nTandem / best HF (bs{r['best_hf_batch_size']}): **{r['ratio_vs_best_hf']:.2f}x** "
            f"(target >= {r['target']:.0f}x: {verdict(r['pass'])}); per CPU-second: "
            f"{r['cpu_time_ratio_vs_best_hf']:.2f}x; "
            f"greedy tokens agree with HF: {r['correctness']['agree']}"
        )
        return "\n".join(lines)
    if name == "roofline":
        return "\n".join(
            [
                "| weights (MiB) | read bandwidth (GB/s) | roofline step (ms) "
                "| measured step, median (ms) | fraction | its matmuls alone (ms) "
                "| matmuls' fraction |",
                "|---:|---:|---:|---:|---:|---:|---:|",
                f"| {r['weight_bytes'] / MIB:.1f} | {r['bandwidth_bytes_per_s'] / 1e9:.2f} "
                f"| {r['roofline_step_s'] * 1e3:.2f} | {r['step_s_median'] * 1e3:.2f} "
                f"| **{r['fraction']:.2f}** ({verdict(r['pass'])}, target >= {r['target']}) "
                f"| {r['matmul_step_s_median'] * 1e3:.2f} | {r['matmul_fraction']:.2f} |",
            ]
        )
    if name == "loader":
        lines = [
            "| loader | peak RSS growth / weights | retained / weights | load time (s) |",
            "|---|---:|---:|---:|",
        ]
        for label, key in (("read all, then fuse (old)", "read-all"), ("streaming", "streaming")):
            lr = r["loaders"][key]
            lines.append(
                f"| {label} | {lr['peak_ratio_median']:.2f} | {lr['retained_ratio_median']:.2f} "
                f"| {lr['load_s_median']:.2f} |"
            )
        num_runs = len(r["runs"]["streaming"])
        weight_mib = r["loaders"]["streaming"]["weight_bytes"] / MIB
        lines.append(
            f"\nstreaming peak / weights: **{r['peak_ratio']:.2f}** (target <= {r['target']}: "
            f"{verdict(r['pass'])}); {weight_mib:.1f} MiB of {r['dtype']} weights, "
            f"median of {num_runs} fresh process(es) per loader"
        )
        return "\n".join(lines)
    lines = [
        "| trial | TTFT A (ms) | TTFT B (ms) | B cached tokens | B / A |",
        "|---:|---:|---:|---:|---:|",
    ]
    for i, t in enumerate(r["trials"]):
        lines.append(
            f"| {i} | {t['ttft_a_s'] * 1e3:.1f} | {t['ttft_b_s'] * 1e3:.1f} "
            f"| {t['b_cached_tokens']} | {t['ratio']:.3f} |"
        )
    lines.append(
        f"\nmedian B / A: **{r['ratio_median']:.3f}** "
        f"(target <= {r['target']}: {verdict(r['pass'])})"
    )
    return "\n".join(lines)


def summary(results: dict[str, dict[str, Any]]) -> str:
    lines = ["| figure | measured | target | result |", "|---|---:|---:|---|"]
    if "throughput" in results:
        r = results["throughput"]
        lines.append(
            f"| throughput, Tandem / best HF | {r['ratio_vs_best_hf']:.2f}x "
            f"| >= {r['target']:.0f}x | {verdict(r['pass'])} |"
        )
    if "roofline" in results:
        r = results["roofline"]
        lines.append(
            f"| batch-1 decode, roofline / step time | {r['fraction']:.2f} "
            f"| >= {r['target']} | {verdict(r['pass'])} |"
        )
    if "prefix" in results:
        r = results["prefix"]
        lines.append(
            f"| TTFT, cached prefix / uncached | {r['ratio_median']:.3f} "
            f"| <= {r['target']} | {verdict(r['pass'])} |"
        )
    if "loader" in results:
        r = results["loader"]
        lines.append(
            f"| loader, peak RSS growth / weight bytes | {r['peak_ratio']:.2f} "
            f"| <= {r['target']} | {verdict(r['pass'])} |"
        )
    return "\n".join(lines)


def bar_labels(ax: Any, bars: Any, fmt: str) -> None:
    # Headroom above the tallest bar (or dot), so its label stays clear of the title; bars
    # keep the axis pinned at zero below.
    ax.margins(y=0.12)
    for bar in bars:
        ax.annotate(
            fmt.format(bar.get_height()),
            (bar.get_x() + bar.get_width() / 2, bar.get_height()),
            ha="center",
            va="bottom",
            fontsize=9,
        )


def plot(results_dir: Path, suffix: str) -> Path | None:
    """One panel per benchmark, from the JSON files on disk, so a single-benchmark run keeps
    the others."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display on servers and CI
        import matplotlib.pyplot as plt
    except ImportError:
        log("plot: matplotlib is not installed (pip install -e '.[bench]'); skipping")
        return None
    data: dict[str, dict[str, Any]] = {}
    for name in BENCHMARKS:
        path = result_path(results_dir, name, suffix)
        if path.is_file():
            data[name] = json.loads(path.read_text())["results"]

    fig, axes = plt.subplots(1, len(BENCHMARKS), figsize=(5 * len(BENCHMARKS), 4.8))
    ax = axes[0]
    if "throughput" in data:
        r = data["throughput"]
        names = ["Tandem"] + [f"HF bs{h['batch_size']}" for h in r["hf"]]
        values = [r["tandem"]["tokens_per_s"]] + [h["tokens_per_s"] for h in r["hf"]]
        colors = ["tab:blue"] + ["tab:gray"] * len(r["hf"])
        bar_labels(ax, ax.bar(names, values, color=colors), "{:.0f}")
        n = r["workload"]["num_prompts"]
        ax.set_title(f"Throughput, {n} requests\nTandem / best HF = {r['ratio_vs_best_hf']:.2f}x")
        ax.set_ylabel("output tokens/s")
    ax = axes[1]
    if "roofline" in data:
        r = data["roofline"]
        labels = ["measured step\n(median)", "its matmuls\nalone", "read roofline"]
        values = [r["step_s_median"], r.get("matmul_step_s_median", 0.0), r["roofline_step_s"]]
        bars = ax.bar(labels, [v * 1e3 for v in values])
        for bar, color in zip(bars, ["tab:blue", "tab:cyan", "tab:gray"], strict=True):
            bar.set_color(color)
        bar_labels(ax, bars, "{:.2f} ms")
        ax.set_title(f"Batch-1 decode step\nroofline / measured = {r['fraction']:.2f}")
        ax.set_ylabel("ms per step")
    ax = axes[2]
    if "prefix" in data:
        r = data["prefix"]
        values = [r["ttft_a_s_median"] * 1e3, r["ttft_b_s_median"] * 1e3]
        bars = ax.bar(["A: prefix uncached", "B: prefix cached"], values)
        bars[0].set_color("tab:gray")
        bars[1].set_color("tab:blue")
        bar_labels(ax, bars, "{:.1f} ms")
        # Individual trials as dots: three is few enough that the spread matters.
        for x, key in ((0, "ttft_a_s"), (1, "ttft_b_s")):
            ys = [t[key] * 1e3 for t in r["trials"]]
            ax.scatter([x] * len(ys), ys, color="black", s=12, zorder=3)
        ax.set_title(
            f"TTFT, shared {r['prefix_len']}-token prefix\nmedian B / A = {r['ratio_median']:.3f}"
        )
        ax.set_ylabel("ms")
    ax = axes[3]
    if "loader" in data:
        r = data["loader"]
        values = [r["loaders"][k]["peak_ratio_median"] for k in ("read-all", "streaming")]
        bars = ax.bar(["read all,\nthen fuse (old)", "streaming"], values)
        bars[0].set_color("tab:gray")
        bars[1].set_color("tab:blue")
        bar_labels(ax, bars, "{:.2f}x")
        ax.axhline(r["target"], color="tab:red", linestyle="--", linewidth=1)
        ax.axhline(1.0, color="black", linewidth=0.5)
        ax.set_title(f"Loader peak RSS growth / weights\ntarget <= {r['target']} (dashed)")
        ax.set_ylabel("x weight bytes")
    for ax, name in zip(axes, BENCHMARKS, strict=True):
        if name not in data:
            ax.text(0.5, 0.5, f"{name}: not run", ha="center", va="center")
            ax.set_axis_off()
    threads = torch.get_num_threads()
    note = " (--quick: not meaningful)" if "quick" in suffix else ""
    fig.suptitle(f"Tandem engine on CPU, {threads} torch thread{'s' * (threads > 1)}{note}")
    fig.tight_layout()
    out = result_path(results_dir, "engine", suffix, "png")
    fig.savefig(out, dpi=110)
    plt.close(fig)
    log(f"plot: wrote {out}")
    return out


# -- main ----------------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("benchmark", nargs="?", default="all", choices=[*BENCHMARKS, "all"])
    parser.add_argument("--quick", action="store_true", help="tiny workloads (smoke test)")
    parser.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL_DIR)
    parser.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads for both systems (default: torch's)",
    )
    parser.add_argument(
        "--dtype",
        default="float32",
        help="Tandem's model dtype (float32 compares with HF token for token; auto is the "
        "default a user gets)",
    )
    parser.add_argument(
        "--hf-batch-sizes",
        type=lambda raw: tuple(int(x) for x in raw.split(",")),
        default=None,
        help="throughput: HF generate batch sizes, e.g. 16 (default: 16,64; 4,8 with --quick)",
    )
    args = parser.parse_args(argv)
    if args.threads is not None:
        if args.threads <= 0:
            parser.error("--threads must be positive")
        torch.set_num_threads(args.threads)
    if args.hf_batch_sizes is not None and min(args.hf_batch_sizes, default=0) <= 0:
        parser.error("--hf-batch-sizes must be positive integers")
    suffix = variant_suffix(args.quick, args.threads, args.hf_batch_sizes, args.dtype)

    sizes = QUICK if args.quick else FULL
    if args.hf_batch_sizes:
        sizes = replace(sizes, hf_batch_sizes=args.hf_batch_sizes)
    sizes = replace(sizes, dtype=args.dtype)
    model_dir = ensure_model(args.model_dir)
    names = BENCHMARKS if args.benchmark == "all" else (args.benchmark,)
    runners = {
        "throughput": bench_throughput,
        "roofline": bench_roofline,
        "prefix": bench_prefix,
        "loader": bench_loader,
    }
    results: dict[str, dict[str, Any]] = {}
    for name in names:
        log(f"== {name}{' (quick)' if args.quick else ''} ==")
        t0 = time.perf_counter()
        results[name] = runners[name](model_dir, sizes)
        path = result_path(args.results_dir, name, suffix)
        write_json(
            path,
            {
                "benchmark": name,
                "quick": args.quick,
                "command": " ".join(["python", "benchmarks/bench_engine.py", *sys.argv[1:]]),
                "machine": machine_info(**machine_extra()),
                "sizes": asdict(sizes),
                "model_dir": str(model_dir),
                "duration_s": time.perf_counter() - t0,
                "results": results[name],
            },
            indent=2,
        )
        log(f"{name}: wrote {path}")
    plot(args.results_dir, suffix)

    for name in names:
        print(f"### {name}{suffix}\n\n{markdown(name, results[name])}\n")
    if len(names) > 1:
        print(f"### summary\n\n{summary(results)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
