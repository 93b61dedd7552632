"""Pure-torch reference of paged attention: slow, obvious, the ground truth for kernels.

Each request's keys live in blocks named by its block table; token t of the request is at
block_table[t // block_size], offset t % block_size:

    block_table = [7, 2]          block 7              block 2
    tokens      = 0..5   ->   [t0 t1 t2 t3]        [t4 t5 -- --]
"""

from __future__ import annotations

import torch


def gather_context(
    kv_layer: torch.Tensor, block_table: list[int], context_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of one request, token by token.

    Args:
        kv_layer: [num_blocks, 2, block_size, num_kv_heads, head_dim]
    Returns:
        keys, values: [context_len, num_kv_heads, head_dim]
    """
    block_size = kv_layer.shape[2]
    keys = [kv_layer[block_table[t // block_size], 0, t % block_size] for t in range(context_len)]
    vals = [kv_layer[block_table[t // block_size], 1, t % block_size] for t in range(context_len)]
    return torch.stack(keys), torch.stack(vals)


def paged_attention(
    q: torch.Tensor,
    kv_layer: torch.Tensor,
    block_table: list[int],
    context_len: int,
    scale: float,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of a request's newest queries over its paged context.

    Args:
        q: [num_queries, num_q_heads, head_dim], the queries of the last num_queries
            positions (context_len - num_queries ... context_len - 1).
        window: a query at p sees keys at (p - window, p] only.
        sinks: [num_q_heads] logits added to each head's softmax denominator.
    Returns:
        [num_queries, num_q_heads, head_dim], computed in float64 then cast back.
    """
    num_queries, num_q_heads, _ = q.shape
    keys, vals = gather_context(kv_layer, block_table, context_len)
    group = num_q_heads // keys.shape[1]
    keys = keys.double().repeat_interleave(group, dim=1)  # [ctx, q_heads, dim]
    vals = vals.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q.double(), keys) * scale
    q_pos = torch.arange(context_len - num_queries, context_len, device=q.device).unsqueeze(1)
    k_pos = torch.arange(context_len, device=q.device).unsqueeze(0)
    visible = k_pos <= q_pos  # [num_queries, ctx]
    if window is not None:
        visible &= k_pos > q_pos - window
    scores = scores.masked_fill(~visible, float("-inf"))
    # keys no query sees contribute nothing, even where a test poisons them with NaN
    vals = vals.masked_fill(~visible.any(0)[:, None, None], 0.0)
    if sinks is None:
        probs = scores.softmax(dim=-1)
    else:  # exp(s) / (sum exp(s) + exp(sink))
        sink = sinks.double().view(-1, 1, 1).expand(-1, num_queries, 1)
        probs = torch.cat((scores, sink), dim=-1).softmax(dim=-1)[..., :-1]
    out = torch.einsum("hqk,khd->qhd", probs, vals)
    return out.to(q.dtype)


def write_kv_reference(
    k: torch.Tensor,
    v: torch.Tensor,
    kv_layer: torch.Tensor,
    slot_block_ids: torch.Tensor,
    slot_offsets: torch.Tensor,
) -> None:
    """Store token t's k/v at block slot_block_ids[t], offset slot_offsets[t], in place.

    Args:
        k, v: [num_tokens, num_kv_heads, head_dim]
        kv_layer: [num_blocks, 2, block_size, num_kv_heads, head_dim]
        slot_block_ids, slot_offsets: [num_tokens] integer
    """
    kv_layer[slot_block_ids.long(), 0, slot_offsets.long()] = k
    kv_layer[slot_block_ids.long(), 1, slot_offsets.long()] = v


def quantize_kv_reference(x: torch.Tensor, scale: float) -> torch.Tensor:
    """e4m3 of x / scale in float32, saturated to +-448 (e4m3fn's largest finite value)."""
    return (x.float() / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn)


def dequantize_kv_reference(kv_layer: torch.Tensor, k_scale: float, v_scale: float) -> torch.Tensor:
    """An fp8 layer [num_blocks, 2, block_size, heads, dim] as float32 values: stored * scale
    (K in [:, 0], V in [:, 1])."""
    out = kv_layer.float()
    out[:, 0] *= k_scale
    out[:, 1] *= v_scale
    return out


def int4_dequantize_reference(
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    group_size: int,
    g_idx: torch.Tensor | None = None,
) -> torch.Tensor:
    """uint8 [out, in // 2] (input 2j low nibble, 2j + 1 high) -> float32 [out, in]:
    w[o, i] = (q[o, i] - zeros[o, g(i)]) * scales[o, g(i)], g(i) = g_idx[i] or i // group_size,
    zeros None meaning 8."""
    q = torch.stack((qweight & 0xF, qweight >> 4), dim=-1).flatten(1).float()  # [out, in]
    in_features = q.shape[1]
    if g_idx is not None:
        group = g_idx.long().to(q.device)
    else:
        group = torch.arange(in_features, device=q.device) // group_size
    z = zeros.float()[:, group] if zeros is not None else torch.full_like(q, 8.0)
    return (q - z) * scales[:, group]


def int4_matmul_reference(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    group_size: int,
    g_idx: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [n, in] @ dequantized W.T -> [n, out] in x's dtype. The weights are rounded to x's
    dtype (what a W4A16 kernel feeds its tensor cores), the products summed in float64."""
    w = int4_dequantize_reference(qweight, scales, zeros, group_size, g_idx).to(x.dtype)
    return (x.double() @ w.double().t()).to(x.dtype)


def scaled_matmul_reference(
    x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor
) -> torch.Tensor:
    """x [n, in] @ (qweight * scales[:, None]).T -> [n, out] in x's dtype, for int8 or fp8
    qweight [out, in] and float32 scales [out] or [1]; summed in float64, scaled after."""
    y = x.double() @ qweight.double().t()  # int8 and e4m3 values are exact in float64
    return (y * scales.double().view(1, -1)).to(x.dtype)


def fused_moe(
    x: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    expert_ids: torch.Tensor,
    weights: torch.Tensor,
) -> torch.Tensor:
    """Mixture-of-experts MLP, token by token and slot by slot: y[t] = sum_j weights[t, j] *
    down[e] (silu(x[t] @ gate[e]) * (x[t] @ up[e])), e = expert_ids[t, j].

    Args:
        x: [num_tokens, hidden]
        gate_up: [num_experts, hidden, 2 * inter] (gate columns, then up)
        down: [num_experts, inter, hidden]
        expert_ids, weights: [num_tokens, top_k]
    Returns:
        [num_tokens, hidden] in x's dtype.
    """
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(expert_ids.shape[1]):
            e = int(expert_ids[t, j])
            gate, up = (x[t] @ gate_up[e]).chunk(2)
            y = (torch.nn.functional.silu(gate) * up) @ down[e]
            out[t] += (y * weights[t, j]).to(x.dtype)
    return out


def mla_decode_context(
    q_lat: torch.Tensor,
    q_rot: torch.Tensor,
    kv_layer: torch.Tensor,
    block_table: list[int],
    context_len: int,
    scale: float,
) -> torch.Tensor:
    """One row's MLA decode context (kernels/mla_decode.py), in float64, cast back.

    Args:
        q_lat: [heads, kv_lora_rank]; q_rot: [heads, rope].
        kv_layer: [num_blocks, 2, block_size, 1, D]: a token's entry [latent | k_rot] is its
            K half then its V half.
    Returns:
        softmax((q_lat . latent + q_rot . k_rot) * scale) @ latent: [heads, kv_lora_rank].
    """
    keys, values = gather_context(kv_layer, block_table, context_len)
    entries = torch.cat((keys, values), dim=-1)[:, 0].double()  # [context_len, entry_dim]
    lat = q_lat.shape[-1]
    query = torch.cat((q_lat, q_rot), dim=-1).double()  # [heads, entry_dim]
    probs = torch.softmax(query @ entries.T * scale, dim=-1)
    return (probs @ entries[:, :lat]).to(q_lat.dtype)
