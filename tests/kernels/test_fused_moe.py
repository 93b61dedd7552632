"""The fused MoE kernel (kernels/fused_moe.py) against the pure-torch reference, under
Triton's interpreter on a machine without a GPU, and compiled for sm_90."""

from __future__ import annotations

import pytest
import torch

from tandem.kernels import reference
from tandem.kernels.fused_moe import align_by_expert, fused_moe
from tests.kernels.compile_check import assert_lowers


def _case(
    num_tokens: int,
    num_experts: int,
    top_k: int,
    hidden: int,
    inter: int,
    dtype: torch.dtype,
    seed: int,
) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, hidden, generator=g).to(dtype)
    gate_up = (torch.randn(num_experts, hidden, 2 * inter, generator=g) / hidden**0.5).to(dtype)
    down = (torch.randn(num_experts, inter, hidden, generator=g) / inter**0.5).to(dtype)
    scores = torch.rand(num_tokens, num_experts, generator=g)
    weights, ids = torch.topk(torch.softmax(scores, -1), top_k, dim=-1)
    return x, gate_up, down, ids, weights


# fmt: skip


def test_align_pads_each_run_and_marks_empty_tiles() -> None:
    ids = torch.tensor([[2, 0], [0, 1], [0, 2]])  # pairs 0..5 -> experts 2 0 0 1 0 2
    sorted_pairs, block_expert = align_by_expert(ids, num_experts=4, block_m=2)
    s = 6  # sentinel
    # 5 tiles: 6 pairs and up to 1 padding row for each of 4 experts, whatever the routing
    assert sorted_pairs.tolist() == [1, 2, 4, s, 3, s, 0, 5, s, s]
    assert block_expert.tolist() == [0, 0, 1, 2, 4]


@pytest.mark.parametrize(
    "num_tokens,num_experts,top_k",
    [(1, 1, 1), (5, 4, 2), (37, 8, 2), (70, 6, 3), (300, 4, 1)],  # 300: 64-row tiles
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_reference(num_tokens, num_experts, top_k, dtype) -> None:
    hidden, inter = 48, 40  # not multiples of the tiles: masks on every edge
    x, gate_up, down, ids, weights = _case(
        num_tokens, num_experts, top_k, hidden, inter, dtype, seed=num_tokens
    )
    got = fused_moe(x, gate_up, down, ids, weights)
    want = reference.fused_moe(x, gate_up, down, ids, weights)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpt_oss_biases_and_clamped_swiglu(dtype) -> None:
    """gpt-oss's experts: biases on both GEMMs and the clamped SwiGLU (a limit that bites),
    against the CPU path (tandem.model.moe.grouped_experts), itself checked against
    transformers' GptOssMLP (tests/unit/test_moe.py)."""
    from tandem.model.moe import MoeConfig, MoeWeights, Routed, Routing, grouped_experts

    hidden, inter, num_experts = 48, 40, 6
    x, gate_up, down, ids, weights = _case(37, num_experts, 2, hidden, inter, dtype, seed=5)
    g = torch.Generator().manual_seed(6)
    gub = torch.randn(num_experts, 2 * inter, generator=g).to(dtype)
    db = torch.randn(num_experts, hidden, generator=g).to(dtype)
    cfg = MoeConfig(num_experts, 2, inter, Routing.TOPK_SOFTMAX, True, (0,), biases=True,
                    swiglu_limit=0.6)  # fmt: skip
    w = MoeWeights(torch.empty(hidden, num_experts), gate_up, down, gate_up_bias=gub,
                   down_bias=db)  # fmt: skip
    got = fused_moe(x, gate_up, down, ids, weights, gate_up_bias=gub, down_bias=db,
                    swiglu_limit=0.6)  # fmt: skip
    want = grouped_experts(x, Routed(ids, weights.to(dtype)), w, cfg)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(got, want, atol=tol, rtol=tol)
    plain = fused_moe(x, gate_up, down, ids, weights)
    assert not torch.allclose(plain, want, atol=1e-2)


@pytest.mark.parametrize("expert", [0, 7])
def test_skewed_routing_all_tokens_to_one_expert(expert: int) -> None:
    x, gate_up, down, _, _ = _case(40, 8, 2, 32, 32, torch.float32, seed=expert)
    ids = torch.stack([torch.full((40,), expert), torch.arange(40) % 8], dim=1)
    ids[:, 1] = torch.where(ids[:, 1] == expert, (expert + 1) % 8, ids[:, 1])
    weights = torch.rand(40, 2)
    only = ids[:, :1].contiguous()  # top 1: every pair to `expert`, the 7 others idle
    torch.testing.assert_close(
        fused_moe(x, gate_up, down, only, weights[:, :1]),
        reference.fused_moe(x, gate_up, down, only, weights[:, :1]),
        atol=1e-5, rtol=1e-5,
    )  # fmt: skip
    torch.testing.assert_close(
        fused_moe(x, gate_up, down, ids, weights),
        reference.fused_moe(x, gate_up, down, ids, weights),
        atol=1e-5, rtol=1e-5,
    )  # fmt: skip


@pytest.mark.parametrize("first_expert", [0, 3])
def test_expert_parallel_share_sums_only_its_experts(first_expert: int) -> None:
    """A rank holding experts [first, first + 3) of 6: its output is the sum over the pairs
    routed to them; the two ranks' outputs add up to the whole."""
    x, gate_up, down, ids, weights = _case(29, 6, 2, 32, 24, torch.float32, seed=first_expert)
    mine = ids.clone()
    local = (ids >= first_expert) & (ids < first_expert + 3)
    got = fused_moe(
        x, gate_up[first_expert : first_expert + 3].contiguous(),
        down[first_expert : first_expert + 3].contiguous(), ids, weights, first_expert,
    )  # fmt: skip
    want = reference.fused_moe(x, gate_up, down, mine, weights * local)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_rejects_bad_arguments() -> None:
    x, gate_up, down, ids, weights = _case(4, 4, 2, 16, 16, torch.float32, seed=0)
    with pytest.raises(ValueError, match="down must be"):
        fused_moe(x, gate_up, down[:, :8], ids, weights)
    with pytest.raises(ValueError, match="expert weights must be"):
        fused_moe(x, gate_up.half(), down, ids, weights)
    with pytest.raises(ValueError, match="expert_ids and weights"):
        fused_moe(x, gate_up, down, ids[:2], weights)


# Compiles both kernels for sm_90 (Triton's own LLVM and ptxas, no GPU needed) with the
# wrapper's tiles, in a fresh interpreter without TRITON_INTERPRET. Exit code 3: this Triton
# cannot target CUDA.
LOWER_SCRIPT = r"""
from tandem.kernels.fused_moe import _down_kernel, _gate_up_kernel, _tiles
from tests.kernels.compile_check import aligned_attrs, compile_sm90, ptxas_usage

POINTERS = {
    _gate_up_kernel: ("x_ptr", "w_ptr", "act_ptr", "bias_ptr"),
    _down_kernel: ("act_ptr", "w_ptr", "out_ptr", "bias_ptr"),
}

for kernel in (_gate_up_kernel, _down_kernel):
    for block_m in (16, 64):
        for variant in ("fp16", "bf16", "mxfp4"):
            # bf16: gpt-oss's variant (biases, the clamped SwiGLU); mxfp4: its experts as
            # shipped, decoded in the kernel (one 32-input scale block per K step)
            mxfp4 = variant == "mxfp4"
            x = "bf16" if mxfp4 else variant
            constants = dict(_tiles(block_m), DOT_PRECISION="tf32", DOT_FP32=False,
                             HAS_BIAS=x == "bf16", MXFP4=mxfp4)  # fmt: skip
            if mxfp4:
                constants["BLOCK_K"] = 32
            if kernel is _gate_up_kernel:
                constants["TOP_K"] = 2
                constants["CLAMPED"] = x == "bf16"
            signature = {}
            for arg in kernel.arg_names:
                if arg in constants:
                    signature[arg] = "constexpr"
                elif mxfp4 and arg in ("w_ptr", "scales_ptr"):
                    signature[arg] = "*u8"
                elif arg in POINTERS[kernel]:
                    signature[arg] = "*" + x
                elif arg.endswith("_ptr"):
                    signature[arg] = "*fp32" if arg == "weights_ptr" else "*i32"
                elif arg in ("limit", "alpha"):
                    signature[arg] = "fp32"
                else:
                    signature[arg] = "i32"
            names = [n for n in kernel.arg_names if n.endswith("_ptr") or n.startswith("stride_")]
            compiled = compile_sm90(
                kernel, signature, constants, aligned_attrs(kernel, names),
                num_warps=4 if block_m == 16 else 8, enable_fp_fusion=True,
            )
            registers, spills = ptxas_usage(compiled.asm["ptx"])
            assert spills == 0, (kernel.fn.__name__, block_m, variant, registers, spills)
            print(kernel.fn.__name__, block_m, variant, registers, "registers ok")
"""


def test_lowers_for_sm90() -> None:
    assert_lowers(LOWER_SCRIPT, 12)


@pytest.mark.parametrize("num_tokens,top_k", [(1, 1), (37, 2), (70, 3)])
def test_mxfp4_experts_decode_in_the_kernel(num_tokens: int, top_k: int) -> None:
    """gpt-oss's MXFP4 experts kept in 4 bits (`families.pack_mxfp4`): the kernel that decodes
    them tile by tile gives what it gives on the same weights dequantized to bfloat16 first
    (`families.dequantize_mxfp4`, exact), biases and the clamped SwiGLU included; and it
    refuses scales that do not fit."""
    from tandem.weights.families import dequantize_mxfp4, pack_mxfp4

    hidden, inter, num_experts = 64, 96, 6  # in 32s; 96 masks the last 64-column tile
    g = torch.Generator().manual_seed(num_tokens)
    x = torch.randn(num_tokens, hidden, generator=g).to(torch.bfloat16)

    def mxfp4(out: int, inp: int) -> tuple[torch.Tensor, torch.Tensor]:  # as shipped
        blocks = torch.randint(0, 256, (num_experts, out, inp // 32, 16), generator=g)
        scales = torch.randint(119, 124, (num_experts, out, inp // 32), generator=g)
        return blocks.to(torch.uint8), scales.to(torch.uint8)

    gu_blocks, gu_scales = mxfp4(2 * inter, hidden)
    d_blocks, d_scales = mxfp4(hidden, inter)
    dense = [dequantize_mxfp4(b, s).transpose(1, 2).contiguous().to(torch.bfloat16)
             for b, s in ((gu_blocks, gu_scales), (d_blocks, d_scales))]  # fmt: skip
    (gu, gus), (d, ds) = pack_mxfp4(gu_blocks, gu_scales), pack_mxfp4(d_blocks, d_scales)
    assert gu.shape == (num_experts, hidden // 2, 2 * inter) and gus.shape[1] == hidden // 32
    scores = torch.rand(num_tokens, num_experts, generator=g)
    weights, ids = torch.topk(torch.softmax(scores, -1), top_k, dim=-1)
    gub = torch.randn(num_experts, 2 * inter, generator=g).to(torch.bfloat16)
    db = torch.randn(num_experts, hidden, generator=g).to(torch.bfloat16)
    extra = dict(gate_up_bias=gub, down_bias=db, swiglu_limit=7.0)
    got = fused_moe(x, gu, d, ids, weights, gate_up_scales=gus, down_scales=ds, **extra)
    want = fused_moe(x, *dense, ids, weights, **extra)
    torch.testing.assert_close(got, want, atol=1e-2, rtol=1e-2)
    assert got.abs().max() > 0.1  # not all zeros
    with pytest.raises(ValueError, match="down_scales must be contiguous uint8"):
        fused_moe(x, gu, d, ids, weights, gate_up_scales=gus, down_scales=ds[:, :1])
    with pytest.raises(ValueError, match="expert weights must be"):
        fused_moe(x, *dense, ids, weights, down_scales=ds)
