"""Multi-head latent attention (DeepSeek-V3's MLA) over the paged cache: the CPU torch path.

An MLA layer keeps per token one latent vector and one rope key shared by every head, not
per-head keys and values:

    x --kv_a_proj_with_mqa--> [latent (kv_lora_rank) | k_rot (qk_rope_head_dim)]
        latent = RMSNorm(latent), k_rot = RoPE(k_rot)           <- the cache keeps these
    kv_b_proj: latent -> per head [k_nope (qk_nope_head_dim) | v (v_head_dim)]
    x --q_a_proj--> RMSNorm --q_b_proj--> (or x --q_proj-->) per head [q_nope | q_rot]
    score[h] = (q_nope[h] . k_nope[h] + RoPE(q_rot[h]) . k_rot) * scale

The cache is the one paged tensor every model uses, with one KV head whose K and V halves
together hold a token's entry [latent | k_rot] (`layer_groups.Mla.cache_head_dim`, D = entry
/ 2):

    kv_layer[block, 0, offset, 0, :] = entry[:D]
    kv_layer[block, 1, offset, 0, :] = entry[D:]

so block bytes, hand-offs, prefix hashing and sizing stay the dense models' code path.

Prefill chunks attend in the expanded form: the context's latents through kv_b_proj to
per-head keys and values, then causal SDPA. Decode rows attend in the absorbed form, the
up-projections folded into the query and the output (W_UK[h]: kv_b_proj's k_nope rows of
head h, [nope, latent]; W_UV[h]: its v rows, transposed, [latent, v]):

    q_lat[h] = q_nope[h] @ W_UK[h]                        [kv_lora_rank]
    score[h] = [q_lat[h] | q_rot[h]] . entry               one dot per cached token
    out[h]   = (softmax(score * scale) @ latent) @ W_UV[h]

which reads kv_lora_rank + qk_rope_head_dim numbers per cached token and never expands
the context. Both forms give the same numbers (tests/unit/test_mla.py). With the Triton
backend (`AttentionMetadata.paged`) the decode rows' softmax(score) @ latent is one launch
of `tandem.kernels.mla_decode` over the paged batch's decode tables (`paged_decode`); the
W_UK and W_UV products stay torch matmuls, and prefill chunks stay expanded, from the spans
the runner builds for an MLA model alongside the paged batch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tandem.model.attention import AttentionMetadata, DecodeGroup, PagedBatch, PrefillSpan
from tandem.model.layer_groups import Mla

Project = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # x [n, in] @ a matrix
Norm = Callable[[torch.Tensor, torch.Tensor, float], torch.Tensor]  # RMSNorm(x, w, eps)


@dataclass(slots=True)
class MlaWeights:
    """One MLA layer's weights, matrices transposed ([in, out]) like every other.

    `qkv_a` is the two projections of x fused: [q_a_proj | kv_a_proj_with_mqa] (with
    q_lora_rank) or [q_proj | kv_a_proj_with_mqa]. `w_uk` and `w_uv` are kv_b's two halves
    per head for the absorbed decode, computed at load (`build`).
    """

    qkv_a: torch.Tensor  # [hidden, (q_lora_rank or heads * qk_head_dim) + entry_dim]
    q_a_norm: torch.Tensor | None  # [q_lora_rank]
    q_b: torch.Tensor | None  # [q_lora_rank, heads * qk_head_dim]
    kv_a_norm: torch.Tensor  # [kv_lora_rank]
    kv_b: torch.Tensor  # [kv_lora_rank, heads * (qk_nope_head_dim + v_head_dim)]
    o: torch.Tensor  # [heads * v_head_dim, hidden]
    w_uk: torch.Tensor  # [heads, qk_nope_head_dim, kv_lora_rank]
    w_uv: torch.Tensor  # [heads, kv_lora_rank, v_head_dim]

    @classmethod
    def build(
        cls,
        cfg: Mla,
        qkv_a: torch.Tensor,
        q_a_norm: torch.Tensor | None,
        q_b: torch.Tensor | None,
        kv_a_norm: torch.Tensor,
        kv_b: torch.Tensor,
        o: torch.Tensor,
    ) -> MlaWeights:
        """The layer's weights, W_UK and W_UV taken out of kv_b per head."""
        nope, lat = cfg.qk_nope_head_dim, cfg.kv_lora_rank
        per_head = kv_b.view(lat, -1, nope + cfg.v_head_dim)  # [latent, heads, nope + v]
        w_uk = per_head[:, :, :nope].permute(1, 2, 0).contiguous()  # [heads, nope, latent]
        w_uv = per_head[:, :, nope:].permute(1, 0, 2).contiguous()  # [heads, latent, v]
        return cls(qkv_a, q_a_norm, q_b, kv_a_norm, kv_b, o, w_uk, w_uv)

    def pack(
        self,
        pack: Callable[[torch.Tensor], torch.Tensor],
        pack_o: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        """Pack the matrices applied to a step's rows for the device's matmul (o by `pack_o`
        where given: a tensor-parallel rank's row-parallel o). kv_b stays as loaded: the
        expanded prefill applies it to whole contexts, whose row counts are not bounded by
        the step's (oneDNN would compile a kernel per context length)."""
        self.qkv_a, self.o = pack(self.qkv_a), (pack_o or pack)(self.o)
        if self.q_b is not None:
            self.q_b = pack(self.q_b)

    def packed(self) -> tuple[torch.Tensor, ...]:
        """The matrices `pack` packs (their oneDNN kernels are compiled at warm-up)."""
        return (self.qkv_a, self.o) + (() if self.q_b is None else (self.q_b,))

    def tensors(self) -> tuple[torch.Tensor, ...]:
        extra = tuple(t for t in (self.q_a_norm, self.q_b) if t is not None)
        return (self.qkv_a, self.kv_a_norm, self.kv_b, self.o, self.w_uk, self.w_uv, *extra)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool) -> torch.Tensor:
    """RoPE of x [n, heads, rope_dim]; cos, sin [n, 1, rope_dim] (cat(freqs, freqs)).
    Interleaved: pair (x[2i], x[2i+1]) turned by freq i, written out de-interleaved (the
    first halves, then the second), as transformers' DeepSeek-V3 does."""
    half = x.shape[-1] // 2
    if interleave:
        c, s = cos[..., :half], sin[..., :half]
        x1, x2 = x[..., 0::2], x[..., 1::2]
        return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def write_entries(kv_layer: torch.Tensor, meta: AttentionMetadata, entries: torch.Tensor) -> None:
    """The step's new entries ([n, entry_dim]) into their slots: the first half in K, the
    second in V, of the cache's one KV head. kv_layer: [num_blocks, 2, block_size, 1, D]."""
    d = kv_layer.shape[-1]
    kv_layer[:, 0][meta.slot_block_ids, meta.slot_offsets] = entries[:, None, :d]
    kv_layer[:, 1][meta.slot_block_ids, meta.slot_offsets] = entries[:, None, d:]


def gather_entries(kv_layer: torch.Tensor, block_ids: torch.Tensor) -> torch.Tensor:
    """Blocks `block_ids` ([n]) of the layer as entries: [n * block_size, entry_dim]."""
    k = kv_layer[:, 0].index_select(0, block_ids)  # [n, block_size, 1, D]
    v = kv_layer[:, 1].index_select(0, block_ids)
    return torch.cat((k, v), dim=-1).flatten(0, 2)


def mla_forward(
    x: torch.Tensor,
    w: MlaWeights,
    cfg: Mla,
    num_heads: int,
    rope: tuple[torch.Tensor, torch.Tensor],
    meta: AttentionMetadata,
    kv_layer: torch.Tensor,
    scale: float,
    project: Project,
    norm: Norm,
    eps: float,
    out_proj: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """An MLA layer over x [n, hidden] (normed): its o_proj's output [n, hidden]. Writes
    the new tokens' entries, then attends: decode rows absorbed, prefill chunks expanded.
    `out_proj` applies o to the heads' outputs [n, heads * v_head_dim] where given (a
    tensor-parallel rank's split o, summed or gathered over the ranks).

    Args:
        rope: cos, sin [n, 1, qk_rope_head_dim] at the tokens' positions.
        meta: the step's decode groups and prefill spans (TorchAttention's metadata), or
            its paged batch (decode rows) and prefill spans (the Triton backend's).
        kv_layer: [num_blocks, 2, block_size, 1, cache_head_dim], this layer's cache.
    """
    n, h = x.shape[0], num_heads
    nope, r, lat = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.kv_lora_rank
    a = project(x, w.qkv_a)
    q, kv = a.split([a.shape[-1] - cfg.entry_dim, cfg.entry_dim], dim=-1)
    if w.q_b is not None:
        assert w.q_a_norm is not None
        q = project(norm(q, w.q_a_norm, eps), w.q_b)
    q_nope, q_rot = q.reshape(n, h, cfg.qk_head_dim).split([nope, r], dim=-1)
    latent, k_rot = kv.split([lat, r], dim=-1)
    cos, sin = rope
    q_rot = rotate(q_rot, cos, sin, cfg.rope_interleave)  # [n, heads, rope]
    k_rot = rotate(k_rot.unsqueeze(1), cos, sin, cfg.rope_interleave).squeeze(1)
    entries = torch.cat((norm(latent, w.kv_a_norm, eps), k_rot), dim=-1)  # [n, entry_dim]
    write_entries(kv_layer, meta, entries)
    out = x.new_empty(n, h, cfg.v_head_dim)
    if meta.paged is not None and meta.paged.num_decode:
        nd = meta.paged.num_decode
        out[:nd] = paged_decode(q_nope[:nd], q_rot[:nd], kv_layer, meta.paged, w, scale)
    for group in meta.decode_groups:
        s, e = group.start, group.end
        out[s:e] = absorbed_decode(q_nope[s:e], q_rot[s:e], kv_layer, group, w, lat, scale)
    for span in meta.prefills:
        s, e = span.token_start, span.token_start + span.num_new_tokens
        out[s:e] = expanded_prefill(
            q_nope[s:e], q_rot[s:e], entries[s:e], kv_layer, span, w, cfg, scale
        )
    heads_out = out.view(n, h * cfg.v_head_dim)
    return project(heads_out, w.o) if out_proj is None else out_proj(heads_out)


def absorbed_decode(
    q_nope: torch.Tensor,
    q_rot: torch.Tensor,
    kv_layer: torch.Tensor,
    group: DecodeGroup,
    w: MlaWeights,
    kv_lora_rank: int,
    scale: float,
) -> torch.Tensor:
    """A decode group's attention in the absorbed form (module doc): q_nope [rows, heads,
    nope], q_rot [rows, heads, rope] -> [rows, heads, v]. One query per row over its cached
    entries (padding past its context masked by the group's key bias)."""
    rows = group.block_tables.shape[0]
    q_lat = torch.bmm(q_nope.transpose(0, 1), w.w_uk).transpose(0, 1)  # [rows, heads, latent]
    query = torch.cat((q_lat, q_rot), dim=-1)  # [rows, heads, entry_dim]
    entries = gather_entries(kv_layer, group.block_tables.flatten())
    entries = entries.view(rows, -1, query.shape[-1])  # [rows, keys, entry_dim]
    scores = torch.bmm(query, entries.transpose(1, 2)).float()  # [rows, heads, keys]
    probs = torch.softmax(scores.mul_(scale).add_(group.key_bias), dim=-1).to(entries.dtype)
    context = torch.bmm(probs, entries[..., :kv_lora_rank])  # [rows, heads, latent]
    return torch.bmm(context.transpose(0, 1), w.w_uv).transpose(0, 1)  # [rows, heads, v]


def paged_decode(
    q_nope: torch.Tensor,
    q_rot: torch.Tensor,
    kv_layer: torch.Tensor,
    paged: PagedBatch,
    w: MlaWeights,
    scale: float,
) -> torch.Tensor:
    """The decode rows' attention in the absorbed form through the Triton kernel
    (`tandem.kernels.mla_decode`): q_nope [rows, heads, nope], q_rot [rows, heads, rope]
    -> [rows, heads, v]. Splits chosen for the step's longest context."""
    from tandem.kernels.decode_attention import device_num_sms
    from tandem.kernels.mla_decode import mla_decode_attention, mla_num_splits

    rows, heads = q_nope.shape[:2]
    q_lat = torch.bmm(q_nope.transpose(0, 1), w.w_uk).transpose(0, 1)  # [rows, heads, latent]
    max_blocks = -(-paged.max_decode_context_len // kv_layer.shape[2])
    splits = mla_num_splits(rows, heads, max_blocks, device_num_sms(kv_layer.device))
    context = mla_decode_attention(
        q_lat, q_rot, kv_layer, paged.decode_block_tables, paged.decode_context_lens, scale,
        num_splits=splits,
    )  # fmt: skip
    return torch.bmm(context.transpose(0, 1), w.w_uv).transpose(0, 1)  # [rows, heads, v]


def expanded_prefill(
    q_nope: torch.Tensor,
    q_rot: torch.Tensor,
    new_entries: torch.Tensor,
    kv_layer: torch.Tensor,
    span: PrefillSpan,
    w: MlaWeights,
    cfg: Mla,
    scale: float,
) -> torch.Tensor:
    """A prefill chunk's attention in the expanded form: q_nope [new, heads, nope], q_rot
    [new, heads, rope], new_entries [new, entry_dim] -> [new, heads, v]. The chunk's own
    entries as the cache holds them; earlier ones gathered from its blocks."""
    num_new, ctx = span.num_new_tokens, span.context_len
    entries = new_entries
    if ctx != num_new:
        entries = gather_entries(kv_layer, span.block_ids)[:ctx]
    heads, nope = q_nope.shape[1], cfg.qk_nope_head_dim
    latent, k_rot = entries.split([cfg.kv_lora_rank, cfg.qk_rope_head_dim], dim=-1)
    kv = (latent @ w.kv_b).view(ctx, heads, nope + cfg.v_head_dim)
    k_nope, values = kv.split([nope, cfg.v_head_dim], dim=-1)
    keys = torch.cat((k_nope, k_rot.unsqueeze(1).expand(ctx, heads, -1)), dim=-1)
    queries = torch.cat((q_nope, q_rot), dim=-1)  # [new, heads, qk_head_dim]
    mask, causal = None, True
    if ctx != num_new:  # query i sits at ctx - num_new + i and sees keys up to there
        q_pos = torch.arange(ctx - num_new, ctx, device=q_nope.device).unsqueeze(1)
        mask, causal = torch.arange(ctx, device=q_nope.device).unsqueeze(0) <= q_pos, False
    out = F.scaled_dot_product_attention(
        queries.transpose(0, 1).unsqueeze(0),  # [1, heads, new, qk_head_dim]
        keys.transpose(0, 1).unsqueeze(0),  # [1, heads, ctx, qk_head_dim]
        values.transpose(0, 1).unsqueeze(0),  # [1, heads, ctx, v]
        attn_mask=mask,
        is_causal=causal,
        scale=scale,
    )
    return out.squeeze(0).transpose(0, 1)
