"""Qwen3-Next's Gated DeltaNet layers: linear attention with a fixed-size state per request.

Per token t of a request, per value head h (the key heads repeated to the value heads):

    x_t              = silu(causal depthwise conv over the last `kernel` inputs of [q|k|v])
    q_t, k_t         = l2-normalised; q_t scaled by 1 / sqrt(k_dim)
    g_t              = -exp(A_log) * softplus(a_t + dt_bias)      (decay, in log space)
    beta_t           = sigmoid(b_t)
    S                = S * exp(g_t)                                [k_dim, v_dim] per head
    S                = S + k_t (beta_t (v_t - k_t^T S))^T          (the delta rule)
    o_t              = q_t^T S
    out_t            = out_proj(rms_norm(o_t) * w * silu(z_t))

A request's state is the convolution's last kernel - 1 inputs ([channels, kernel - 1]) and S
per value head, for every linear layer: `LinearStates` keeps one slot of it per request the
runner has seen (tandem.engine.runner assigns the slots; a request's first chunk starts from
zeros, each later chunk and decode step from where the last one left S). Nothing of it is in
the paged KV cache: a cached prefix resumes a request only from a state checkpoint taken after
exactly that prefix (tandem.engine.state_checkpoints; a row may save one mid-chunk, `StateRows`),
and a hand-off carries it in a section of its own (tandem.engine.state_pages). Computed in
float32 (S always), on the torch ops of the device; a prefill chunk through the chunked form
(`chunk_rule`), decode rows together through the recurrent form (`recurrent_step`; on CUDA
one Triton kernel, tandem.kernels.delta_rule, steps every row's state in its slot).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.nn.functional as F

from tandem.model.layer_groups import LinearAttention

if TYPE_CHECKING:
    from tandem.quant.linear import QuantLinear
    from tandem.quant.weight import QuantizedWeight

    # as tandem.model.layer_weights.Weight (not imported: it imports this module)
    Weight = torch.Tensor | QuantizedWeight | QuantLinear

# Tokens per chunk of the chunked form (each chunk's intra-chunk products are [C, C]).
CHUNK = 64


@dataclass(slots=True)
class LinearWeights:
    """One Gated DeltaNet layer's weights, matrices [in, out] like every other.

    qkvz's columns are q (all key heads), k, v (all value heads), z (the output gate, per
    value head), de-interleaved from the checkpoint's per-key-head groups as they load;
    ba's are b (all value heads) then a.
    """

    qkvz: Weight  # [hidden, 2 * k_heads * k_dim + 2 * v_heads * v_dim]
    ba: torch.Tensor  # [hidden, 2 * v_heads]
    conv: torch.Tensor  # [channels, kernel] depthwise filters
    dt_bias: torch.Tensor  # [v_heads]
    a_log: torch.Tensor  # [v_heads]
    norm: torch.Tensor  # [v_dim] the gated norm's weight (applied as is)
    out: Weight  # [v_heads * v_dim, hidden]


class LinearStates:
    """Every linear layer's per-request state, a slot per request, grown as needed.

    conv: [slots, layers, channels, kernel - 1] in the model's dtype
    recurrent: [slots, layers, v_heads, k_dim, v_dim] float32
    """

    def __init__(
        self, cfg: LinearAttention, num_layers: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        self.cfg, self.num_layers, self.dtype, self.device = cfg, num_layers, dtype, device
        self.conv = torch.zeros(0, device=device)
        self.recurrent = torch.zeros(0, device=device)
        self._grow(8)

    @property
    def num_slots(self) -> int:
        return self.conv.shape[0]

    def slot_bytes(self) -> int:
        """One request's state over every linear layer."""
        return self.cfg.state_bytes(self.conv.element_size()) * self.num_layers

    def reserve(self, slots: int) -> None:
        """Hold at least `slots` slots now (the engine reserves its max_num_seqs at load, so
        the states are allocated before the KV cache is sized around them)."""
        if slots > self.num_slots:
            self._grow(slots)

    def reset(self, slot: int) -> None:
        """Zero slot `slot` (a request starting from its first token), growing the pool to
        hold it."""
        if slot >= self.num_slots:
            self._grow(max(slot + 1, 2 * self.num_slots))
        self.conv[slot].zero_()
        self.recurrent[slot].zero_()

    def copy_slots(self, src: LinearStates, src_slots: list[int], dst_slots: list[int]) -> None:
        """Every layer's state of `src`'s slots into this pool's (a checkpoint restored into
        a request's slot)."""
        if src_slots:
            self.reserve(max(dst_slots) + 1)
            self.conv[dst_slots] = src.conv[src_slots]
            self.recurrent[dst_slots] = src.recurrent[src_slots]

    def _grow(self, slots: int) -> None:
        c, n = self.cfg, self.num_slots
        conv = torch.zeros(slots, self.num_layers, c.conv_channels, c.conv_kernel - 1,
                           dtype=self.dtype, device=self.device)  # fmt: skip
        rec = torch.zeros(slots, self.num_layers, c.num_v_heads, c.k_dim, c.v_dim,
                          dtype=torch.float32, device=self.device)  # fmt: skip
        if n:
            conv[:n], rec[:n] = self.conv, self.recurrent
        self.conv, self.recurrent = conv, rec


class Chunk(NamedTuple):
    """A prefill chunk of the step's flat batch: tokens [start, start + num) of one request
    whose state is in `slot`. save_at > 0: the state after the chunk's first save_at tokens
    is also copied to checkpoint slot `save_slot` (a block boundary inside the chunk)."""

    start: int
    num: int
    slot: int
    save_at: int = 0
    save_slot: int = -1


@dataclass(frozen=True, slots=True)
class StateRows:
    """Which slot each part of the step's flat batch reads and writes: the decode rows
    (one token each, the first `len(decode_slots)` flat indices; int64 on the model's
    device, made once per step for every linear layer) and each prefill chunk, in flat
    order; `decode_saves`: (slot, checkpoint slot) for each decode row whose state after
    its token is kept as a checkpoint (in `checkpoints`)."""

    decode_slots: torch.Tensor
    chunks: tuple[Chunk, ...]
    decode_saves: tuple[tuple[int, int], ...] = ()
    checkpoints: LinearStates | None = None

    def save(self, states: LinearStates, layer: int, slots: list[int], saves: list[int]) -> None:
        """Copy one layer's state of `slots` into checkpoint slots `saves`."""
        assert self.checkpoints is not None
        self.checkpoints.conv[saves, layer] = states.conv[slots, layer]
        self.checkpoints.recurrent[saves, layer] = states.recurrent[slots, layer]


def l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def recurrent_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of each of R requests. q, k: [R, H, k_dim] (normalised, q scaled), v:
    [R, H, v_dim], g, beta: [R, H], state: [R, H, k_dim, v_dim], all float32. Returns
    (o [R, H, v_dim], the new state)."""
    state = state * g.exp()[..., None, None]
    remembered = (state * k[..., None]).sum(-2)  # k^T S: [R, H, v_dim]
    delta = (v - remembered) * beta[..., None]
    state = state + k[..., None] * delta[..., None, :]
    return (state * q[..., None]).sum(-2), state


def chunk_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The same rule over T tokens of one request, CHUNK tokens at a time: within a chunk
    the delta rule's updates are solved as one triangular system (the WY form), between
    chunks the state carries. q, k: [T, H, k_dim], v: [T, H, v_dim], g, beta: [T, H],
    state: [H, k_dim, v_dim], float32. Returns (o [T, H, v_dim], the final state)."""
    num_tokens = q.shape[0]
    outs = []
    eye = torch.eye(CHUNK, dtype=q.dtype, device=q.device)
    for lo in range(0, num_tokens, CHUNK):
        hi = min(num_tokens, lo + CHUNK)
        n = hi - lo
        # head-major: [H, n, d]
        qc, kc, vc = (t[lo:hi].transpose(0, 1) for t in (q, k, v))
        gc, bc = g[lo:hi].transpose(0, 1), beta[lo:hi].transpose(0, 1)  # [H, n]
        cum = gc.cumsum(-1)  # log decay from the chunk's start through token i
        # decay from token j to token i (j <= i): exp(cum_i - cum_j)
        diff = cum[..., :, None] - cum[..., None, :]
        lower = torch.tril(torch.ones(n, n, dtype=torch.bool, device=q.device))
        decay = torch.where(lower, diff, float("-inf")).exp()  # [H, n, n]
        strict = decay.masked_fill(eye[:n, :n].bool(), 0.0)
        # u_i = beta_i (v_i - k_i^T S_{i-1}) with S_{i-1} = decayed S0 + sum_{j<i} k_j u_j^T:
        #   u + (beta k k^T * decay, strictly lower) u = beta (v - exp(cum) k^T S0)
        kk = (kc @ kc.transpose(-1, -2)) * strict * bc[..., :, None]
        rhs = bc[..., None] * (vc - cum.exp()[..., None] * (kc @ state))
        u = torch.linalg.solve_triangular(eye[:n, :n] + kk, rhs, upper=False)
        # o_i = q_i^T S_i = exp(cum_i) q_i^T S0 + sum_{j<=i} decay_ij (q_i . k_j) u_j
        qk = (qc @ kc.transpose(-1, -2)) * decay
        outs.append((cum.exp()[..., None] * (qc @ state) + qk @ u).transpose(0, 1))
        # S_n = exp(cum_n) S0 + sum_j exp(cum_n - cum_j) k_j u_j^T
        tail = (cum[..., -1:] - cum).exp()[..., None]  # [H, n, 1]
        state = cum[..., -1].exp()[..., None, None] * state + (kc * tail).transpose(-1, -2) @ u
    return torch.cat(outs), state


def conv_step(
    x: torch.Tensor, state: torch.Tensor, weight: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """silu(causal depthwise conv) of x [T, channels] after `state` [channels, kernel - 1]
    (the inputs before it); returns ([T, channels], the new state: the last kernel - 1)."""
    history = torch.cat((state, x.t().to(state.dtype)), dim=-1)  # [channels, K - 1 + T]
    out = F.conv1d(history.unsqueeze(0), weight.unsqueeze(1), groups=weight.shape[0])[0]
    return F.silu(out).t().to(x.dtype), history[:, history.shape[1] - state.shape[1] :]


def gdn_forward(
    x: torch.Tensor,
    w: LinearWeights,
    cfg: LinearAttention,
    states: LinearStates,
    layer: int,
    rows: StateRows,
    project: Callable[[torch.Tensor, Weight], torch.Tensor],
    eps: float,
) -> torch.Tensor:
    """The layer over a step's flat batch x [n, hidden] -> [n, hidden], each request's
    state read and written in its slot (`rows`); `project(x, matrix)` multiplies as the
    model does. `layer`: the index among the linear layers."""
    kh, vh, kd, vd = cfg.num_k_heads, cfg.num_v_heads, cfg.k_dim, cfg.v_dim
    n = x.shape[0]
    qkvz = project(x, w.qkvz)
    mixed, z = qkvz.split([2 * kh * kd + vh * vd, vh * vd], dim=-1)
    b, a = (x @ w.ba).split([vh, vh], dim=-1)
    beta = b.sigmoid().float()
    g = -w.a_log.float().exp() * F.softplus(a.float() + w.dt_bias.float())
    conv_out = torch.empty_like(mixed)
    o = torch.empty(n, vh, vd, dtype=torch.float32, device=x.device)
    nd = len(rows.decode_slots)

    def heads(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = t.float().split([kh * kd, kh * kd, vh * vd], dim=-1)
        q = l2norm(q.view(-1, kh, kd)).repeat_interleave(vh // kh, dim=1) * kd**-0.5
        k = l2norm(k.view(-1, kh, kd)).repeat_interleave(vh // kh, dim=1)
        return q, k, v.view(-1, vh, vd)

    if nd:  # decode rows: one token each, their states gathered and stepped together
        slots = rows.decode_slots
        conv_state = states.conv[slots, layer]  # [R, channels, K - 1]
        history = torch.cat((conv_state, mixed[:nd, :, None].to(conv_state.dtype)), dim=-1)
        conv_out[:nd] = F.silu((history * w.conv).sum(-1)).to(mixed.dtype)
        states.conv[slots, layer] = history[..., 1:]
        q, k, v = heads(conv_out[:nd])
        if x.is_cuda:  # one kernel: each row's state stepped in its slot
            from tandem.kernels.delta_rule import delta_rule_step

            layer_states = states.recurrent[:, layer]
            o[:nd] = delta_rule_step(q, k, v, g[:nd], beta[:nd], layer_states, slots)
        else:
            rec = states.recurrent[slots, layer]
            o[:nd], rec = recurrent_step(q, k, v, g[:nd], beta[:nd], rec)
            states.recurrent[slots, layer] = rec
        if rows.decode_saves:
            src, dst = zip(*rows.decode_saves, strict=True)
            rows.save(states, layer, list(src), list(dst))
    for c in rows.chunks:
        # split at a checkpoint's boundary: the state there is saved before going on
        cut = c.start + c.save_at
        for lo, hi in ((c.start, cut), (cut, c.start + c.num)):
            if lo == hi:
                continue
            out, states.conv[c.slot, layer] = conv_step(
                mixed[lo:hi], states.conv[c.slot, layer], w.conv
            )
            conv_out[lo:hi] = out
            q, k, v = heads(out)
            o[lo:hi], states.recurrent[c.slot, layer] = chunk_rule(
                q, k, v, g[lo:hi], beta[lo:hi], states.recurrent[c.slot, layer]
            )
            if hi == cut:
                rows.save(states, layer, [c.slot], [c.save_slot])
    # the gated RMSNorm, in transformers' order of roundings (o in the model's dtype first)
    of = o.to(x.dtype).float()
    normed = of * torch.rsqrt(of.pow(2).mean(-1, keepdim=True) + eps)
    gated = (w.norm * normed.to(x.dtype)) * F.silu(z.view(n, vh, vd).float())
    return project(gated.to(x.dtype).reshape(n, vh * vd), w.out)
