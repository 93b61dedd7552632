"""The decoder's weights as `LlamaModel` holds them: each layer's matrices (transposed, [in,
out], as loaded; or quantized, or packed for their device's matmul), norms and biases, and a
sparse layer's experts or a linear-attention layer's own weights."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.model.linear_attention import LinearWeights
from tandem.model.mla import MlaWeights
from tandem.model.moe import MoeWeights
from tandem.quant.linear import QuantLinear
from tandem.quant.weight import QuantizedWeight

# A layer matrix: dense [in, out] (as loaded, or packed for oneDNN), quantized [out, in] as
# loaded, or quantized and packed for its path (LlamaModel does that).
Weight = torch.Tensor | QuantizedWeight | QuantLinear


@dataclass(slots=True)
class LayerWeights:
    input_norm: torch.Tensor  # [hidden]
    # [hidden, (q_heads + 2 * kv_heads) * head_dim] (Qwen3-Next: each query head followed
    # by its output gate, 2 * q_heads); None in a linear-attention or MLA layer
    qkv: Weight | None
    qkv_bias: torch.Tensor | None  # [(q_heads + 2 * kv_heads) * head_dim]
    q_norm: torch.Tensor | None  # [head_dim] (Qwen3)
    k_norm: torch.Tensor | None  # [head_dim] (Qwen3)
    o: Weight | None  # [q_heads * head_dim, hidden]; None in a linear-attention or MLA layer
    post_norm: torch.Tensor  # [hidden]
    gate_up: Weight | None  # [hidden, 2 * intermediate]; None in a sparse layer
    down: Weight | None  # [intermediate, hidden]; None in a sparse layer
    moe: MoeWeights | None = None  # a sparse layer's router and experts
    o_bias: torch.Tensor | None = None  # [hidden] (gpt-oss)
    sinks: torch.Tensor | None = None  # [q_heads] float32 sink logits (gpt-oss)
    # Gemma 3's sandwich: the attention's and the MLP's outputs normed before each residual
    # add (post_norm is then its pre-feedforward norm); float32, stored as 1 + w
    attn_out_norm: torch.Tensor | None = None  # [hidden]
    mlp_out_norm: torch.Tensor | None = None  # [hidden]
    linear: LinearWeights | None = None  # a Gated DeltaNet layer's (Qwen3-Next)
    mla: MlaWeights | None = None  # a multi-head latent attention layer's (DeepSeek-V3)

    def matrices(self) -> tuple[Weight, ...]:
        """The layer's dense matrices (a sparse layer's experts are not among them)."""
        mats = (self.qkv, self.o, self.gate_up, self.down)
        return tuple(m for m in mats if m is not None)


@dataclass(slots=True)
class ModelWeights:
    embed: torch.Tensor  # [vocab, hidden]
    layers: list[LayerWeights]
    final_norm: torch.Tensor  # [hidden]
    lm_head: torch.Tensor  # [hidden, vocab]; a transposed view of embed when tied (as loaded)

    def num_bytes(self) -> int:
        """Bytes of distinct weight tensors (a tied lm_head counts once); a quantized matrix
        counts its values, scales and zero points."""
        seen: set[int] = set()
        total = 0
        tensors: list[Weight | None] = [self.embed, self.final_norm, self.lm_head]
        for lw in self.layers:
            tensors += [lw.input_norm, lw.qkv, lw.qkv_bias, lw.q_norm, lw.k_norm, lw.o]
            tensors += [lw.post_norm, lw.gate_up, lw.down, lw.o_bias, lw.sinks]
            tensors += [lw.attn_out_norm, lw.mlp_out_norm]
            if lw.linear is not None:
                la = lw.linear
                tensors += [la.qkvz, la.ba, la.conv, la.dt_bias, la.a_log, la.norm, la.out]
            tensors += list(lw.moe.tensors()) if lw.moe is not None else []
            tensors += list(lw.mla.tensors()) if lw.mla is not None else []
        for t in tensors:
            if t is None:
                continue
            if isinstance(t, QuantizedWeight | QuantLinear):
                total += t.num_bytes()
                continue
            # A matrix packed for oneDNN has no storage to point at; it is its own copy.
            key = id(t) if t.is_mkldnn else t.data_ptr()
            if key not in seen:
                seen.add(key)
                total += t.numel() * t.element_size()
        return total
