"""GPU attention: the Triton paged kernels of `kernels/` behind `AttentionBackend`.

Per layer and step: write the new K/V into their slots (`kernels.kv_write`), then one launch
for all decode rows (`kernels.decode_attention`, split-K over the block tables) and one for
all prefill chunks (`kernels.prefill_attention`, causal over each chunk's cached prefix and
itself). Nothing is gathered into a workspace and no score matrix is materialised; the
launch grids depend only on tensor shapes, so decode steps can be captured in CUDA graphs.
Triton is imported on first construction: the CPU path never loads it.
"""

from __future__ import annotations

from typing import Any

import torch

from tandem.model.attention import AttentionMetadata


class TritonAttention:
    needs_paged_batch = True

    def __init__(self) -> None:
        from kernels.decode_attention import paged_decode_attention
        from kernels.kv_write import write_kv
        from kernels.prefill_attention import paged_prefill_attention

        self._write_kv: Any = write_kv
        self._decode: Any = paged_decode_attention
        self._prefill: Any = paged_prefill_attention

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_layer: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
    ) -> torch.Tensor:
        # q: [num_tokens, num_q_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim]
        paged = meta.paged
        assert paged is not None, "the runner builds AttentionMetadata.paged for this backend"
        self._write_kv(k, v, kv_layer, meta.slot_block_ids, meta.slot_offsets)
        out = torch.empty_like(q)
        nd = paged.num_decode
        if nd:
            self._decode(
                q[:nd],
                kv_layer,
                paged.decode_block_tables,
                paged.decode_context_lens,
                scale,
                out=out[:nd],
            )
        if q.shape[0] > nd:
            self._prefill(
                q[nd:],
                kv_layer,
                paged.prefill_block_tables,
                paged.prefill_query_starts,
                paged.prefill_context_lens,
                paged.max_query_len,
                scale,
                out=out[nd:],
            )
        return out


def make_attention(name: str, device: str) -> Any:
    """The attention backend `name` ("auto", "torch" or "triton") for `device`: auto picks
    Triton on CUDA and the torch CPU path elsewhere.

    Raises:
        ValueError: an unknown name.
    """
    from tandem.model.attention import TorchAttention

    if name == "auto":
        name = "triton" if torch.device(device).type == "cuda" else "torch"
    if name == "torch":
        return TorchAttention()
    if name == "triton":
        return TritonAttention()
    raise ValueError(f"attention_backend must be auto, torch or triton, got {name!r}")
