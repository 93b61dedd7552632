"""`tandem` command line: make-tiny-model, generate, up."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path

DEFAULT_MODEL_DIR = Path.home() / ".cache" / "tandem" / "models" / "tandem-tiny-small"


def _progress_bar(desc: str):  # type: ignore[no-untyped-def]
    """A tqdm bar on stderr driven as progress(done, total)."""
    from tqdm import tqdm

    bar = None

    def update(done: int, total: int) -> None:
        nonlocal bar
        if bar is None:
            bar = tqdm(total=total, desc=desc, unit="tensor", file=sys.stderr, leave=False)
        bar.update(done - bar.n)
        if done >= total:
            bar.close()

    return update


def cmd_make_tiny_model(args: argparse.Namespace) -> int:
    from tandem.model.tiny import make_tiny_model, num_params

    out = make_tiny_model(
        args.dir, preset=args.preset, seed=args.seed, progress=lambda m: print(m, file=sys.stderr)
    )
    print(f"wrote {args.preset} model ({num_params(args.preset) / 1e6:.1f}M params) to {out}")
    return 0


def ensure_default_model(model_dir: Path, preset: str = "small") -> Path:
    """Generate the embedded default model once (deterministic, so a cache is safe)."""
    if (model_dir / "config.json").is_file() and (model_dir / "model.safetensors").is_file():
        return model_dir
    from tandem.model.tiny import make_tiny_model

    print(f"generating the default model ({preset}) in {model_dir} ...", file=sys.stderr)
    return make_tiny_model(model_dir, preset=preset, progress=lambda m: print(m, file=sys.stderr))


def _sampling_params(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    from tandem.engine.sampling import SamplingParams

    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        repetition_penalty=args.repetition_penalty,
        seed=args.seed,
        stop=tuple(args.stop),
        ignore_eos=args.ignore_eos,
    )


def cmd_generate(args: argparse.Namespace) -> int:
    from tandem.config import CacheConfig, EngineConfig
    from tandem.engine.engine import LLMEngine

    model_dir = Path(args.model) if args.model else ensure_default_model(DEFAULT_MODEL_DIR)
    try:
        params = _sampling_params(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    config = EngineConfig(
        model_dir=str(model_dir), cache=CacheConfig(kv_cache_bytes=args.kv_cache_mb << 20)
    )
    try:
        engine = LLMEngine(config, progress=_progress_bar("loading weights"))
    except (FileNotFoundError, ValueError) as exc:
        print(f"error: cannot load model: {exc}", file=sys.stderr)
        return 2
    print(f"loaded {model_dir} in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
    prompts = list(args.prompt) or [sys.stdin.read()]
    if args.chat:
        if engine.tokenizer is None:
            print("error: --chat needs a tokenizer", file=sys.stderr)
            return 2
        prompts = [
            engine.tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in prompts
        ]
    try:
        t0 = time.perf_counter()
        done = engine.generate(prompts, params)
        elapsed = time.perf_counter() - t0
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    for c in done:
        print(c.text if not args.token_ids else " ".join(map(str, c.token_ids)))
    n = sum(len(c.token_ids) for c in done)
    print(f"[{n} tokens in {elapsed:.2f}s, {n / elapsed:.1f} tok/s]", file=sys.stderr)
    return 0


def cmd_up(args: argparse.Namespace) -> int:
    # Single-process for now: the router/prefill/decode processes come with the serving layer.
    model_dir = Path(args.model) if args.model else ensure_default_model(DEFAULT_MODEL_DIR)
    ns = argparse.Namespace(
        model=str(model_dir),
        prompt=["The quick brown fox"],
        max_tokens=32,
        temperature=0.0,
        top_k=None,
        top_p=1.0,
        min_p=0.0,
        repetition_penalty=1.0,
        seed=None,
        stop=[],
        ignore_eos=False,
        chat=False,
        token_ids=False,
        kv_cache_mb=args.kv_cache_mb,
    )
    print("demo request: 'The quick brown fox' (greedy, 32 tokens)", file=sys.stderr)
    return cmd_generate(ns)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tandem", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    m = sub.add_parser("make-tiny-model", help="write a deterministic random Llama-style model")
    m.add_argument("dir", type=Path)
    m.add_argument("--preset", default="tiny", choices=["tiny", "small"])
    m.add_argument("--seed", type=int, default=0)
    m.set_defaults(func=cmd_make_tiny_model)

    g = sub.add_parser("generate", help="generate text in this process")
    g.add_argument("prompt", nargs="*", help="prompts (stdin when none)")
    g.add_argument("--model", help=f"model directory (default: {DEFAULT_MODEL_DIR})")
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-k", type=int, default=None)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")
    g.add_argument("--chat", action="store_true", help="wrap each prompt in the chat template")
    g.add_argument("--token-ids", action="store_true", help="print token ids, not text")
    g.add_argument("--kv-cache-mb", type=int, default=256)
    g.set_defaults(func=cmd_generate)

    u = sub.add_parser("up", help="start Tandem on embedded defaults")
    u.add_argument("--model", help="model directory (default: generated small model)")
    u.add_argument("--kv-cache-mb", type=int, default=256)
    u.set_defaults(func=cmd_up)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
