"""Part `moe`: the fused mixture-of-experts kernel (`tandem.kernels.fused_moe`, CUDA's path in
`tandem.model.moe.moe_forward`) on one sparse layer of Qwen3-30B-A3B's shape (hidden 2048,
128 experts, top 8, expert width 768, bf16), against torch's grouped GEMMs on the same
weights (`tandem.model.moe.grouped_experts`, `F.grouped_mm`: the CPU path, and what a
library-free engine would run).

1. Correctness first: at every token count, both against each other and against
   `tandem.kernels.reference.fused_moe` (token by token, float32) on the first tokens.
   Tolerance: bf16's (tests/kernels' fused MoE tolerance).
2. Speed at 1 / 16 / 64 / 256 / 2048 tokens (random routing from a random router): median
   CUDA-event times with L2 flushed, each as a fraction of the limit its bytes set: the
   expert matrices the step's routing touches read once at the device-copy rate measured in
   this run (`roofline_us`), and the fused kernel's speedup over grouped torch.

A wrong result fails the part; speeds are figures. With --cpu: a tiny shape under Triton's
interpreter (a smoke run).
"""

from __future__ import annotations

import functools
import traceback

import torch

from .common import Context, Figures, PartFailed, copy_bandwidth, free_memory, median_time_s
from .kernels_bench import compare, sig, use_interpreter

DTYPE = torch.bfloat16
TOLERANCE = (4e-2, 2e-2)  # (atol, rtol): bf16 output rounding plus fp32 summation order
REFERENCE_TOKENS = 4  # the token-by-token reference is slow: the first few tokens only
MIN_CASE_S = 3.0  # a timed case starts only with this much of the budget left
SMOKE = "smoke: CPU tensors, Triton's interpreter, tiny shapes; times are not speeds"


def moe_layer(ctx: Context) -> tuple:  # type: ignore[type-arg]
    """(MoeWeights, MoeConfig) of one random sparse layer of the sizes' shape."""
    from tandem.model import moe

    s, dev = ctx.sizes, ctx.device
    hidden, experts, top_k, width = s.moe_shape
    std = hidden**-0.5
    weights = moe.MoeWeights(
        router=(torch.randn(hidden, experts, device=dev) * std).to(DTYPE),
        gate_up=(torch.randn(experts, hidden, 2 * width, device=dev) * std).to(DTYPE),
        down=(torch.randn(experts, width, hidden, device=dev) * width**-0.5).to(DTYPE),
    )
    cfg = moe.MoeConfig(experts, top_k, width, moe.Routing.SOFTMAX_TOPK, True, (0,))
    return weights, cfg


def expert_bytes(weights) -> int:  # type: ignore[no-untyped-def]
    """Bytes of one expert's matrices (what a routing that touches it reads once)."""
    return (weights.gate_up[0].numel() + weights.down[0].numel()) * DTYPE.itemsize


def check_moe(ctx: Context) -> Figures:
    s, dev = ctx.sizes, ctx.device
    if not ctx.cuda:
        use_interpreter()
    from tandem.kernels import reference
    from tandem.kernels.fused_moe import fused_moe
    from tandem.model import moe

    hidden, experts, top_k, width = s.moe_shape
    figures: Figures = {
        "mode": "benchmark" if ctx.cuda else SMOKE,
        "shape": {"hidden": hidden, "experts": experts, "top_k": top_k, "expert_width": width},
        "baseline": "tandem.model.moe.grouped_experts (torch F.grouped_mm)",
        "tolerance": {"atol": TOLERANCE[0], "rtol": TOLERANCE[1]},
    }
    figures["copy"] = copy_bandwidth(dev, s.kn_copy_bytes, reps=s.kn_reps)
    copy_gb_s = figures["copy"]["gb_s"]
    torch.manual_seed(0)
    weights, cfg = moe_layer(ctx)
    flush = None
    if s.kn_flush_bytes:
        flush = torch.empty(s.kn_flush_bytes, dtype=torch.uint8, device=dev)
    cases: list[Figures] = []
    figures["cases"] = cases
    wrong: list[str] = []
    for tokens in s.moe_tokens:
        case: Figures = {"tokens": tokens}
        cases.append(case)
        if ctx.left_s() < MIN_CASE_S:
            case["skipped"] = "out of the part's time budget"
            continue
        x = torch.randn(tokens, hidden, device=dev).to(DTYPE)
        routed = moe.route(x, weights.router, cfg)
        fused = functools.partial(
            fused_moe, x, weights.gate_up, weights.down, routed.expert_ids, routed.weights
        )
        grouped = functools.partial(moe.grouped_experts, x, routed, weights, cfg)
        try:
            got, base = fused(), grouped()
            n = min(tokens, REFERENCE_TOKENS)
            ref = reference.fused_moe(
                x[:n].float(), weights.gate_up.float(), weights.down.float(),
                routed.expert_ids[:n], routed.weights[:n].float(),
            ).to(DTYPE)  # fmt: skip
        except Exception as exc:  # a launch or compile error on this device
            ctx.log(traceback.format_exc().rstrip())
            case.update(passed=False, error=f"{type(exc).__name__}: {exc}")
            wrong.append(f"{tokens} tokens: {case['error'][:200]}")
            continue
        vs_ref = compare(got[:n], ref, *TOLERANCE)
        vs_grouped = compare(got, base, *TOLERANCE)
        case.update(
            passed=vs_ref["passed"] and vs_grouped["passed"],
            max_abs_diff_vs_reference=vs_ref["max_abs_diff"],
            max_abs_diff_vs_grouped=vs_grouped["max_abs_diff"],
        )
        if not case["passed"]:
            wrong.append(f"{tokens} tokens: {vs_ref.get('error') or vs_grouped.get('error')}")
            ctx.log(f"moe: {tokens} tokens WRONG: {vs_ref} {vs_grouped}")
            continue
        time_s = functools.partial(median_time_s, device=dev, reps=s.kn_reps, flush=flush)
        fused_s, grouped_s = time_s(fused), time_s(grouped)
        touched = int(torch.unique(routed.expert_ids).numel())
        nbytes = touched * expert_bytes(weights)
        roofline_s = nbytes / (copy_gb_s * 1e9)
        case.update(
            experts_touched=touched,
            expert_bytes_read=nbytes,
            fused_us=round(fused_s * 1e6, 1),
            grouped_us=round(grouped_s * 1e6, 1),
            fused_speedup_vs_grouped=round(grouped_s / fused_s, 3),
            roofline_us=round(roofline_s * 1e6, 1),
            fused_fraction_of_roofline=sig(roofline_s / fused_s),
            grouped_fraction_of_roofline=sig(roofline_s / grouped_s),
        )
        ctx.log(
            f"moe: {tokens:5d} tokens ({case['experts_touched']} experts): fused "
            f"{case['fused_us']} us, grouped {case['grouped_us']} us "
            f"({case['fused_speedup_vs_grouped']}x), roofline {case['roofline_us']} us = "
            f"{case['fused_fraction_of_roofline']} of it"
        )
        del x, routed, got, base
    del weights, flush
    free_memory(dev)
    if wrong:
        raise PartFailed(f"wrong results on {dev}: " + "; ".join(wrong), figures)
    if not ctx.cuda:
        figures["note"] = "not judged as speed: a smoke run"
    return figures
