"""FP8 KV cache: e4m3 storage with one scale per layer for K and one for V.

    stored = fp8_e4m3(clamp(x / scale, -448, 448))      written by the KV-write paths
    x'     = float(stored) * scale                       read inside the attention paths

Scales are per tensor and per layer (`KVScales`). They come from the checkpoint when it has
them (`model.layers.{i}.self_attn.k_scale` / `v_scale`, the layout llm-compressor and vLLM
write; also `...k_proj.output_scale` / `v_proj.output_scale`), else they are 1.0: a fixed
default, chosen over a warm-up calibration because both sides of a hand-off must hold the
*same* scales bit for bit (a calibration on two devices, or two builds, may differ in the
last bit and every hand-off between them would be refused), and because Llama-family K and V
activations lie well inside e4m3's range at scale 1 (largest finite 448, smallest normal
2**-6): the cost is e4m3's 3-bit mantissa, measured in BENCHMARKS.md (issue 28).

The scales and the dtype together are the cache's *KV format* (`kv_format`): the registry
advertises it, the router pairs only workers with equal formats, the hand-off layout carries
it under the signature, and the prefix hashes of an fp8 cache include it.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

KV_CACHE_DTYPES = ("auto", "fp8")
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn value
DEFAULT_SCALE = 1.0
# Checkpoint tensor names of a layer's K and V scales, in the order they are looked for.
_SCALE_NAMES = (
    ("self_attn.k_scale", "self_attn.v_scale"),
    ("self_attn.k_proj.output_scale", "self_attn.v_proj.output_scale"),
)


@dataclass(frozen=True, slots=True)
class KVScales:
    """Per-layer dequantization scales of an FP8 KV cache.

    Attributes:
        k, v: one float32-representable scale per layer (x = stored * scale).
        source: "checkpoint" or "default" (1.0: none in the checkpoint).
    """

    k: tuple[float, ...]
    v: tuple[float, ...]
    source: str = "default"

    def __post_init__(self) -> None:
        if len(self.k) != len(self.v) or not self.k:
            raise ValueError(
                f"need one K and one V scale per layer, got {len(self.k)} and {len(self.v)}"
            )
        for s in (*self.k, *self.v):
            if not (s > 0.0 and s < float("inf")):
                raise ValueError(f"KV scales must be positive and finite, got {s}")
        # Canonical float32 values: the scales are applied in float32 everywhere.
        object.__setattr__(self, "k", tuple(_f32(s) for s in self.k))
        object.__setattr__(self, "v", tuple(_f32(s) for s in self.v))

    @property
    def num_layers(self) -> int:
        return len(self.k)

    def arranged(self, layers: Sequence[int], order: Sequence[int | None]) -> KVScales:
        """The scales of `layers` (one pair each, in that order) re-ordered as the cache
        indexes them (`KVLayout.cache_layers`: a layer per slot, None for an unused one,
        which gets the default scale)."""
        pairs = dict(zip(layers, zip(self.k, self.v, strict=True), strict=True))
        picked = [pairs.get(i, (DEFAULT_SCALE, DEFAULT_SCALE)) if i is not None
                  else (DEFAULT_SCALE, DEFAULT_SCALE) for i in order]  # fmt: skip
        return KVScales(tuple(p[0] for p in picked), tuple(p[1] for p in picked), self.source)

    @classmethod
    def default(cls, num_layers: int) -> KVScales:
        return cls((DEFAULT_SCALE,) * num_layers, (DEFAULT_SCALE,) * num_layers, "default")


def _f32(value: float) -> float:
    return float(struct.unpack("<f", struct.pack("<f", float(value)))[0])


def load_kv_scales(model_dir: str | Path, layers: int | Sequence[int]) -> KVScales:
    """The checkpoint's K/V scales (see the module docstring), else `KVScales.default`:
    one pair per layer of `layers` (a count: layers 0..n-1; or the layers that keep KV,
    `ModelConfig.kv_layers`), in the cache's layer order.

    Raises:
        ValueError: the checkpoint has scales for some layers only, or a scale with more
            than one element (per-head or per-channel scales are not supported).
    """
    from tandem.weights.safetensors_io import TensorReader, read_header, safetensors_files

    indices = range(layers) if isinstance(layers, int) else layers
    entries = {}
    for path in safetensors_files(Path(model_dir)) if Path(model_dir).is_dir() else []:
        entries.update(read_header(path))
    for k_name, v_name in _SCALE_NAMES:
        names = [f"model.layers.{i}.{n}" for i in indices for n in (k_name, v_name)]
        present = [n for n in names if n in entries]
        if not present:
            continue
        if len(present) != len(names):
            missing = sorted(set(names) - set(present))
            raise ValueError(f"the checkpoint has KV scales for some layers only: {missing[:4]}")
        values: list[float] = []
        with TensorReader(entries, names, None) as reader:
            for n in names:
                t = reader.read(n)
                if t.numel() != 1:
                    raise ValueError(
                        f"KV scale {n!r} has shape {tuple(t.shape)}: only per-tensor scales "
                        "are supported"
                    )
                values.append(float(t.float().item()))
        return KVScales(tuple(values[0::2]), tuple(values[1::2]), "checkpoint")
    return KVScales.default(len(indices))


def quantize_kv(x: torch.Tensor, scale: float) -> torch.Tensor:
    """x (any float dtype) -> e4m3 of x / scale, saturated to +-448 (e4m3fn has no inf)."""
    return (x.float() / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def dequantize_kv(x: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """e4m3 `x` -> `dtype`: float32(x) * scale, then rounded to `dtype`."""
    return (x.float() * scale).to(dtype)


def layer_index(kv_layer: torch.Tensor) -> int:
    """Which slot a view `kv_cache[:, slot]` of the block-major cache is (the attention
    backends receive the view, not the index; they add their table's `kv_offset` to find the
    layer's scales):

        kv_cache  [num_blocks, slots, 2, block_size, heads, dim]   contiguous
        kv_layer = kv_cache[:, slot]: storage offset = slot * (2 * block_size * heads * dim)
                                                     = slot * 2 * kv_layer.stride(1)
    """
    per_layer = kv_layer.shape[1] * kv_layer.stride(1)
    assert kv_layer.storage_offset() % per_layer == 0, (kv_layer.storage_offset(), per_layer)
    return kv_layer.storage_offset() // per_layer


def kv_format(dtype: str, scales: KVScales | None) -> str:
    """The cache's KV format: its dtype name, and for a scaled (fp8) cache a digest of every
    scale ("float8_e4m3fn/7c3a90d2e1b4f8a6"). Equal formats hold interchangeable bytes."""
    if scales is None:
        return dtype
    raw = struct.pack(f"<{2 * scales.num_layers}f", *scales.k, *scales.v)
    return f"{dtype}/{hashlib.blake2b(raw, digest_size=8).hexdigest()}"
