"""Part `hybrid`: issue 42's kernels on the device -- the paged decode and prefill kernels with
a sliding window and sinks (gpt-oss, Gemma 3), the Gated DeltaNet decode step (Qwen3-Next)
and the fused MoE kernel with gpt-oss's biases and clamped SwiGLU, and with its MXFP4 experts
kept in 4 bits.

1. Correctness first, bf16 (float32 for the delta rule, its state's dtype): each against its
   reference (`tandem.kernels.reference.paged_attention` with window and sinks; the torch
   recurrence `linear_attention.recurrent_step`; the CPU path `moe.grouped_experts`), at
   the tolerances of tests/kernels.
2. Speed, each as a ratio in the same run: a sliding layer's decode (window 128, as gpt-oss)
   against the same rows at full attention, at batch 16 and 8k tokens of context (a sliding
   layer should cost ~window / context of a full one); its prefill (a 2048-token chunk after
   6k cached) likewise; the delta-rule kernel against the torch recurrence at 64 rows; the
   MXFP4 experts (gpt-oss-20b's 32 of 2880 x 2880, top 4) against the same in bf16, at 1
   and 64 tokens (a quarter of the bytes: up to ~3.5x where the weights' reads dominate).

3. The families through the whole engine (`hybrid_engines`): gpt-oss (bf16 experts and MXFP4
   ones kept in 4 bits), Gemma 3 and Qwen3-Next, float32, greedy tokens as transformers',
   with a prefix hit (Qwen3-Next's from a state checkpoint).

A wrong result fails the part; speeds are figures. With --cpu: tiny shapes under Triton's
interpreter (a smoke run). Not in the default parts: `--parts hybrid`.
"""

from __future__ import annotations

import functools
import traceback
from collections.abc import Callable
from typing import Any

import torch

from .common import Context, Figures, PartFailed, free_memory, median_time_s
from .hybrid_engines import check_hybrid_engines
from .kernels_bench import compare, use_interpreter

DTYPE = torch.bfloat16
ATTN_TOLERANCE = (1.6e-2, 1.6e-2)  # bf16 (tests/kernels)
RULE_TOLERANCE = (1e-4, 1e-4)  # float32
MOE_TOLERANCE = (4e-2, 2e-2)
WINDOW = 128
SMOKE = "smoke: CPU tensors, Triton's interpreter, tiny shapes; times are not speeds"


def _paged(batch: int, context: int, heads: tuple[int, int], dim: int, dev: str) -> Any:
    """A bf16 cache holding `batch` requests of `context` tokens (blocks of 16), their
    shuffled tables and one query per request."""
    q_heads, kv_heads = heads
    blocks = -(-context // 16)
    cache = torch.randn(batch * blocks + 1, 2, 16, kv_heads, dim, device=dev).to(DTYPE)
    tables = torch.randperm(batch * blocks, device=dev).view(batch, blocks).to(torch.int32) + 1
    lens = torch.full((batch,), context, dtype=torch.int32, device=dev)
    q = torch.randn(batch, q_heads, dim, device=dev).to(DTYPE)
    return cache, tables, lens, q


def _mxfp4_experts(cuda: bool, dev: str) -> dict[str, Any]:
    """Random MXFP4 experts (gpt-oss-20b's 32 experts of 2880 x 2880, top 4, on CUDA; tiny
    with --cpu), packed as the loader keeps them and dequantized to bf16."""
    from tandem.weights.families import dequantize_mxfp4, pack_mxfp4

    hidden, inter, experts, top_k = (2880, 2880, 32, 4) if cuda else (64, 96, 6, 2)

    def matrix(out: int, inp: int) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
        blocks = torch.randint(0, 256, (experts, out, inp // 32, 16), dtype=torch.uint8).to(dev)
        scales = torch.randint(119, 124, (experts, out, inp // 32), dtype=torch.uint8).to(dev)
        dense = dequantize_mxfp4(blocks, scales).to(DTYPE).transpose(1, 2).contiguous()
        return pack_mxfp4(blocks, scales), dense

    (gu, gus), gu_dense = matrix(2 * inter, hidden)
    (d, ds), d_dense = matrix(hidden, inter)
    return {"hidden": hidden, "experts": experts, "top_k": top_k, "packed": (gu, d),
            "scales": (gus, ds), "dense": (gu_dense, d_dense)}  # fmt: skip


def _routes(n: int, experts: int, top_k: int, dev: str) -> tuple[torch.Tensor, torch.Tensor]:
    weights, ids = torch.topk(torch.softmax(torch.rand(n, experts, device=dev), -1), top_k)
    return ids, weights


def check_hybrid(ctx: Context) -> Figures:
    if not ctx.cuda:
        use_interpreter()
    from tandem.kernels import reference
    from tandem.kernels.decode_attention import paged_decode_attention
    from tandem.kernels.delta_rule import delta_rule_step
    from tandem.kernels.fused_moe import fused_moe
    from tandem.kernels.prefill_attention import paged_prefill_attention
    from tandem.model import moe
    from tandem.model.linear_attention import l2norm, recurrent_step

    dev, cuda = ctx.device, ctx.cuda
    figures: Figures = {"mode": "benchmark" if cuda else SMOKE, "window": WINDOW}
    wrong: list[str] = []
    time_s: Callable[[Callable[[], Any]], float] = functools.partial(
        median_time_s, device=dev, reps=ctx.sizes.kn_reps, flush=None
    )
    torch.manual_seed(0)
    heads, dim = ((64, 8), 64) if cuda else ((4, 2), 16)  # gpt-oss's heads
    sinks = torch.randn(heads[0], device=dev)

    def judged(name: str, got: torch.Tensor, want: torch.Tensor, tol: tuple[float, float]) -> bool:
        result = compare(got.float(), want.float(), *tol)
        figures.setdefault("correct", {})[name] = result
        if not result["passed"]:
            wrong.append(f"{name}: {result.get('error') or result['max_abs_diff']}")
        return bool(result["passed"])

    try:
        # 1. correctness, small
        cache, tables, lens, q = _paged(3, 300, heads, dim, dev)
        out = paged_decode_attention(q, cache, tables, lens, 0.125, window=WINDOW, sinks=sinks)
        want = torch.stack([
            reference.paged_attention(q[r : r + 1].cpu(), cache.cpu(), tables[r].tolist(),
                                      300, 0.125, WINDOW, sinks.cpu())[0]
            for r in range(3)
        ]).to(dev)  # fmt: skip
        judged("decode_window_sinks", out, want, ATTN_TOLERANCE)
        chunk = 40
        qp = torch.randn(chunk, heads[0], dim, device=dev).to(DTYPE)
        starts = torch.tensor([0, chunk], dtype=torch.int32, device=dev)
        out = paged_prefill_attention(qp, cache, tables[:1], starts, lens[:1], chunk, 0.125,
                                      window=WINDOW, sinks=sinks)  # fmt: skip
        want = reference.paged_attention(qp.cpu(), cache.cpu(), tables[0].tolist(), 300, 0.125,
                                         WINDOW, sinks.cpu()).to(dev)  # fmt: skip
        judged("prefill_window_sinks", out, want, ATTN_TOLERANCE)
        rows, vh, kd, vd = (64, 32, 128, 128) if cuda else (3, 4, 8, 8)  # Qwen3-Next's heads
        qs = l2norm(torch.randn(rows, vh, kd, device=dev)) * kd**-0.5
        ks = l2norm(torch.randn(rows, vh, kd, device=dev))
        vs = torch.randn(rows, vh, vd, device=dev)
        g, beta = -torch.rand(rows, vh, device=dev), torch.rand(rows, vh, device=dev)
        states = torch.randn(rows + 2, vh, kd, vd, device=dev) * 0.1
        slots = torch.arange(rows, device=dev) + 1
        want_o, want_s = recurrent_step(qs, ks, vs, g, beta, states[slots].clone())
        got_o = delta_rule_step(qs, ks, vs, g, beta, states, slots)
        judged("delta_rule_output", got_o, want_o, RULE_TOLERANCE)
        judged("delta_rule_state", states[slots], want_s, RULE_TOLERANCE)
        hidden, experts, top_k, width = ctx.sizes.moe_shape
        x = torch.randn(16, hidden, device=dev).to(DTYPE)
        w = moe.MoeWeights(
            router=(torch.randn(hidden, experts, device=dev) * hidden**-0.5).to(DTYPE),
            gate_up=(torch.randn(experts, hidden, 2 * width, device=dev) * hidden**-0.5).to(DTYPE),
            down=(torch.randn(experts, width, hidden, device=dev) * width**-0.5).to(DTYPE),
            gate_up_bias=(torch.randn(experts, 2 * width, device=dev) * 0.1).to(DTYPE),
            down_bias=(torch.randn(experts, hidden, device=dev) * 0.1).to(DTYPE),
        )
        cfg = moe.MoeConfig(experts, top_k, width, moe.Routing.TOPK_SOFTMAX, True, (0,),
                            biases=True, swiglu_limit=7.0)  # fmt: skip
        routed = moe.route(x, w.router, cfg)
        got = fused_moe(x, w.gate_up, w.down, routed.expert_ids, routed.weights,
                        gate_up_bias=w.gate_up_bias, down_bias=w.down_bias,
                        swiglu_limit=7.0)  # fmt: skip
        judged("fused_moe_gpt_oss", got, moe.grouped_experts(x, routed, w, cfg), MOE_TOLERANCE)
        # MXFP4 experts (kept in 4 bits) against the same experts dequantized to bf16
        mx = _mxfp4_experts(cuda, dev)
        ids, rw = _routes(16, mx["experts"], mx["top_k"], dev)
        xm = torch.randn(16, mx["hidden"], device=dev).to(DTYPE)
        got = fused_moe(xm, *mx["packed"], ids, rw, gate_up_scales=mx["scales"][0],
                        down_scales=mx["scales"][1])  # fmt: skip
        judged("fused_moe_mxfp4", got, fused_moe(xm, *mx["dense"], ids, rw), MOE_TOLERANCE)
        # the families through the whole engine, against transformers
        figures["engines"] = check_hybrid_engines(ctx, ctx.tmp_dir / "hybrid-models")
        for family, result in figures["engines"].items():
            if not result["identical"] or result["prefix_hit_tokens"] != 24:
                wrong.append(f"engine {family}: {result}")
    except Exception as exc:  # a launch or compile error on this device
        ctx.log(traceback.format_exc().rstrip())
        raise PartFailed(f"{type(exc).__name__}: {exc}", figures) from None
    if wrong:
        raise PartFailed(f"wrong results on {dev}: " + "; ".join(wrong), figures)
    # 2. speed, as ratios in this run
    batch, context = (16, 8192) if cuda else (2, 300)
    cache, tables, lens, q = _paged(batch, context, heads, dim, dev)
    full = time_s(lambda: paged_decode_attention(q, cache, tables, lens, 0.125, sinks=sinks))
    slide = time_s(
        lambda: paged_decode_attention(q, cache, tables, lens, 0.125, window=WINDOW, sinks=sinks)
    )
    figures["decode"] = {
        "batch": batch, "context": context, "full_us": round(full * 1e6, 1),
        "sliding_us": round(slide * 1e6, 1), "sliding_over_full": round(slide / full, 3),
        "ideal": round(WINDOW / context, 3),
    }  # fmt: skip
    chunk = 2048 if cuda else 32
    qp = torch.randn(chunk, heads[0], dim, device=dev).to(DTYPE)
    starts = torch.tensor([0, chunk], dtype=torch.int32, device=dev)
    one = lens[:1]

    def prefill(window: int | None) -> torch.Tensor:
        return paged_prefill_attention(qp, cache, tables[:1], starts, one, chunk, 0.125,
                                       window=window, sinks=sinks)  # fmt: skip

    full, slide = time_s(lambda: prefill(None)), time_s(lambda: prefill(WINDOW))
    figures["prefill"] = {
        "chunk": chunk, "context": context, "full_us": round(full * 1e6, 1),
        "sliding_us": round(slide * 1e6, 1), "sliding_over_full": round(slide / full, 3),
    }  # fmt: skip
    kernel = time_s(lambda: delta_rule_step(qs, ks, vs, g, beta, states, slots))

    def torch_step() -> None:
        _, new = recurrent_step(qs, ks, vs, g, beta, states[slots])
        states[slots] = new

    eager = time_s(torch_step)
    figures["delta_rule"] = {
        "rows": rows, "heads": vh, "kernel_us": round(kernel * 1e6, 1),
        "torch_us": round(eager * 1e6, 1), "speedup": round(eager / kernel, 2),
    }  # fmt: skip
    figures["mxfp4"] = {}
    for n in (1, 64) if cuda else (2,):
        ids, rw = _routes(n, mx["experts"], mx["top_k"], dev)
        xn = torch.randn(n, mx["hidden"], device=dev).to(DTYPE)
        packed = functools.partial(
            fused_moe,
            xn,
            *mx["packed"],
            ids,
            rw,
            gate_up_scales=mx["scales"][0],
            down_scales=mx["scales"][1],
        )
        dense = functools.partial(fused_moe, xn, *mx["dense"], ids, rw)  # fmt: skip
        four, sixteen = time_s(packed), time_s(dense)
        figures["mxfp4"][str(n)] = {
            "mxfp4_us": round(four * 1e6, 1), "bf16_us": round(sixteen * 1e6, 1),
            "speedup": round(sixteen / four, 2),
        }  # fmt: skip
    ctx.log(f"hybrid: decode {figures['decode']}, prefill {figures['prefill']}, "
            f"delta rule {figures['delta_rule']}, mxfp4 experts {figures['mxfp4']}")  # fmt: skip
    free_memory(dev)
    if not cuda:
        figures["note"] = "not judged as speed: a smoke run"
    return figures
