"""The Gated DeltaNet decode-step kernel (kernels/delta_rule.py) against the torch
recurrence (tandem.model.linear_attention.recurrent_step) under Triton's interpreter, and
compiled for sm_90."""

from __future__ import annotations

import pytest
import torch

from tandem.kernels.delta_rule import delta_rule_step
from tandem.model.linear_attention import l2norm, recurrent_step
from tests.kernels.compile_check import assert_lowers


@pytest.mark.parametrize(("kd", "vd"), [(8, 6), (16, 16), (32, 80)])  # 80: two value tiles
def test_matches_the_recurrence_in_place(kd: int, vd: int) -> None:
    g = torch.Generator().manual_seed(kd + vd)
    rows, heads, slots = 3, 4, 7
    q = l2norm(torch.randn(rows, heads, kd, generator=g)) * kd**-0.5
    k = l2norm(torch.randn(rows, heads, kd, generator=g))
    v = torch.randn(rows, heads, vd, generator=g)
    decay = -torch.rand(rows, heads, generator=g)
    beta = torch.rand(rows, heads, generator=g)
    # a layer's view of [slots, layers, heads, K, V]: strided across slots
    pool = torch.randn(slots, 2, heads, kd, vd, generator=g)
    states = pool[:, 1]
    before, other_layer = states.clone(), pool[:, 0].clone()
    which = torch.tensor([5, 0, 3])
    want_o, want_s = recurrent_step(q, k, v, decay, beta, before[which])
    got = delta_rule_step(q, k, v, decay, beta, states, which)
    torch.testing.assert_close(got, want_o, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(states[which], want_s, atol=1e-5, rtol=1e-5)
    untouched = [i for i in range(slots) if i not in which.tolist()]
    torch.testing.assert_close(states[untouched], before[untouched], atol=0, rtol=0)
    torch.testing.assert_close(pool[:, 0], other_layer, atol=0, rtol=0)  # not this layer's


def test_rejects_what_it_cannot_take() -> None:
    q = torch.zeros(1, 2, 6)
    with pytest.raises(ValueError, match="power of two"):
        delta_rule_step(q, q, q, torch.zeros(1, 2), torch.zeros(1, 2),
                        torch.zeros(1, 2, 6, 6), torch.zeros(1, dtype=torch.int64))  # fmt: skip
    with pytest.raises(ValueError, match="float32"):
        delta_rule_step(q.half(), q, q, torch.zeros(1, 2), torch.zeros(1, 2),
                        torch.zeros(1, 2, 6, 6), torch.zeros(1, dtype=torch.int64))  # fmt: skip


LOWER_SCRIPT = r"""
from tandem.kernels.delta_rule import _delta_step_kernel
from tests.kernels.compile_check import aligned_attrs, compile_sm90, ptxas_usage

names = _delta_step_kernel.arg_names
for kd, vd, block_v in ((128, 128, 64), (64, 64, 64)):  # Qwen3-Next's heads, a smaller one
    constants = dict(K=kd, V=vd, BLOCK_V=block_v)
    signature = {}
    for name in names:
        if name in constants:
            signature[name] = "constexpr"
        elif name == "slots_ptr":
            signature[name] = "*i64"
        elif name.endswith("_ptr"):
            signature[name] = "*fp32"
        else:
            signature[name] = "i32"
    ptrs = [n for n in names if n.endswith("_ptr")]
    kernel = compile_sm90(_delta_step_kernel, signature, constants,
                          aligned_attrs(_delta_step_kernel, ptrs), num_warps=4)
    registers, spills = ptxas_usage(kernel.asm["ptx"])
    assert spills == 0, (kd, vd, registers, spills)
    print(kd, vd, registers, "registers ok")
"""


def test_lowers_for_sm90() -> None:
    assert_lowers(LOWER_SCRIPT, 2)
