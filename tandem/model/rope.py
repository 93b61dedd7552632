"""Rotary position embeddings (non-interleaved, "rotate half"), as in HF Llama."""

from __future__ import annotations

import math

import torch

from tandem.model.config import ModelConfig


def inv_freq(config: ModelConfig, device: torch.device) -> torch.Tensor:
    """RoPE inverse frequencies with the config's scaling. Returns: [head_dim // 2] float32.

    Computed in float32 on `device` exactly as transformers does, so cos/sin match bit for bit.
    """
    dim = config.head_dim
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device=device).to(torch.float32) / dim
    freq = 1.0 / (config.rope_theta**exponents)
    sc = config.rope_scaling
    if sc is None:
        return freq
    if sc.rope_type == "linear":
        return freq / sc.factor
    # llama3: keep high frequencies, divide low ones by `factor`, interpolate in between.
    low_wavelen = sc.original_max_position_embeddings / sc.low_freq_factor
    high_wavelen = sc.original_max_position_embeddings / sc.high_freq_factor
    wavelen = 2 * math.pi / freq
    scaled = torch.where(wavelen > low_wavelen, freq / sc.factor, freq)
    smooth = (sc.original_max_position_embeddings / wavelen - sc.low_freq_factor) / (
        sc.high_freq_factor - sc.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / sc.factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding:
    """Precomputed cos/sin tables for positions [0, max_positions)."""

    def __init__(self, config: ModelConfig, max_positions: int, device: torch.device) -> None:
        freq = inv_freq(config, device)
        positions = torch.arange(max_positions, device=device, dtype=torch.int64).float()
        freqs = positions[:, None] * freq[None, :]  # [max_positions, head_dim // 2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [max_positions, head_dim]
        self.cos = emb.cos()
        self.sin = emb.sin()
        self.max_positions = max_positions

    def tables(
        self, positions: torch.Tensor, dtype: torch.dtype
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin for `positions` ([num_tokens]); each [num_tokens, 1, head_dim] in `dtype`."""
        cos = self.cos[positions].unsqueeze(1).to(dtype)
        sin = self.sin[positions].unsqueeze(1).to(dtype)
        return cos, sin


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [num_tokens, num_heads, head_dim]; cos/sin: [num_tokens, 1, head_dim]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
