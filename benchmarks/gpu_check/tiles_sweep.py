"""Part `tiles`: the attention kernels' launch configurations, measured on the device.

`tandem.kernels.decode_attention.decode_tiles` and `tandem.kernels.prefill_attention.tiles_for`
choose
tile sizes, pipeline stages and warps that were picked without a GPU (they compile for
sm_90a without spills: tests/kernels). The first H200 run measured the decode kernel at
~0.26 x the device copy bandwidth and the prefill kernel at ~0.2-0.3 x torch SDPA (flash),
far from their targets (0.8 and 0.7). This part times a grid of candidate configurations on
the kernels part's representative cases, each candidate first checked against
`tandem.kernels.reference` on the kernels part's ragged poisoned case (a candidate that fails to
compile, runs out of shared memory or is wrong is recorded, not timed), so the defaults can
be set from figures. It changes no default itself.

Cases (CUDA sizes): decode batch 64 x context 4096 and batch 1 x context 4096 (the
latency case); prefill batch 1, a 2048-token chunk over a 6144-token prefix. On `--cpu`
(Triton's interpreter) two candidates of each on tiny cases, to keep the code path run.
"""

from __future__ import annotations

import functools
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from .common import Context, Figures, PartFailed, copy_bandwidth, free_memory, median_time_s
from .kernels_bench import (
    MIN_CASE_S,
    Shape,
    causal_flops,
    cdiv,
    check_decode,
    check_prefill,
    random_tables,
    sig,
    use_interpreter,
)


@contextmanager
def patched(module: Any, name: str, choice: Any) -> Iterator[None]:
    """`module.name` returns `choice` whatever it is asked, for the block's duration."""
    saved = getattr(module, name)
    setattr(module, name, lambda *args, **kwargs: choice)
    try:
        yield
    finally:
        setattr(module, name, saved)


def decode_candidates(cuda: bool) -> list[Any]:
    from tandem.kernels.decode_attention import DecodeTiles

    if not cuda:
        return [DecodeTiles(1, 1, 4), DecodeTiles(2, 2, 4)]
    # The default first (the baseline of `best`), then the grid around it. The H200 sweeps
    # (benchmarks/results/gpu/run2, run3) set the default to 2 blocks, 3 stages, 2 warps.
    grid = [(2, 3, 2)]
    grid += [
        (tile_blocks, stages, warps)
        for tile_blocks in (1, 2, 4)
        for stages in (3, 5)
        for warps in (1, 2, 4)
        if (tile_blocks, stages, warps) != (2, 3, 2)
    ]
    return [DecodeTiles(*g) for g in grid]


def prefill_candidates(cuda: bool, group: int) -> list[Any]:
    import triton

    from tandem.kernels.prefill_attention import Tiles

    group_pad = triton.next_power_of_2(group)
    if not cuda:
        return [Tiles(16 // group_pad or 1, group_pad, 16, 4, 1)]
    # The default first: 128 x 128, 8 warps, 3 stages since the first H200 sweep
    # (benchmarks/results/gpu/run2, which tried 64-128 rows x 32-128 keys); then around it.
    grid = [(128, 128, 8, 3)]
    grid += [
        (rows, block_n, warps, stages)
        for rows, block_n, warps, stages in (
            (128, 128, 8, 2),
            (128, 128, 8, 4),
            (128, 64, 8, 4),
            (128, 128, 4, 3),
            (64, 128, 4, 3),
            (64, 128, 8, 3),
            (128, 256, 8, 2),
        )
    ]
    return [Tiles(max(rows // group_pad, 1), group_pad, n, w, st) for rows, n, w, st in grid]


def _try(ctx: Context, fn: Callable[[], Figures]) -> Figures:
    try:
        return fn()
    except Exception as exc:  # a compile error, shared memory exceeded: that candidate only
        ctx.log(traceback.format_exc().rstrip().splitlines()[-1])
        error = f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}"
        return {"passed": False, "raised": True, "error": error}


def _sweep(
    ctx: Context,
    kind: str,
    module: Any,
    chooser: str,
    candidates: list[Any],
    default: Any,
    check: Callable[[], Figures],
    measure: Callable[[Figures], None],
) -> list[Figures]:
    """Each candidate: `module.chooser` made to return it, `check` (against the reference),
    then `measure(record)` if it passed; a record per candidate, in order."""
    results = []
    for tiles in candidates:
        record: Figures = {"tiles": tiles._asdict(), "default": tiles == default}
        results.append(record)
        if ctx.left_s() < MIN_CASE_S:
            record["skipped"] = "out of the part's time budget"
            continue
        with patched(module, chooser, tiles):
            result = _try(ctx, check)
            record.update(correct=result["passed"], raised=result.get("raised", False))
            if not result["passed"]:
                record["error"] = result.get("error")
                continue
            measure(record)
        ctx.log(f"tiles: {kind} {tuple(tiles)}: {_summary(record)}")
    return results


def sweep_decode(ctx: Context, shape: Shape, copy_gb_s: float) -> Figures:
    from tandem.kernels import decode_attention

    sz, s, dev = ctx.sizes, shape, ctx.device
    contexts = (max(sz.kn_decode_contexts[:2]),)
    batches = (1, max(b for b in sz.kn_decode_batches if b <= 64))
    width = cdiv(max(contexts), s.block_size)
    num_blocks = max(batches) * width
    kv_layer = torch.empty(
        num_blocks, 2, s.block_size, s.num_kv_heads, s.head_dim, dtype=s.dtype, device=dev
    ).normal_()
    num_sms = decode_attention.device_num_sms(torch.device(dev))
    cases = []
    for batch in batches:
        for context in contexts:
            tables = random_tables(batch, width, num_blocks, dev)
            lens = torch.full((batch,), context, dtype=torch.int32, device=dev)
            q = torch.randn(batch, s.num_q_heads, s.head_dim, device=dev).to(s.dtype)
            splits = decode_attention.choose_num_splits(
                batch, s.num_kv_heads, cdiv(context, s.block_size), num_sms
            )
            run = functools.partial(
                decode_attention.paged_decode_attention, q, kv_layer, tables, lens, s.scale,
                num_splits=splits, out=torch.empty_like(q),
            )  # fmt: skip
            cases.append((batch, context, splits, run))
    default = decode_attention.decode_tiles(s.dtype, s.head_dim, s.block_size, True)

    def measure(record: Figures) -> None:
        for batch, context, splits, run in cases:
            seconds = median_time_s(run, dev, reps=sz.kn_reps, warmup=3)
            gb_s = s.kv_bytes(batch * context) / seconds / 1e9
            record[f"b{batch}_c{context}"] = {
                "splits": splits,
                "time_us": round(seconds * 1e6, 1),
                "gb_s": sig(gb_s),
                "ratio_vs_copy": round(gb_s / copy_gb_s, 3),
            }

    results = _sweep(
        ctx, "decode", decode_attention, "decode_tiles", decode_candidates(ctx.cuda), default,
        lambda: check_decode(s, sz.kn_check_context_lens, dev), measure,
    )  # fmt: skip
    del kv_layer
    free_memory(dev)
    return {"candidates": results, "best": _best(results, f"b{batches[-1]}_c{contexts[0]}")}


def sweep_prefill(ctx: Context, shape: Shape) -> Figures:
    from tandem.kernels import prefill_attention

    sz, s, dev = ctx.sizes, shape, ctx.device
    batch, chunk, prefix = next(
        (c for c in sz.kn_prefill_cases if c[0] == 1 and c[2] > 0), sz.kn_prefill_cases[-1]
    )
    context = prefix + chunk
    width = cdiv(context, s.block_size)
    kv_layer = torch.empty(
        batch * width, 2, s.block_size, s.num_kv_heads, s.head_dim, dtype=s.dtype, device=dev
    ).normal_()
    tables = random_tables(batch, width, batch * width, dev)
    q = torch.randn(batch * chunk, s.num_q_heads, s.head_dim, device=dev).to(s.dtype)
    starts = torch.arange(batch + 1, dtype=torch.int32, device=dev) * chunk
    lens = torch.full((batch,), context, dtype=torch.int32, device=dev)
    run = functools.partial(
        prefill_attention.paged_prefill_attention, q, kv_layer, tables, starts, lens, chunk,
        s.scale, out=torch.empty_like(q),
    )  # fmt: skip
    flops = causal_flops(batch, chunk, prefix, s)
    group = s.num_q_heads // s.num_kv_heads
    default = prefill_attention.tiles_for(s.dtype, s.head_dim, group)
    key = f"b{batch}_n{chunk}_p{prefix}"

    def measure(record: Figures) -> None:
        seconds = median_time_s(run, dev, reps=sz.kn_reps, warmup=2)
        record[key] = {"time_ms": round(seconds * 1e3, 3), "tflop_s": sig(flops / seconds / 1e12)}

    results = _sweep(
        ctx, "prefill", prefill_attention, "tiles_for", prefill_candidates(ctx.cuda, group),
        default, lambda: check_prefill(s, sz.kn_check_chunks, dev), measure,
    )  # fmt: skip
    del kv_layer
    free_memory(dev)
    return {"case": key, "candidates": results, "best": _best(results, key)}


def _summary(record: Figures) -> str:
    if not record.get("correct", True):
        return f"WRONG or failed: {record.get('error')}"
    parts = [
        f"{k} {v.get('time_us', v.get('time_ms'))}{' us' if 'time_us' in v else ' ms'}"
        + (
            f" ({v['ratio_vs_copy']} x copy)"
            if "ratio_vs_copy" in v
            else f" ({v['tflop_s']} TFLOP/s)"
        )
        for k, v in record.items()
        if isinstance(v, dict) and k != "tiles"
    ]
    return ", ".join(parts)


def _best(results: list[Figures], key: str) -> Figures | None:
    timed = [r for r in results if isinstance(r.get(key), dict)]
    if not timed:
        return None
    field = "time_us" if "time_us" in timed[0][key] else "time_ms"
    best = min(timed, key=lambda r: r[key][field])
    default = next((r for r in timed if r["default"]), None)
    return {
        "tiles": best["tiles"],
        "case": key,
        field: best[key][field],
        "default_" + field: default[key][field] if default else None,
        "speedup_vs_default": round(default[key][field] / best[key][field], 3) if default else None,
    }


def check_tiles(ctx: Context) -> Figures:
    sz, dev = ctx.sizes, ctx.device
    if not ctx.cuda:
        use_interpreter()
    from tandem.weights.loader import DTYPES

    shape = Shape(
        sz.kn_num_q_heads, sz.kn_num_kv_heads, sz.kn_head_dim, sz.kn_block_size, DTYPES[sz.kn_dtype]
    )
    torch.manual_seed(0)
    copy_gb_s = copy_bandwidth(dev, sz.kn_copy_bytes, reps=sz.kn_reps)["gb_s"]
    figures: Figures = {"shape": {**shape._asdict(), "dtype": sz.kn_dtype}, "copy_gb_s": copy_gb_s}
    figures["decode"] = sweep_decode(ctx, shape, copy_gb_s)
    figures["prefill"] = sweep_prefill(ctx, shape)
    wrong = [
        f"{kind} {tuple(r['tiles'].values())}"
        for kind in ("decode", "prefill")
        for r in figures[kind]["candidates"]
        if r.get("correct") is False and not r["raised"]
    ]
    if wrong:
        raise PartFailed(f"candidates compute wrong results: {', '.join(wrong)}", figures)
    return figures
