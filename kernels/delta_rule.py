"""The Gated DeltaNet decode step (Qwen3-Next's linear-attention layers) as one kernel, for
CUDA: each decode row's recurrent state read from its slot, stepped by one token, written
back, and the token's output produced, in one launch per layer (torch takes ~10 element-wise
launches over the gathered states, plus the gather and the scatter).

One program per (row, value head, tile of BLOCK_V value columns): the state's [k_dim,
BLOCK_V] tile stays in registers while

    S      = S * exp(g)
    delta  = beta * (v - k^T S)           [BLOCK_V]
    S      = S + k delta^T
    o      = q^T S                        [BLOCK_V]

Each column of S is updated by its own column only, so value tiles are independent. All in
float32, the state's dtype (tandem.model.linear_attention.LinearStates). Correct under
Triton's interpreter against `linear_attention.recurrent_step`; compiled for sm_90 in the
tests; not yet timed on a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _delta_step_kernel(  # type: ignore[no-untyped-def]
    q_ptr,  # [rows, heads, K] fp32, normalised and scaled
    k_ptr,  # [rows, heads, K] fp32, normalised
    v_ptr,  # [rows, heads, V] fp32
    g_ptr,  # [rows, heads] fp32 log decay
    beta_ptr,  # [rows, heads] fp32
    state_ptr,  # [slots, heads, K, V] fp32: this layer's states (a strided view)
    slots_ptr,  # [rows] int64: each row's slot
    out_ptr,  # [rows, heads, V] fp32
    heads,
    stride_state_slot,  # state.stride(0)
    K: tl.constexpr,  # k_dim, a power of two
    V: tl.constexpr,  # v_dim
    BLOCK_V: tl.constexpr,  # value columns per program, a power of two
):
    row = tl.program_id(0)
    head = tl.program_id(1)
    cols = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    col_ok = cols < V
    kk = tl.arange(0, K)
    rh = row.to(tl.int64) * heads + head
    q = tl.load(q_ptr + rh * K + kk)
    k = tl.load(k_ptr + rh * K + kk)
    v = tl.load(v_ptr + rh * V + cols, mask=col_ok, other=0.0)
    decay = tl.exp(tl.load(g_ptr + rh))
    beta = tl.load(beta_ptr + rh)
    slot = tl.load(slots_ptr + row)
    base = state_ptr + slot * stride_state_slot + head.to(tl.int64) * K * V
    offs = kk[:, None] * V + cols[None, :]  # [K, BLOCK_V]
    s = tl.load(base + offs, mask=col_ok[None, :], other=0.0) * decay
    delta = (v - tl.sum(s * k[:, None], axis=0)) * beta  # [BLOCK_V]
    s = s + k[:, None] * delta[None, :]
    tl.store(base + offs, s, mask=col_ok[None, :])
    tl.store(out_ptr + rh * V + cols, tl.sum(s * q[:, None], axis=0), mask=col_ok)


def delta_rule_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    states: torch.Tensor,
    slots: torch.Tensor,
) -> torch.Tensor:
    """One decode token per row: rows' states (`states[slots[r]]`, updated in place) and
    outputs.

    Args:
        q, k: [rows, heads, k_dim] float32 (q normalised and scaled, k normalised).
        v: [rows, heads, v_dim] float32.
        g, beta: [rows, heads] float32.
        states: [slots, heads, k_dim, v_dim] float32, each slot's heads contiguous (a
            layer's view of `LinearStates.recurrent`).
        slots: [rows] int64.
    Returns:
        [rows, heads, v_dim] float32.
    Raises:
        ValueError: dtypes, shapes or strides the kernel does not take.
    """
    rows, heads, kd = q.shape
    vd = v.shape[2]
    tensors = (q, k, v, g, beta, states)
    if any(t.dtype != torch.float32 for t in tensors) or slots.dtype != torch.int64:
        raise ValueError("delta_rule_step takes float32 tensors and int64 slots")
    if kd & (kd - 1) or states.shape[1:] != (heads, kd, vd) or states[0].stride() != (
        kd * vd, vd, 1
    ):  # fmt: skip
        raise ValueError(
            f"states must be [slots, {heads}, {kd}, {vd}] with each slot contiguous and "
            f"k_dim a power of two, got {tuple(states.shape)} strides {states.stride()}"
        )
    q, k, v, g, beta = (t.contiguous() for t in (q, k, v, g, beta))
    out = torch.empty_like(v)
    if rows == 0:
        return out
    block_v = min(triton.next_power_of_2(vd), 64)
    _delta_step_kernel[(rows, heads, triton.cdiv(vd, block_v))](
        q, k, v, g, beta, states, slots.contiguous(), out,
        heads, states.stride(0), K=kd, V=vd, BLOCK_V=block_v,
    )  # fmt: skip
    return out
