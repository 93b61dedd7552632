"""Llama-family decoder (Llama 2/3, Mistral, Qwen2/2.5, Qwen3; Qwen3-MoE and Mixtral, whose
sparse layers' MLP is `tandem.model.moe`; DeepSeek-V3, whose attention is
`tandem.model.mla`) over a paged KV cache.

Tokens of all requests in a step are packed into one flat batch ([num_tokens, ...]); the
attention backend knows which request each token belongs to. q/k/v and gate/up projections
are fused into one matmul each (fewer, larger GEMMs on CPU). Weight matrices are loaded
transposed, [in_features, out_features], and applied by `tandem.model.linear.matmul` in the
form the device's matmul wants (`LlamaModel(matmul=...)`: `x @ w` as loaded, or prepacked
once for oneDNN on a bfloat16 CPU); decode at batch 1 is bound by reading the weights.
A layer matrix may instead be a `QuantizedWeight` (`--quantization`), packed here for its
device's quantized path (`tandem.quant.linear`); embeddings, norms and lm_head stay in
the model's dtype.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import TYPE_CHECKING, cast

import torch
import torch.nn.functional as F

from tandem.kernels import cpu_ops
from tandem.model import linear
from tandem.model.attention import AttentionBackend, AttentionMetadata
from tandem.model.config import ModelConfig
from tandem.model.layer_weights import LayerWeights, ModelWeights, Weight
from tandem.model.linear import MatmulKind, matmul, onednn_row_counts, onednn_rows, pack
from tandem.model.linear_attention import LinearStates, gdn_forward
from tandem.model.mla import mla_forward
from tandem.model.moe import moe_forward
from tandem.model.rope import RotaryEmbedding, apply_rotary
from tandem.parallel.sharding import hidden_columns
from tandem.quant.linear import (
    QuantLinear,
    QuantPath,
    Workspace,
    pack_quantized,
    quant_matmul,
)
from tandem.quant.weight import QuantizedWeight, WeightScheme

if TYPE_CHECKING:
    from tandem.parallel.group import TPGroup


def triton_ops_for(device: torch.device, attention: AttentionBackend) -> bool:
    """Whether the layer's element-wise work runs as tandem.kernels.fused's Triton kernels:
    on CUDA with the Triton attention backend (the torch backend, chosen where Triton
    cannot launch, keeps torch ops; a CPU runs Triton only under the interpreter)."""
    return device.type == "cuda" and attention.needs_paged_batch


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in float32, cast back, then scaled (HF's order of operations)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def offset_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma's and Qwen3-Next's RMSNorm: scaled in float32 by `weight` (float32, already
    1 + w), then cast."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (xf * weight).to(x.dtype)


class LlamaModel:
    """The decoder. Stateless apart from weights and RoPE tables; KV lives in the cache.

    With `tp` (a rank of a tensor-parallel group, tandem.parallel.sharding) `config` is this
    rank's share (its query and KV heads, its part of the MLP; the vocabulary and layers
    the model's) and `weights` its shard; the forward adds one all-reduce after o, one
    after down, one after the vocabulary-parallel embedding, and an all-gather of the
    logits. Without it no collective runs.

    A row-parallel layer (o, down, a sparse layer's experts) leaves each rank a partial sum.
    In bfloat16 or float16 on a CPU (`reduce_f32`) the partial sums are computed, all-reduced
    and added in float32 and rounded to the model's dtype once, as one rank's GEMM (which
    accumulates in float32) rounds its whole sum once; rounding each partial to bfloat16
    before the sum moved the logits enough to change greedy answers. torch's CPU matmul has
    no float32 output for bfloat16 operands (`out_dtype` is CUDA's), so those matrices are
    held in float32 (exactly their bfloat16 values) and multiplied in float32.
    """

    def __init__(
        self,
        config: ModelConfig,
        weights: ModelWeights,
        attention: AttentionBackend,
        max_positions: int,
        matmul: MatmulKind = MatmulKind.PLAIN,
        tp: TPGroup | None = None,
    ) -> None:
        """`matmul`: how the weight matrices are applied; other than PLAIN, they are packed
        here, in place (`weights` then holds the packed forms, readable only by `matmul`)."""
        self.config = config
        self.tp = tp if tp is not None and tp.size > 1 else None
        self.matmul = matmul
        # The row counts oneDNN products were computed at (one kernel per count and matrix
        # shape in oneDNN's cache; bounded by `linear.onednn_row_counts`). Empty when PLAIN.
        self.onednn_row_counts: set[int] = set()
        self.workspace = Workspace()  # what per-call dequantizations reuse
        dtype = weights.embed.dtype
        # The row-parallel partial sums in float32 (class docstring); CUDA keeps its dtype.
        self.reduce_f32 = (
            self.tp is not None
            and dtype in (torch.bfloat16, torch.float16)
            and weights.embed.device.type == "cpu"
        )
        # o and down split by their outputs (Shard.exact_sums) or Megatron's by their inputs
        self._exact = self.tp is not None and self.tp.shard.exact_sums
        self._reduce_o = self.tp is not None and not self.tp.shard.replicate_attention
        split = self._pack if self._exact else self._pack_row_parallel
        for lw in weights.layers:
            if lw.qkv is not None and lw.o is not None:
                lw.qkv = self._pack(lw.qkv, dtype)
                lw.o = split(lw.o, dtype) if self._reduce_o else self._pack(lw.o, dtype)
            if lw.linear is not None:
                lw.linear.qkvz = self._pack(lw.linear.qkvz, dtype)
                lw.linear.out = self._pack(lw.linear.out, dtype)
            if lw.mla is not None:
                mla_o = lambda w: cast(torch.Tensor, split(w, dtype))  # noqa: E731
                lw.mla.pack(lambda w: pack(w, matmul), mla_o if self._reduce_o else None)
            if lw.moe is not None and self.reduce_f32:
                lw.moe.down = lw.moe.down.float()
            if lw.gate_up is not None and lw.down is not None:
                lw.gate_up, lw.down = self._pack(lw.gate_up, dtype), split(lw.down, dtype)
        # exact_sums: every rank's widths of what is gathered (attention's heads, the MLP's
        # intermediate columns, o's and down's output columns)
        self._widths: tuple[tuple[int, ...], ...] = ()
        if self.tp is not None and self._exact:
            shard = self.tp.shard
            ranks = [dataclasses.replace(shard, rank=r) for r in range(shard.size)]
            mla = config.features.mla  # its heads' outputs are v_head_dim wide
            width = mla.v_head_dim if mla is not None else config.head_dim
            local = [config.num_q_heads * width, config.intermediate_size]
            gathered = self.tp.gather_ints(local, str(weights.embed.device))
            self._widths = (
                tuple(g[0] for g in gathered),
                tuple(g[1] for g in gathered),
                tuple(len(hidden_columns(config, s)) for s in ranks),
            )
        if matmul is not MatmulKind.PLAIN:
            weights.lm_head = pack(weights.lm_head, matmul)
        # Whether the layers' products run through oneDNN (quantized matrices do not: their
        # row counts compile no oneDNN kernel, so they are not recorded).
        mats = [lw.qkv if lw.mla is None else lw.mla.qkv_a for lw in weights.layers]
        first = next((m for m in mats if m is not None), None)
        self._onednn_layers = isinstance(first, torch.Tensor) and first.is_mkldnn
        self.weights = weights
        self.attention = attention
        # bfloat16 on a CPU with the native kernels (the attention backend's choice): the
        # residual add and RMSNorm as one call, RoPE as one call, bitwise what the torch ops
        # give (tests/unit/test_cpu_ops.py).
        native = getattr(attention, "decode_kernel", None)
        self.fused_ops = native if dtype == torch.bfloat16 else None
        # On CUDA with the Triton backend the same three as Triton kernels
        # (tandem.kernels.fused): the residual add and RMSNorm, RoPE, SiLU * up, one launch
        # each instead of ~20 per layer, which an eager (mixed prefill + decode) step pays
        # in host time. The torch backend (chosen where Triton cannot launch) keeps torch ops.
        self.triton_ops = triton_ops_for(weights.embed.device, attention)
        self.rope = RotaryEmbedding(config, max_positions, weights.embed.device)
        feat = config.features
        # Gemma 3's sliding layers rotate with their own base
        self.local_rope = (
            RotaryEmbedding(config, max_positions, weights.embed.device, local=True)
            if feat.local_rope is not None
            else None
        )
        self.norm = offset_rms_norm if feat.offset_norms else rms_norm
        # Qwen3-Next's linear layers: each request's state (tandem.model.linear_attention),
        # and the prefix cache's checkpoints of it (tandem.engine.state_checkpoints)
        self.linear_states: LinearStates | None = None
        self.linear_checkpoints: LinearStates | None = None
        self._linear_index = {layer: i for i, layer in enumerate(feat.linear_layers)}
        # each attention layer's (KV table, slot in the cache's blocks)
        self._kv_place = {layer: config.kv_layout.place(layer) for layer in config.kv_layers}
        if feat.linear is not None:
            n, device = len(feat.linear_layers), weights.embed.device
            self.linear_states = LinearStates(feat.linear, n, dtype, device)
            self.linear_checkpoints = LinearStates(feat.linear, n, dtype, device)
        self.scale = feat.attn_scale or config.head_dim**-0.5
        self._q_size = config.num_q_heads * config.head_dim
        self._kv_size = config.num_kv_heads * config.head_dim
        # Tokens routed to each expert of each sparse layer since load (metrics read it; on
        # CUDA a captured decode graph counts its padding rows too).
        self.expert_counts: torch.Tensor | None = None  # [num_sparse_layers, num_experts]
        self._count_rows: dict[int, int] = {}  # layer -> its row of expert_counts
        if config.moe is not None:
            layers = config.moe.sparse_layers
            self.expert_counts = torch.zeros(
                len(layers), config.moe.num_experts, dtype=torch.int64, device=weights.embed.device
            )
            self._count_rows = {layer: row for row, layer in enumerate(layers)}

    def _pack_row_parallel(self, w: Weight, dtype: torch.dtype) -> Weight:
        """A row-parallel matrix: in float32 as loaded ([in, out]) where `reduce_f32`, else
        as `_pack` gives it."""
        if self.reduce_f32 and isinstance(w, torch.Tensor):
            return w.float()
        if self.reduce_f32 and isinstance(w, QuantizedWeight):
            # multiplied in float32 too: dequantized to float32 per call (the reference path)
            return pack_quantized(w, torch.float32, self.workspace, QuantPath.DEQUANT)
        return self._pack(w, dtype)

    def _row_parallel(self, x: torch.Tensor, w: Weight) -> torch.Tensor:
        """x [n, in] times this rank's rows of a row-parallel matrix, summed over the ranks,
        in x's dtype: where `reduce_f32`, multiplied and summed in float32, rounded once."""
        assert self.tp is not None
        if isinstance(w, QuantLinear):
            # fp8 quantizes its input per token: with the whole token's absmax (over every
            # rank's columns), so each rank's e4m3 values are one rank's (exact to TP=1)
            absmax = None
            if w.scheme is WeightScheme.FP8:
                absmax = self.tp.all_reduce_max(x.float().abs().amax(dim=-1, keepdim=True))
            if not self.reduce_f32:
                return self.tp.all_reduce(quant_matmul(x, w, act_absmax=absmax))
            return self.tp.all_reduce(quant_matmul(x.float(), w, act_absmax=absmax)).to(x.dtype)
        if not self.reduce_f32:
            return self.tp.all_reduce(matmul(x, w, self.matmul))
        if isinstance(w, torch.Tensor):  # float32 (_pack_row_parallel)
            xf = x.float()
            if xf.shape[0] == 1:
                # One row takes torch's CPU matrix-vector kernel, whose sums come out in
                # another order than the GEMM's for any other row count (which agree with
                # each other): two rows keep a token's output the same whatever its batch,
                # as one rank's bfloat16 GEMM does (a cached prefix must match a recompute).
                return self.tp.all_reduce((xf.expand(2, -1) @ w)[:1]).to(x.dtype)
            return self.tp.all_reduce(xf @ w).to(x.dtype)
        return self.tp.all_reduce(matmul(x, w, self.matmul).float()).to(x.dtype)

    def _output_split(self, x: torch.Tensor, w: Weight, widths: tuple[int, ...]) -> torch.Tensor:
        """x [n, widths[rank]] (this rank's heads or intermediate columns) times a matrix
        split by its outputs (Shard.exact_sums): the ranks' inputs gathered whole, this
        rank's output columns computed over all of it, the ranks' columns gathered."""
        assert self.tp is not None
        whole = self.tp.all_gather_columns(x, widths)
        return self.tp.all_gather_columns(matmul(whole, w, self.matmul), self._widths[2])

    def _pack(self, w: Weight, dtype: torch.dtype) -> Weight:
        if isinstance(w, QuantizedWeight):
            return pack_quantized(w, dtype, self.workspace)
        if isinstance(w, torch.Tensor) and self.matmul is not MatmulKind.PLAIN:
            return pack(w, self.matmul)
        return w

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_cache: torch.Tensor,
    ) -> torch.Tensor:
        """Run all layers over a flat token batch.

        Args:
            input_ids: [num_tokens] int64
            positions: [num_tokens] int64
            meta: where each token's KV goes and what it attends to.
            kv_cache: [num_blocks, slots, 2, block_size, num_kv_heads, head_dim]

        Returns:
            Final hidden states after the last norm, [num_tokens, hidden].
        """
        cfg, w, mm = self.config, self.weights, self.matmul
        eps = cfg.rms_norm_eps
        feat = cfg.features
        h = self._embed(input_ids)  # [num_tokens, hidden]
        if feat.embed_scale is not None:  # in the model's dtype, as transformers rounds it
            h = h * torch.tensor(feat.embed_scale, dtype=h.dtype, device=h.device)
        cos, sin = self.rope.tables(positions, h.dtype)
        local = self.local_rope.tables(positions, h.dtype) if self.local_rope else (cos, sin)
        n = input_ids.shape[0]
        if self._onednn_layers:
            self.onednn_row_counts.add(onednn_rows(n))
        pending: torch.Tensor | None = None  # the last layer's MLP output, not yet added to h
        for layer_idx, lw in enumerate(w.layers):
            h, x = self._add_norm(h, pending, lw.input_norm, eps)
            if lw.linear is not None:
                assert feat.linear is not None and self.linear_states is not None
                assert meta.state_rows is not None, "the runner names each request's state"
                o = gdn_forward(
                    x, lw.linear, feat.linear, self.linear_states,
                    self._linear_index[layer_idx], meta.state_rows, self._project, eps,
                )  # fmt: skip
            else:
                tables = local if feat.window(layer_idx) is not None else (cos, sin)
                table, slot = self._kv_place[layer_idx]
                kv = kv_cache[:, slot]
                if lw.mla is not None:
                    assert feat.mla is not None
                    o = mla_forward(
                        x, lw.mla, feat.mla, cfg.num_q_heads, tables, meta.table(table), kv,
                        self.scale, self._project, self.norm, eps,
                        partial(self._o_proj, o=lw.mla.o, bias=None) if self._reduce_o else None,
                    )  # fmt: skip
                else:
                    o = self._attention(x, lw, layer_idx, tables, meta.table(table), kv)
            if lw.attn_out_norm is not None:
                o = self.norm(o, lw.attn_out_norm, eps)
            h, x = self._add_norm(h, o, lw.post_norm, eps)
            if lw.moe is not None:
                assert cfg.moe is not None
                assert self.expert_counts is not None
                row = self.expert_counts[self._count_rows[layer_idx]]
                # with TP, this rank's columns of every expert: a partial sum, like down's
                # (in float32 where reduce_f32: the experts' down matrices are float32)
                pending = moe_forward(x, lw.moe, cfg.moe, row)
                if self.tp is not None:
                    pending = self.tp.all_reduce(pending).to(x.dtype)
            else:
                assert lw.gate_up is not None and lw.down is not None
                gate_up = matmul(x, lw.gate_up, mm)
                if feat.activation == "gelu_tanh":
                    gate, up = gate_up.chunk(2, dim=-1)
                    act = F.gelu(gate, approximate="tanh") * up
                elif self.triton_ops:
                    from tandem.kernels.fused import silu_mul

                    act = silu_mul(gate_up)
                else:
                    gate, up = gate_up.chunk(2, dim=-1)
                    act = F.silu(gate) * up
                if self._exact:
                    pending = self._output_split(act, lw.down, self._widths[1])
                elif self.tp is not None:
                    pending = self._row_parallel(act, lw.down)
                else:
                    pending = matmul(act, lw.down, mm)
            if lw.mlp_out_norm is not None:
                pending = self.norm(pending, lw.mlp_out_norm, eps)
        return self._add_norm(h, pending, w.final_norm, eps)[1]

    def _attention(
        self,
        x: torch.Tensor,
        lw: LayerWeights,
        layer_idx: int,
        tables: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
        kv_layer: torch.Tensor,
    ) -> torch.Tensor:
        """A full or sliding attention layer over x [n, hidden] (normed): its output
        projection's [n, hidden]."""
        cfg, feat, eps = self.config, self.config.features, self.config.rms_norm_eps
        assert lw.qkv is not None and lw.o is not None
        n = x.shape[0]
        qkv = matmul(x, lw.qkv, self.matmul, lw.qkv_bias)
        gate = None
        if feat.attn_gate:  # Qwen3-Next: each query head followed by its output gate
            qg, kv = qkv.split([2 * self._q_size, 2 * self._kv_size], dim=-1)
            qg = qg.view(n, cfg.num_q_heads, 2 * cfg.head_dim)
            gate = qg[..., cfg.head_dim :].reshape(n, self._q_size)
            k, v = kv.split([self._kv_size, self._kv_size], dim=-1)
            k = k.view(n, cfg.num_kv_heads, cfg.head_dim)
            qk = torch.cat((qg[..., : cfg.head_dim], k), dim=1)
        else:
            qk, v = qkv.split([self._q_size + self._kv_size, self._kv_size], dim=-1)
            qk = qk.view(n, cfg.num_q_heads + cfg.num_kv_heads, cfg.head_dim)
        v = v.view(n, cfg.num_kv_heads, cfg.head_dim)
        if lw.q_norm is not None and lw.k_norm is not None:
            q, k = qk.split([cfg.num_q_heads, cfg.num_kv_heads], dim=1)
            qk = torch.cat((self.norm(q, lw.q_norm, eps), self.norm(k, lw.k_norm, eps)), 1)
        c, s = tables  # cos, sin
        # Query and key heads rotated together: one set of element-wise ops, not two.
        if feat.rotary_dim is not None:  # partial RoPE: the first rotary_dim dims only
            rd = feat.rotary_dim
            qk = torch.cat((apply_rotary(qk[..., :rd], c, s), qk[..., rd:]), dim=-1)
        elif self.fused_ops is not None:  # bfloat16: the same roundings in one call
            qk = cpu_ops.rope(self.fused_ops, qk, c, s)
        elif self.triton_ops and cfg.head_dim & (cfg.head_dim - 1) == 0:
            from tandem.kernels.fused import rope

            qk = rope(qk, c, s)
        else:
            qk = apply_rotary(qk, c, s)
        q, k = qk.split([cfg.num_q_heads, cfg.num_kv_heads], dim=1)
        attn = self.attention.forward(
            q, k, v, kv_layer, meta, self.scale, feat.window(layer_idx), lw.sinks
        ).reshape(n, self._q_size)
        if gate is not None:
            attn = attn * torch.sigmoid(gate)
        return self._o_proj(attn, lw.o, lw.o_bias)

    def _o_proj(self, attn: torch.Tensor, o: Weight, bias: torch.Tensor | None) -> torch.Tensor:
        """o over the heads' outputs attn [n, heads * head width]: [n, hidden]."""
        if self._exact and self._reduce_o:  # every head's output, this rank's columns
            return self._output_split(attn, o, self._widths[0])
        if self._reduce_o:  # row-parallel: each rank's heads' share of the sum
            return self._row_parallel(attn, o)
        return matmul(attn, o, self.matmul, bias)

    def _project(self, x: torch.Tensor, w: Weight) -> torch.Tensor:
        return matmul(x, w, self.matmul)

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """[num_tokens] -> [num_tokens, hidden]. Vocabulary-parallel: each rank looks up
        the ids in its rows and adds zeros for the rest; the all-reduce sums one real row
        and zeros per token, exactly."""
        embed = self.weights.embed
        if self.tp is None:
            return F.embedding(input_ids, embed)
        start = self.tp.rank * embed.shape[0]
        local = input_ids - start
        outside = (local < 0) | (local >= embed.shape[0])
        h = F.embedding(local.masked_fill(outside, 0), embed)
        h.masked_fill_(outside.unsqueeze(-1), 0.0)
        return self.tp.all_reduce(h)

    def _add_norm(
        self, h: torch.Tensor, y: torch.Tensor | None, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(h + y, rms_norm(h + y)); y None: (h, rms_norm(h)). The native path adds in place
        (h is the forward's own residual stream)."""
        if self.config.features.offset_norms:  # the fused kernels are Llama's RMSNorm
            h = h if y is None else h + y
            return h, offset_rms_norm(h, weight, eps)
        if self.fused_ops is not None and h.is_contiguous():
            return h, cpu_ops.add_rms_norm(self.fused_ops, h, y, weight, eps)
        if (
            self.triton_ops
            and h.stride(-1) == 1
            and weight.dtype == h.dtype
            and (y is None or (y.dtype == h.dtype and y.stride(-1) == 1))
        ):
            from tandem.kernels.fused import add_rms_norm

            return h, add_rms_norm(h, y, weight, eps)
        if y is not None:
            h = h + y
        return h, rms_norm(h, weight, eps)

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [num_rows, hidden] -> logits [num_rows, vocab] in float32 (on every rank
        of a tensor-parallel group)."""
        if self.weights.lm_head.is_mkldnn:
            self.onednn_row_counts.add(onednn_rows(hidden.shape[0]))
        logits = linear.lm_head_matmul(hidden, self.weights.lm_head, self.matmul)
        if self.tp is not None:  # [rows, vocab / tp] per rank, the padding dropped
            logits = self.tp.all_gather_last(logits)[:, : self.config.vocab_size]
        cap = self.config.features.final_softcap
        if cap is not None:  # Gemma's soft cap, in the model's dtype as transformers has it
            logits = torch.tanh(logits / cap) * cap
        return logits.float()

    def onednn_products(
        self, max_rows: int, max_logit_rows: int
    ) -> list[tuple[torch.Tensor, torch.Tensor | None, list[int]]]:
        """Every oneDNN product the forward can ask for, as (packed matrix [out, in], bias,
        row counts): each distinct packed layer matrix (shape, dtype, bias or not) at every
        `onednn_rows` count of 1..max_rows rows, the lm_head at 1..max_logit_rows. Empty
        when the matmul is not oneDNN."""
        if self.matmul is not MatmulKind.ONEDNN:
            return []
        w = self.weights
        body: dict[tuple[object, ...], tuple[torch.Tensor, torch.Tensor | None]] = {}
        for lw in w.layers:
            pairs: list[tuple[Weight | None, torch.Tensor | None]] = [
                (lw.qkv, lw.qkv_bias), (lw.o, None), (lw.gate_up, None), (lw.down, None)
            ]  # fmt: skip
            if lw.linear is not None:
                pairs += [(lw.linear.qkvz, None), (lw.linear.out, None)]
            if lw.mla is not None:
                pairs += [(m, None) for m in lw.mla.packed()]
            for m, bias in pairs:
                if isinstance(m, torch.Tensor) and m.is_mkldnn:  # packed by `pack`
                    key = (tuple(m.shape), m.dtype, bias is not None)
                    body.setdefault(key, (m, bias))
        products = [(m, bias, onednn_row_counts(max_rows)) for m, bias in body.values()]
        if w.lm_head.is_mkldnn:
            products.append((w.lm_head, None, onednn_row_counts(max_logit_rows)))
        return products

    @torch.inference_mode()
    def compile_matmuls(self, max_rows: int, max_logit_rows: int) -> int:
        """oneDNN: compile now the kernel of every product the forward can ask for
        (`onednn_products`), so a worker's memory is at its bound before traffic, not
        filling towards it for hours (oneDNN keeps ~0.5 MiB per kernel; BENCHMARKS.md
        "The prefill worker's memory"). This rank's matrices only: no collective. Returns
        the number of products run; 0 when the matmul is not oneDNN."""
        runs = 0
        for m, bias, counts in self.onednn_products(max_rows, max_logit_rows):
            # Largest first, so each product's output fits in the memory its predecessor
            # freed (smallest first, the heap kept 385 MiB of freed outputs:
            # benchmarks/bench_warmup_compile.py)
            zeros = torch.zeros(counts[-1], m.shape[1], dtype=m.dtype, device=m.device)
            for rows in reversed(counts):
                matmul(zeros[:rows], m, self.matmul, bias)
                runs += 1
            self.onednn_row_counts.update(counts)
        return runs
