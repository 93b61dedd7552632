"""GPU attention: the Triton paged kernels of `kernels/` behind `AttentionBackend`.

Per layer and step: write the new K/V into their slots (`tandem.kernels.kv_write`), then one launch
for all decode rows (`tandem.kernels.decode_attention`, split-K over the block tables, as many
splits as the step's longest context and the device's SMs call for) and one for all prefill
chunks (`tandem.kernels.prefill_attention`, causal over each chunk's cached prefix and
itself). Nothing is gathered into a workspace and no score matrix is materialised; the
launch grids depend only on tensor shapes, so decode steps can be captured in CUDA graphs.
An MLA model (DeepSeek-V3) attends in tandem.model.mla instead: its decode rows through
`tandem.kernels.mla_decode` over the same paged batch, its prefill chunks in torch.
Triton is imported on first construction: the CPU path never loads it.
"""

from __future__ import annotations

from typing import Any

import torch

from tandem.model.attention import AttentionMetadata
from tandem.model.layer_groups import Mla
from tandem.quant.kv import KVScales, layer_index


class TritonAttention:
    needs_paged_batch = True

    def __init__(self, mla: Mla | None = None) -> None:
        from tandem.kernels import decode_attention
        from tandem.kernels.kv_write import write_kv
        from tandem.kernels.prefill_attention import paged_prefill_attention

        self._write_kv: Any = write_kv
        self._decode: Any = decode_attention.paged_decode_attention
        self._prefill: Any = paged_prefill_attention
        self._choose_num_splits: Any = decode_attention.choose_num_splits
        self._device_num_sms: Any = decode_attention.device_num_sms
        self._num_sms: int | None = None  # read from the device at the first decode
        # Set by the engine for an FP8 cache (tandem.quant.kv): the kernels quantize
        # on write and dequantize on read with the layer's scales.
        self.kv_scales: KVScales | None = None
        self._q_dtype: torch.dtype | None = None  # the model's dtype, with an fp8 cache
        self.mla = mla  # an MLA model's shape: warm_up compiles the MLA decode kernel

    def use_fp8_kv(self, scales: KVScales, dtype: torch.dtype) -> None:
        """The cache is float8_e4m3fn with `scales`; the model computes in `dtype`."""
        self.kv_scales, self._q_dtype = scales, dtype

    def _scales(self, kv_layer: torch.Tensor, kv_offset: int) -> tuple[float, float]:
        if self.kv_scales is None:
            return 1.0, 1.0
        layer = kv_offset + layer_index(kv_layer)
        return self.kv_scales.k[layer], self.kv_scales.v[layer]

    def num_splits(self, kv_layer: torch.Tensor, num_rows: int, max_context_len: int) -> int:
        """The decode kernel's split count for `num_rows` rows whose longest context is
        `max_context_len` tokens (kv_layer: [num_blocks, 2, block_size, kv_heads, dim])."""
        if self._num_sms is None:
            self._num_sms = self._device_num_sms(kv_layer.device)
        block_size, num_kv_heads = kv_layer.shape[2], kv_layer.shape[3]
        max_blocks = -(-max_context_len // block_size)
        return int(self._choose_num_splits(num_rows, num_kv_heads, max_blocks, self._num_sms))

    def warm_up(self, kv_layer: torch.Tensor, num_q_heads: int, max_context_len: int) -> None:
        """Compile the decode kernels for every split padding a step can choose (the
        reduction has a variant per power of two), so none compiles mid-serving: one
        single-row launch per padding, up to the most splits (one row at the longest
        context). Reads block 0 of `kv_layer`; writes nothing to it."""
        if self.mla is not None:
            self._warm_up_mla(self.mla, kv_layer, num_q_heads, max_context_len)
            return
        most = self.num_splits(kv_layer, 1, max_context_len)
        dtype = self._q_dtype or kv_layer.dtype
        q = torch.zeros((1, num_q_heads, kv_layer.shape[4]), dtype=dtype, device=kv_layer.device)
        table = torch.zeros((1, 1), dtype=torch.int32, device=kv_layer.device)
        lens = torch.ones(1, dtype=torch.int32, device=kv_layer.device)
        for i in range((most - 1).bit_length() + 1):
            self._decode(q, kv_layer, table, lens, 1.0, num_splits=min(1 << i, most))

    def _warm_up_mla(
        self, mla: Mla, kv_layer: torch.Tensor, num_q_heads: int, max_context_len: int
    ) -> None:
        """`warm_up` for an MLA model: its decode kernel at every split padding."""
        from tandem.kernels.mla_decode import mla_decode_attention, mla_num_splits

        if self._num_sms is None:
            self._num_sms = self._device_num_sms(kv_layer.device)
        max_blocks = -(-max_context_len // kv_layer.shape[2])
        most = mla_num_splits(1, num_q_heads, max_blocks, self._num_sms)
        dev, dtype = kv_layer.device, kv_layer.dtype
        q_lat = torch.zeros((1, num_q_heads, mla.kv_lora_rank), dtype=dtype, device=dev)
        q_rot = torch.zeros((1, num_q_heads, mla.qk_rope_head_dim), dtype=dtype, device=dev)
        table = torch.zeros((1, 1), dtype=torch.int32, device=dev)
        lens = torch.ones(1, dtype=torch.int32, device=dev)
        for i in range((most - 1).bit_length() + 1):
            mla_decode_attention(
                q_lat, q_rot, kv_layer, table, lens, 1.0, num_splits=min(1 << i, most)
            )

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_layer: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        window: int | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        # q: [num_tokens, num_q_heads, head_dim]; k, v: [num_tokens, num_kv_heads, head_dim]
        paged = meta.paged
        assert paged is not None, "the runner builds AttentionMetadata.paged for this backend"
        k_scale, v_scale = self._scales(kv_layer, meta.kv_offset)
        self._write_kv(k, v, kv_layer, meta.slot_block_ids, meta.slot_offsets, k_scale, v_scale)
        out = torch.empty_like(q)
        nd = paged.num_decode
        if nd:
            self._decode(
                q[:nd],
                kv_layer,
                paged.decode_block_tables,
                paged.decode_context_lens,
                scale,
                num_splits=self.num_splits(kv_layer, nd, paged.max_decode_context_len),
                out=out[:nd],
                k_scale=k_scale,
                v_scale=v_scale,
                window=window,
                sinks=sinks,
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
                k_scale=k_scale,
                v_scale=v_scale,
                window=window,
                sinks=sinks,
            )
        return out


def make_attention(name: str, device: str, mla: Mla | None = None) -> Any:
    """The attention backend `name` for `device`:
      triton  the paged Triton kernels (CUDA; the CPU only under TRITON_INTERPRET=1);
      torch   TorchAttention with torch ops only;
      native  TorchAttention with its decode rows through the native paged CPU kernel
              (tandem.kernels.cpu_ops, built with the system's C compiler);
      auto    Triton on CUDA; on a CPU native when the kernel builds, else torch.
    Every backend takes sliding-window layers and sinks (Gemma 3, gpt-oss). An `mla` model
    (DeepSeek-V3, tandem.model.mla, its shape given) attends in tandem.model.mla from either
    backend's metadata; with triton its decode rows run `tandem.kernels.mla_decode`. Its
    `auto` stays torch on CUDA until that kernel is measured on a GPU (the GPU check's `mla`
    part).

    Raises:
        ValueError: an unknown name, native where the kernel cannot be built.
    """
    from tandem.kernels import cpu_ops
    from tandem.model.attention import TorchAttention

    is_cuda = torch.device(device).type == "cuda"
    if name == "auto":
        if is_cuda and mla is not None:
            return TorchAttention()
        if is_cuda:
            return TritonAttention()
        return TorchAttention(cpu_ops.load())
    if name == "torch":
        return TorchAttention()
    if name == "native":
        lib = None if is_cuda else cpu_ops.load()
        if lib is None:
            raise ValueError(
                "attention_backend native: the CPU kernel is unavailable (a CPU device and a C "
                "compiler are needed; see the log)"
            )
        return TorchAttention(lib)
    if name == "triton":
        return TritonAttention(mla)
    raise ValueError(f"attention_backend must be auto, torch, native or triton, got {name!r}")
