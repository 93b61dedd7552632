"""Part `kernels`: the Triton paged-attention kernels of `kernels/` on the device, in the
Llama-3-8B attention shape (32 q heads, 8 kv heads, head_dim 128, block_size 16, bf16).

1. Correctness first: `write_kv`, `paged_decode_attention` and `paged_prefill_attention`,
   once each, against `tandem.kernels.reference` on a small ragged case (a strided layer of a
   2-layer cache, every slot no request owns NaN), so a GPU-only bug shows as "failed", not
   as a fast wrong number. A kernel that fails is not timed.
2. Decode bandwidth: bytes of K/V read (context tokens x 2 x kv_heads x head_dim x itemsize,
   summed over the batch) / kernel time, against the device-to-device copy bandwidth (bytes
   read + written by a large `copy_`) measured in the same run; every batch x context, over
   random block tables into one layer's cache. Target: >= 0.8 of copy at batch >= 16 and
   context >= 4096.
3. Prefill over a cached prefix: causal FLOPs / kernel time against torch SDPA on the same
   tensors unpaged and contiguous (`sdpa_baseline` says which); each case's two outputs
   must agree. Target: >= 0.7x SDPA.

Times are medians of CUDA-event timings after warm-up, L2 flushed before each call. With
--cpu the same code runs its tiny cases under Triton's interpreter: a smoke run that keeps
the code alive; its times say nothing about speed. Triton is imported inside the part only.
"""

from __future__ import annotations

import contextlib
import functools
import os
import traceback
import warnings
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch

from .common import Context, Figures, PartFailed, copy_bandwidth, free_memory, median_time_s

DECODE_TARGET = 0.8  # K/V bytes read per second / copy bandwidth ...
DECODE_TARGET_MIN_BATCH, DECODE_TARGET_MIN_CONTEXT = 16, 4096  # ... where decode is big enough
PREFILL_TARGET = 0.7  # TFLOP/s / SDPA's
# (atol, rtol) against the float64 reference, as tests/kernels use.
TOLERANCES = {
    torch.float32: (1e-5, 1e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
}
MIN_CASE_S = 10.0  # a benchmark case starts only with this much of the part's budget left
SMOKE = "smoke: CPU tensors under Triton's interpreter; the times are not performance figures"


def use_interpreter() -> None:
    """Run the kernels on CPU tensors through Triton's interpreter. Triton decides when a
    kernel is defined (`@triton.jit`, on import of `kernels.*`), so this must come before
    that import; `cli.main` calls it first thing in --cpu mode."""
    os.environ.setdefault("TRITON_INTERPRET", "1")


class Shape(NamedTuple):
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    @property
    def scale(self) -> float:
        return self.head_dim**-0.5

    def kv_bytes(self, num_tokens: int) -> int:
        """K and V of `num_tokens` tokens (one layer)."""
        return num_tokens * 2 * self.num_kv_heads * self.head_dim * self.dtype.itemsize


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def sig(x: float) -> float:
    """4 significant digits (a smoke run's rates are tiny, a GPU's are in the thousands)."""
    return float(f"{x:.4g}")


def random_tables(num_rows: int, num_cols: int, num_blocks: int, device: str) -> torch.Tensor:
    """[num_rows, num_cols] int32 of distinct block ids drawn at random from num_blocks."""
    ids = torch.randperm(num_blocks, device=device)[: num_rows * num_cols]
    return ids.view(num_rows, num_cols).to(torch.int32)


def poisoned_case(
    shape: Shape, context_lens: Sequence[int], device: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """(kv_layer, block_tables) for a ragged batch: layer 1 of a 2-layer cache (strided, as
    the engine passes `kv_cache[:, layer]`), each request's tokens random in shuffled blocks,
    every other slot NaN: padded table entries name block 0 and the tail of each request's
    last block is NaN, so a kernel that reads either returns NaN."""
    s = shape
    max_blocks = max(cdiv(n, s.block_size) for n in context_lens) + 1  # >= 1 padded entry
    num_blocks = sum(cdiv(n, s.block_size) for n in context_lens) + 2
    dims = (s.block_size, s.num_kv_heads, s.head_dim)
    kv_layer = torch.full((num_blocks, 2, 2, *dims), float("nan"), dtype=s.dtype, device=device)
    kv_layer = kv_layer[:, 1]
    ids = (torch.randperm(num_blocks - 1) + 1).tolist()  # block 0 stays NaN
    tables = torch.zeros(len(context_lens), max_blocks, dtype=torch.int32)
    for r, n in enumerate(context_lens):
        blocks = [ids.pop() for _ in range(cdiv(n, s.block_size))]
        tables[r, : len(blocks)] = torch.tensor(blocks)
        for i, block in enumerate(blocks):
            used = min(s.block_size, n - i * s.block_size)
            kv_layer[block, :, :used] = torch.randn(2, used, *dims[1:], device=device).to(s.dtype)
    return kv_layer, tables.to(device)


def compare(out: torch.Tensor, expected: torch.Tensor, atol: float, rtol: float) -> Figures:
    """passed, max |difference| (NaN if either has one), first line of the mismatch."""
    diff = (out.double() - expected.double()).abs()
    record: Figures = {"passed": True, "max_abs_diff": float(diff.max()), "error": None}
    try:
        torch.testing.assert_close(out, expected, atol=atol, rtol=rtol)
    except AssertionError as exc:
        record.update(passed=False, error=" ".join(str(exc).split())[:300])
    return record


# -- 1. correctness -------------------------------------------------------------------------


def check_write_kv(shape: Shape, device: str, num_tokens: int = 37) -> Figures:
    from tandem.kernels.kv_write import write_kv
    from tandem.kernels.reference import write_kv_reference

    s = shape
    num_blocks = cdiv(num_tokens, s.block_size) + 4
    cache = torch.zeros(
        num_blocks, 2, 2, s.block_size, s.num_kv_heads, s.head_dim, dtype=s.dtype, device=device
    )
    expected = cache.clone()
    k = torch.randn(num_tokens, s.num_kv_heads, s.head_dim, device=device).to(s.dtype)
    v = torch.randn_like(k)  # k, v: [num_tokens, num_kv_heads, head_dim]
    slots = torch.randperm(num_blocks * s.block_size, device=device)[:num_tokens]
    block_ids, offsets = slots // s.block_size, slots % s.block_size
    write_kv(k, v, cache[:, 1], block_ids, offsets)
    write_kv_reference(k, v, expected[:, 1], block_ids, offsets)
    return compare(cache, expected, atol=0.0, rtol=0.0)


def fp8_layer(kv_layer: torch.Tensor, k_scale: float, v_scale: float) -> torch.Tensor:
    """`kv_layer` (a layer view of a 2-layer cache) quantized into layer 1 of a new e4m3
    cache with the scales (`quantize_kv_reference`): the strided view the engine hands the
    kernels. NaN slots stay NaN. Written through uint8 views (plain byte copies)."""
    from tandem.kernels.reference import quantize_kv_reference

    num_blocks, _, block_size, heads, dim = kv_layer.shape
    shape = (num_blocks, 2, 2, block_size, heads, dim)
    cache = torch.zeros(shape, dtype=torch.uint8, device=kv_layer.device)
    for i, scale in ((0, k_scale), (1, v_scale)):
        cache[:, 1, i] = quantize_kv_reference(kv_layer[:, i], scale).view(torch.uint8)
    return cache.view(torch.float8_e4m3fn)[:, 1]


def kernel_cache(
    kv_layer: torch.Tensor, kv_scales: tuple[float, float] | None
) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """(the cache the kernel reads, the values the reference reads, the kernel's scale
    arguments): `kv_layer` itself, or with `kv_scales` its e4m3 copy and that dequantized."""
    if kv_scales is None:
        return kv_layer, kv_layer, {}
    from tandem.kernels.reference import dequantize_kv_reference

    kv8 = fp8_layer(kv_layer, *kv_scales)
    values = dequantize_kv_reference(kv8, *kv_scales)  # float32, what the kernel reads
    return kv8, values, {"k_scale": kv_scales[0], "v_scale": kv_scales[1]}


def check_decode(
    shape: Shape,
    context_lens: Sequence[int],
    device: str,
    kv_scales: tuple[float, float] | None = None,
) -> Figures:
    """kv_scales: an e4m3 cache with these (K, V) scales."""
    from tandem.kernels.decode_attention import paged_decode_attention
    from tandem.kernels.reference import paged_attention

    s = shape
    kv_layer, tables = poisoned_case(s, context_lens, device)
    cache, values, scales = kernel_cache(kv_layer, kv_scales)
    q = torch.randn(len(context_lens), s.num_q_heads, s.head_dim, device=device).to(s.dtype)
    lens = torch.tensor(context_lens, dtype=torch.int32, device=device)
    out = paged_decode_attention(q, cache, tables, lens, s.scale, **scales)
    expected = torch.cat(
        [
            paged_attention(q[r : r + 1], values, tables[r].tolist(), n, s.scale)
            for r, n in enumerate(context_lens)
        ]
    )
    return compare(out, expected, *TOLERANCES[s.dtype])


def check_prefill(
    shape: Shape,
    chunks: Sequence[tuple[int, int]],
    device: str,
    kv_scales: tuple[float, float] | None = None,
) -> Figures:
    """chunks: (new tokens, context including them) per request; kv_scales as decode's."""
    from tandem.kernels.prefill_attention import paged_prefill_attention
    from tandem.kernels.reference import paged_attention

    s = shape
    news = [n for n, _ in chunks]
    contexts = [c for _, c in chunks]
    kv_layer, tables = poisoned_case(s, contexts, device)
    cache, values, scales = kernel_cache(kv_layer, kv_scales)
    q = torch.randn(sum(news), s.num_q_heads, s.head_dim, device=device).to(s.dtype)
    starts = [0, *torch.tensor(news).cumsum(0).tolist()]
    out = paged_prefill_attention(
        q,
        cache,
        tables,
        torch.tensor(starts, dtype=torch.int32, device=device),
        torch.tensor(contexts, dtype=torch.int32, device=device),
        max(news),
        s.scale,
        **scales,
    )
    expected = torch.cat(
        [
            paged_attention(q[starts[r] : starts[r + 1]], values, tables[r].tolist(), c, s.scale)
            for r, c in enumerate(contexts)
        ]
    )
    return compare(out, expected, *TOLERANCES[s.dtype])


# -- 2. decode bandwidth --------------------------------------------------------------------


def time_decode(
    ctx: Context,
    shape: Shape,
    kv_layer: torch.Tensor,
    table_width: int,
    batch: int,
    context: int,
    copy_gb_s: float,
    flush: torch.Tensor | None,
    kv_scales: tuple[float, float] | None = None,
) -> Figures:
    """One decode case at the full context over random block tables `table_width` blocks
    wide (the serving table's): time, K/V bytes read per second and that over copy
    bandwidth. `kv_scales`: an e4m3 cache (half the bytes of a 16-bit one)."""
    from tandem.kernels.decode_attention import (
        choose_num_splits,
        device_num_sms,
        paged_decode_attention,
    )

    sz, s, dev = ctx.sizes, shape, ctx.device
    num_sms = device_num_sms(torch.device(dev))
    tables = random_tables(batch, table_width, kv_layer.shape[0], dev)
    lens = torch.full((batch,), context, dtype=torch.int32, device=dev)
    q = torch.randn(batch, s.num_q_heads, s.head_dim, device=dev).to(s.dtype)
    splits = choose_num_splits(batch, s.num_kv_heads, cdiv(context, s.block_size), num_sms)
    k_scale, v_scale = kv_scales or (1.0, 1.0)
    run = functools.partial(
        paged_decode_attention, q, kv_layer, tables, lens, s.scale,
        num_splits=splits, out=torch.empty_like(q), k_scale=k_scale, v_scale=v_scale,
    )  # fmt: skip
    seconds = median_time_s(run, dev, reps=sz.kn_reps, warmup=3, flush=flush)
    kv_bytes = s.kv_bytes(batch * context) // (2 if kv_scales else 1)
    gb_s = kv_bytes / seconds / 1e9
    return {
        "batch": batch,
        "context": context,
        "kv_dtype": "fp8" if kv_scales else str(s.dtype).removeprefix("torch."),
        "num_splits": splits,
        "table_width": table_width,
        "kv_bytes": kv_bytes,
        "time_us": round(seconds * 1e6, 1),
        "gb_s": sig(gb_s),
        "ratio_vs_copy": round(gb_s / copy_gb_s, 3),
        "target_applies": batch >= DECODE_TARGET_MIN_BATCH and context >= DECODE_TARGET_MIN_CONTEXT,
    }


def bench_decode(
    ctx: Context, shape: Shape, copy_gb_s: float, flush: torch.Tensor | None
) -> Figures:
    """Every batch x context of the sizes, each request at the full context, over random
    block tables into one layer's cache sized for the largest case; then the FP8 KV cases
    (`kn_decode_fp8_cases`) over an e4m3 cache. As in serving: the tables are as wide as
    the longest context the engine allows (its persistent block table, here the largest
    context of the sizes), and the split count is the engine's choice for the step's
    longest context on this device, not one derived from the table width."""
    sz, s, dev = ctx.sizes, shape, ctx.device
    table_width = cdiv(max(sz.kn_decode_contexts), s.block_size)
    cases: list[Figures] = []
    for fp8 in (False, True):
        grid = (
            list(sz.kn_decode_fp8_cases)
            if fp8
            else [(b, c) for b in sz.kn_decode_batches for c in sz.kn_decode_contexts]
        )
        num_blocks = max(b for b, _ in grid) * table_width
        # kv_layer: [num_blocks, 2, block_size, num_kv_heads, head_dim], one layer
        dims = (num_blocks, 2, s.block_size, s.num_kv_heads, s.head_dim)
        kv_layer = torch.empty(dims, dtype=s.dtype, device=dev).normal_()
        if fp8:
            kv_layer = kv_layer.to(torch.float8_e4m3fn)
        ctx.log(f"kernels: decode cache {num_blocks} blocks, {kv_layer.nbytes / 2**30:.2f} GiB")
        for batch, context in grid:
            if ctx.left_s() < MIN_CASE_S:
                cases.append({"batch": batch, "context": context, "fp8_kv": fp8,
                              "skipped": "out of the part's time budget"})  # fmt: skip
                continue
            scales = (0.5, 0.25) if fp8 else None
            case = time_decode(
                ctx, s, kv_layer, table_width, batch, context, copy_gb_s, flush, scales
            )
            cases.append(case)
            ctx.log(
                f"kernels: decode {case['kv_dtype']} batch {batch:3d} x context {context:5d}: "
                f"{case['time_us']:9.1f} us, {case['gb_s']:8.4g} GB/s = "
                f"{case['ratio_vs_copy']:.2f} x copy"
            )
        del kv_layer
        free_memory(dev)
    judged = [c["ratio_vs_copy"] for c in cases if c.get("target_applies")]
    return {
        "cases": cases,
        "target": {
            "ratio_vs_copy": DECODE_TARGET,
            "applies_to": f"batch >= {DECODE_TARGET_MIN_BATCH} and context >= "
            f"{DECODE_TARGET_MIN_CONTEXT}",
            "worst": min(judged) if judged else None,
            "met": min(judged) >= DECODE_TARGET if judged else None,
        },
    }


# -- 3. prefill over a cached prefix --------------------------------------------------------


def causal_flops(batch: int, chunk: int, prefix: int, shape: Shape) -> int:
    """FLOPs of causal attention of `chunk` new tokens over `prefix` cached ones: query j of
    the chunk sees prefix + j + 1 keys, and each (query, key, q head) costs 2 x head_dim for
    QK^T and 2 x head_dim for PV. Summed: chunk x prefix + chunk (chunk + 1) / 2 visible
    (query, key) pairs per request."""
    visible = chunk * prefix + chunk * (chunk + 1) // 2
    return 4 * shape.head_dim * shape.num_q_heads * batch * visible


def _sdpa(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: Any,
    scale: float,
    backends: list[Any] | None,
    gqa: bool,
) -> torch.Tensor:
    """SDPA over [batch, heads, tokens, head_dim]; causal (top-left) when mask is None."""
    from torch.nn.attention import sdpa_kernel

    with sdpa_kernel(backends) if backends else contextlib.nullcontext():
        return torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=gqa
        )


class Baseline(NamedTuple):
    name: str | None  # which SDPA variant; None when none ran and agreed
    run: Callable[[], torch.Tensor] | None
    agreement: Figures  # compare() of its output with the paged kernel's
    rejected: list[str]  # variants tried before it, and why


def sdpa_baseline(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    prefix: int,
    shape: Shape,
    device: str,
    kernel_out: torch.Tensor,
) -> Baseline:
    """torch SDPA on unpaged contiguous tensors: the same attention as the paged kernel.

    q: [batch, chunk, q_heads, head_dim]; k, v: [batch, prefix + chunk, kv_heads, head_dim];
    kernel_out: the paged kernel's output, [batch, chunk, q_heads, head_dim]. SDPA gets
    [batch, heads, tokens, head_dim] views (flash attention's own layout: no copy).

    The mask: with no prefix, `is_causal=True`. Over a prefix, query j (position prefix + j)
    sees keys 0 .. prefix + j, the causal diagonal aligned bottom-right; SDPA's `is_causal`
    aligns it top-left (wrong when chunk < context), so `causal_lower_right(chunk, context)`,
    which SDPA runs in the flash kernel as its bottom-right causal mask: the same tile
    skipping and the same FLOPs as the paged kernel, no materialised mask.

    On CUDA the baseline is the first variant that runs and agrees with the kernel (within
    twice the dtype's tolerance): flash with GQA (`enable_gqa`); flash with K/V repeated to
    the q heads (outside the timing); any SDPA backend with K/V repeated. On a CPU: the
    default backend. None agreeing means the kernel is wrong at this size (it passed the
    small check) or no baseline computes the same thing: either way the part fails.
    """
    from torch.nn.attention import SDPBackend
    from torch.nn.attention.bias import causal_lower_right

    chunk, context = q.shape[1], k.shape[1]
    group = shape.num_q_heads // shape.num_kv_heads
    atol, rtol = TOLERANCES[shape.dtype]
    mask = None if prefix == 0 else causal_lower_right(chunk, context)
    flash = [SDPBackend.FLASH_ATTENTION]
    variants: list[tuple[str, list[SDPBackend] | None, bool]] = (
        [
            ("flash, GQA (enable_gqa)", flash, False),
            ("flash, K/V repeated to the q heads", flash, True),
            ("any SDPA backend, K/V repeated to the q heads", None, True),
        ]
        if device.startswith("cuda")
        else [("default SDPA backend (CPU), GQA (enable_gqa)", None, False)]
    )
    rejected: list[str] = []
    agreement: Figures = {}
    for name, backends, repeat in variants:
        kk, vv = (
            (k.repeat_interleave(group, 2), v.repeat_interleave(group, 2)) if repeat else (k, v)
        )
        run = functools.partial(
            _sdpa, q.transpose(1, 2), kk.transpose(1, 2), vv.transpose(1, 2), mask, shape.scale,
            backends, gqa=not repeat,
        )  # fmt: skip
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # "flash attention was not used because ..."
                out = run()
        except RuntimeError as exc:
            rejected.append(f"{name}: {' '.join(str(exc).split())[:200]}")
            continue
        agreement = compare(kernel_out, out.transpose(1, 2), 2 * atol, 2 * rtol)
        if agreement["passed"]:
            return Baseline(name, run, agreement, rejected)
        rejected.append(f"{name}: disagrees, max |diff| {agreement['max_abs_diff']:.3g}")
    return Baseline(None, None, agreement or {"passed": False}, rejected)


def bench_prefill(ctx: Context, shape: Shape, flush: torch.Tensor | None) -> Figures:
    from tandem.kernels.prefill_attention import paged_prefill_attention

    sz, s, dev = ctx.sizes, shape, ctx.device
    num_blocks = max(b * cdiv(p + n, s.block_size) for b, n, p in sz.kn_prefill_cases)
    kv_layer = torch.zeros(
        num_blocks, 2, s.block_size, s.num_kv_heads, s.head_dim, dtype=s.dtype, device=dev
    )
    atol, rtol = TOLERANCES[s.dtype]
    cases: list[Figures] = []
    for batch, chunk, prefix in sz.kn_prefill_cases:
        case: Figures = {"batch": batch, "chunk": chunk, "prefix": prefix}
        cases.append(case)
        if ctx.left_s() < MIN_CASE_S:
            case["skipped"] = "out of the part's time budget"
            continue
        context = prefix + chunk
        width = cdiv(context, s.block_size)
        # k, v: [batch, context, kv_heads, head_dim], copied into the paged cache block by
        # block through random tables (zero-padded to whole blocks).
        k = torch.randn(batch, context, s.num_kv_heads, s.head_dim, device=dev).to(s.dtype)
        v = torch.randn_like(k)
        tables = random_tables(batch, width, num_blocks, dev)
        for i, t in enumerate((k, v)):
            padded = torch.zeros(
                batch, width * s.block_size, *t.shape[2:], dtype=s.dtype, device=dev
            )
            padded[:, :context] = t
            kv_layer[tables.flatten().long(), i] = padded.view(-1, s.block_size, *t.shape[2:])
        # q: [batch, chunk, q_heads, head_dim]; the kernel reads it as [batch * chunk, ...]
        q = torch.randn(batch, chunk, s.num_q_heads, s.head_dim, device=dev).to(s.dtype)
        q_flat = q.view(batch * chunk, s.num_q_heads, s.head_dim)
        starts = torch.arange(batch + 1, dtype=torch.int32, device=dev) * chunk
        lens = torch.full((batch,), context, dtype=torch.int32, device=dev)
        out = torch.empty_like(q_flat)
        run = functools.partial(
            paged_prefill_attention, q_flat, kv_layer, tables, starts, lens, chunk, s.scale, out=out
        )
        seconds = median_time_s(run, dev, reps=sz.kn_reps, warmup=2, flush=flush)
        flops = causal_flops(batch, chunk, prefix, s)
        case.update(
            flops=flops, time_ms=round(seconds * 1e3, 3), tflop_s=sig(flops / seconds / 1e12)
        )  # fmt: skip
        baseline = sdpa_baseline(q, k, v, prefix, s, dev, out.view_as(q))
        case.update(
            sdpa_baseline=baseline.name,
            agrees_with_sdpa=baseline.agreement["passed"],
            max_abs_diff_vs_sdpa=baseline.agreement.get("max_abs_diff"),
            sdpa_rejected=baseline.rejected,
        )
        if baseline.run is not None:
            sdpa_s = median_time_s(baseline.run, dev, reps=sz.kn_reps, warmup=2, flush=flush)
            case.update(
                sdpa_time_ms=round(sdpa_s * 1e3, 3),
                sdpa_tflop_s=sig(flops / sdpa_s / 1e12),
                ratio_vs_sdpa=round(sdpa_s / seconds, 3),
            )
            ctx.log(
                f"kernels: prefill batch {batch} chunk {chunk} prefix {prefix:5d}: "
                f"{case['tflop_s']:.4g} TFLOP/s vs SDPA {case['sdpa_tflop_s']:.4g} "
                f"({baseline.name}) = {case['ratio_vs_sdpa']:.2f} x"
            )
        else:
            ctx.log(f"kernels: prefill {case}: no SDPA baseline agrees: {baseline.rejected}")
        del k, v, q, q_flat, out, run, baseline
    ratios = [c["ratio_vs_sdpa"] for c in cases if "ratio_vs_sdpa" in c]
    return {
        "cases": cases,
        "flops": "4 x head_dim x q_heads x visible (query, key) pairs, causal",
        "target": {
            "ratio_vs_sdpa": PREFILL_TARGET,
            "worst": min(ratios) if ratios else None,
            "met": min(ratios) >= PREFILL_TARGET if ratios else None,
        },
    }


# -- the part -------------------------------------------------------------------------------


def check_kernels(ctx: Context) -> Figures:
    sz, dev = ctx.sizes, ctx.device
    if not ctx.cuda:
        use_interpreter()
    from tandem.kernels import decode_attention, kv_write, prefill_attention
    from tandem.weights.loader import DTYPES

    jitted = [kv_write._write_kv_kernel, decode_attention._decode_split_kernel]
    jitted.append(prefill_attention._prefill_kernel)
    if not ctx.cuda and not all(type(k).__name__ == "InterpretedFunction" for k in jitted):
        raise PartFailed(
            "the kernels were defined before TRITON_INTERPRET=1 was set, so they cannot run on "
            "CPU tensors: something imported kernels.* before this part",
            {},
        )
    shape = Shape(
        sz.kn_num_q_heads, sz.kn_num_kv_heads, sz.kn_head_dim, sz.kn_block_size, DTYPES[sz.kn_dtype]
    )
    figures: Figures = {
        "mode": "benchmark" if ctx.cuda else SMOKE,
        "shape": {**shape._asdict(), "dtype": sz.kn_dtype},
    }
    torch.manual_seed(0)
    checks: dict[str, Callable[[], Figures]] = {
        "write_kv": lambda: check_write_kv(shape, dev),
        "decode": lambda: check_decode(shape, sz.kn_check_context_lens, dev),
        "prefill": lambda: check_prefill(shape, sz.kn_check_chunks, dev),
    }
    correctness: dict[str, Figures] = {}
    for name, check in checks.items():
        try:
            correctness[name] = record = check()
        except Exception as exc:  # a launch or compile error on this device: not timed either
            ctx.log(traceback.format_exc().rstrip())
            correctness[name] = record = {"passed": False, "error": f"{type(exc).__name__}: {exc}"}
        diff = record.get("max_abs_diff")
        ctx.log(
            f"kernels: {name} vs tandem.kernels.reference: {'ok' if record['passed'] else 'WRONG'}"
            + (f", max |diff| {diff:.3g}" if diff is not None else f": {record['error']}")
        )
    figures["correctness"] = correctness

    figures["copy"] = copy_bandwidth(dev, sz.kn_copy_bytes, reps=sz.kn_reps)
    copy_gb_s = figures["copy"]["gb_s"]
    ctx.log(f"kernels: device copy {copy_gb_s} GB/s (read + written)")
    flush = (
        torch.empty(sz.kn_flush_bytes, dtype=torch.uint8, device=dev) if sz.kn_flush_bytes else None
    )
    if correctness["decode"]["passed"]:
        figures["decode"] = bench_decode(ctx, shape, copy_gb_s, flush)
        free_memory(dev)  # the decode cache (16 GiB on CUDA)
    if correctness["prefill"]["passed"]:
        figures["prefill"] = bench_prefill(ctx, shape, flush)
        free_memory(dev)
        # torch >= 2.9 can swap its flash implementation (FA2 by default, FA3 if registered).
        from torch.nn import attention

        impl = getattr(attention, "current_flash_attention_impl", None)
        figures["prefill"]["torch_flash_impl"] = impl() if impl else None
    del flush

    wrong = [name for name, record in correctness.items() if not record["passed"]]
    disagree = [
        f"prefill {c['batch']}x{c['chunk']}+{c['prefix']}"
        for c in figures.get("prefill", {}).get("cases", [])
        if c.get("agrees_with_sdpa") is False
    ]
    if wrong or disagree:
        raise PartFailed(
            f"wrong results on {dev}: "
            + ", ".join(
                [*(f"{n} vs reference" for n in wrong), *(f"{d} vs SDPA" for d in disagree)]
            ),
            figures,
        )
    for part, key in (("decode", "ratio_vs_copy"), ("prefill", "ratio_vs_sdpa")):
        target = figures.get(part, {}).get("target")
        if target is None:
            continue
        if not ctx.cuda:
            target.update(met=None, note="not judged: a smoke run")
        ctx.log(
            f"kernels: {part} target {key} >= {target[key]}: worst {target['worst']}, "
            f"met {target['met']}"
        )
    return figures
