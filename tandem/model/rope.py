"""Rotary position embeddings (non-interleaved, "rotate half"), as in HF Llama."""

from __future__ import annotations

import math

import torch

from tandem.model.config import ModelConfig, RopeScaling


def inv_freq(dim: int, theta: float, sc: RopeScaling | None, device: torch.device) -> torch.Tensor:
    """RoPE inverse frequencies of a `dim`-wide head with base `theta` and scaling `sc`.
    Returns: [dim // 2] float32.

    Computed in float32 on `device` exactly as transformers does, so cos/sin match bit for bit.
    """
    exponents = torch.arange(0, dim, 2, dtype=torch.int64, device=device).to(torch.float32) / dim
    pos = theta**exponents
    freq = 1.0 / pos
    if sc is None:
        return freq
    if sc.rope_type == "linear":
        return freq / sc.factor
    if sc.rope_type == "yarn":
        return _yarn(dim, theta, sc, pos)
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


def _yarn(dim: int, theta: float, sc: RopeScaling, pos: torch.Tensor) -> torch.Tensor:
    """YaRN: the low frequencies interpolated (divided by `factor`), the high ones kept,
    a linear ramp between the dimensions whose wavelengths make beta_slow and beta_fast
    rotations over the original context."""

    def dim_of(rotations: float) -> float:
        wavelengths = sc.original_max_position_embeddings / (rotations * 2 * math.pi)
        return dim * math.log(wavelengths) / (2 * math.log(theta))

    low, high = dim_of(sc.beta_fast), dim_of(sc.beta_slow)
    if sc.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = (torch.arange(dim // 2, dtype=torch.float32, device=pos.device) - low) / (high - low)
    keep = 1 - ramp.clamp(0, 1)  # 1: extrapolate (keep the frequency)
    # pos = theta^e; transformers' order of operations
    return 1.0 / (sc.factor * pos) * (1 - keep) + 1.0 / pos * keep


class RotaryEmbedding:
    """Precomputed cos/sin tables for positions [0, max_positions): the model's, or with
    `local` its sliding layers' own (Gemma 3: `Features.local_rope`)."""

    def __init__(
        self, config: ModelConfig, max_positions: int, device: torch.device, local: bool = False
    ) -> None:
        theta, scaling = config.rope_theta, config.rope_scaling
        if local and config.features.local_rope is not None:
            theta, scaling = config.features.local_rope
        # partial RoPE (Qwen3-Next) rotates the first rotary_dim dims of each head; MLA
        # (DeepSeek-V3) its qk_rope_head_dim dims (config.head_dim is then the cache's)
        mla = config.features.mla
        dim = mla.qk_rope_head_dim if mla else config.features.rotary_dim or config.head_dim
        freq = inv_freq(dim, theta, scaling, device)
        positions = torch.arange(max_positions, device=device, dtype=torch.int64).float()
        freqs = positions[:, None] * freq[None, :]  # [max_positions, head_dim // 2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [max_positions, head_dim]
        scale = scaling.attention_factor if scaling is not None else 1.0
        self.cos = emb.cos() * scale if scale != 1.0 else emb.cos()
        self.sin = emb.sin() * scale if scale != 1.0 else emb.sin()
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
