"""`tandem` command line: make-tiny-model, generate, up, ctl, sim."""

from __future__ import annotations

import argparse
import dataclasses
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from tandem.config import CacheConfig, EngineConfig, SpeculativeConfig
from tandem.services.cli.model import (
    DEFAULT_MODEL_DIR,
    DEFAULT_MODEL_ENV,
    MODEL_CACHE_DIR,
    MODEL_HELP,
    ensure_default_model,
    ensure_random_model,
    kv_cache_bytes,
    resolve_draft_model,
    resolve_model,
    up_kv_cache,
)

__all__ = [
    "DEFAULT_MODEL_DIR", "DEFAULT_MODEL_ENV", "MODEL_CACHE_DIR", "ensure_default_model",
    "ensure_random_model", "main", "resolve_model", "up_kv_cache",
]  # fmt: skip


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
    from tandem.weights.tiny import make_tiny_model, num_params

    out = make_tiny_model(
        args.dir, preset=args.preset, seed=args.seed, progress=lambda m: print(m, file=sys.stderr)
    )
    print(f"wrote {args.preset} model ({num_params(args.preset) / 1e6:.1f}M params) to {out}")
    return 0


# `tandem generate` flags that are SamplingParams fields (same names, local or remote).
_SAMPLING_FLAGS = (
    "max_tokens",
    "temperature",
    "top_k",
    "top_p",
    "min_p",
    "repetition_penalty",
    "seed",
    "stop",
    "ignore_eos",
)


def _sampling_kwargs(args: argparse.Namespace) -> dict[str, object]:
    kwargs = {name: getattr(args, name) for name in _SAMPLING_FLAGS}
    kwargs["stop"] = tuple(args.stop)
    return kwargs


def _sampling_params(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    from tandem.engine.sampling import SamplingParams

    return SamplingParams(**_sampling_kwargs(args))  # type: ignore[arg-type]


def cmd_generate_remote(args: argparse.Namespace) -> int:
    from tandem.client import TandemClient, TandemError

    sampling = _sampling_kwargs(args)
    prompts = list(args.prompt) or [sys.stdin.read()]
    with TandemClient(args.router) as client:
        for prompt in prompts:
            kwargs = {"messages": [{"role": "user", "content": prompt}]} if args.chat else {}
            try:
                for chunk in client.stream(None if args.chat else prompt, **kwargs, **sampling):
                    out = (
                        " ".join(map(str, chunk.token_ids)) + " " if args.token_ids else chunk.text
                    )
                    print(out, end="", flush=True)
            except TandemError as exc:
                print(f"\nerror: {exc}", file=sys.stderr)
                return 2
            print()
    return 0


def cmd_generate(args: argparse.Namespace) -> int:
    from tandem.engine.engine import LLMEngine
    from tandem.gpus import check_device

    if args.router:
        return cmd_generate_remote(args)
    engine_config = _engine_config(args)  # a bad engine flag exits 2, before a model is fetched
    model_dir = resolve_model(args.model)
    try:
        params = _sampling_params(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    draft_model = resolve_draft_model(engine_config.speculative.draft_model)
    speculative = dataclasses.replace(engine_config.speculative, draft_model=draft_model)
    config = dataclasses.replace(engine_config, model_dir=str(model_dir), speculative=speculative)
    try:
        check_device(config.device, config.cache.gpu_memory_utilization)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
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
    finally:
        engine.close()  # its other ranks, with --tensor-parallel-size
    for c in done:
        print(c.text if not args.token_ids else " ".join(map(str, c.token_ids)))
    n = sum(len(c.token_ids) for c in done)
    print(f"[{n} tokens in {elapsed:.2f}s, {n / elapsed:.1f} tok/s]", file=sys.stderr)
    return 0


# The engine flags `tandem generate` shares with `tandem up`: UpConfig's fields, one definition
# (name, help, TANDEM_* variable) for both.
ENGINE_FLAGS = (
    "device",
    "dtype",
    "quantization",
    "quantization_group_size",
    "kv_cache_dtype",
    "kv_cache_bytes",
    "kv_host_bytes",
    "kv_disk_dir",
    "kv_disk_bytes",
    "gpu_memory_utilization",
    "tensor_parallel_size",
    "expert_parallel",
    "replicate_attention",
    "tp_exact_sums",
    "cpu_matmul",
    "speculative",
    "num_speculative_tokens",
    "speculative_max_batch",
    "speculative_ngram_max",
    "speculative_ngram_min",
    "speculative_suffix_share",
    "speculative_adaptive",
    "draft_model",
)


def _add_up_flags(parser: argparse.ArgumentParser, only: Sequence[str] | None = None) -> None:
    """`tandem up`'s flags (`only`: just those): one per UpConfig field and its TANDEM_*
    variable, generated by tandem.services.common.runtime.flags (help: UpConfig's docstring),
    then the hand-written ones that are no field of it."""
    import shlex

    from tandem.services.cli.up import SET_BY_CLI
    from tandem.services.common.runtime.flags import add_flags
    from tandem.services.up import UpConfig  # the CLI's one way into services, as in cmd_up

    add_flags(
        parser,
        UpConfig,
        skip=SET_BY_CLI,
        only=only,
        # None: asked for no size (`tandem up` sizes the cache from the model, `tandem
        # generate` takes the engine's default).
        defaults={"kv_cache_bytes": None},
        converters={"controller_args": lambda raw: tuple(shlex.split(raw))},
    )
    # -- hand-written: no field of UpConfig
    parser.add_argument(
        "--kv-cache-mb", type=int, default=None, help="(old spelling of --kv-cache-bytes) MiB"
    )


def _engine_config(args: argparse.Namespace) -> EngineConfig:
    """`tandem generate`'s engine from the engine flags, validated (a bad value exits 2 naming
    its flag); model_dir is --model as given."""
    from tandem.services.common.runtime.flags import usage_error
    from tandem.services.up.config import SPECULATIVE_FIELDS

    try:
        return EngineConfig(
            model_dir=args.model or "",
            device=args.device,
            dtype=args.dtype,
            quantization=args.quantization,
            quantization_group_size=args.quantization_group_size,
            kv_cache_dtype=args.kv_cache_dtype,
            tensor_parallel_size=args.tensor_parallel_size,
            expert_parallel=args.expert_parallel,
            replicate_attention=args.replicate_attention,
            tp_exact_sums=args.tp_exact_sums,
            cpu_matmul=args.cpu_matmul,
            cache=CacheConfig(
                kv_cache_bytes=kv_cache_bytes(args),
                gpu_memory_utilization=args.gpu_memory_utilization,
                kv_host_bytes=args.kv_host_bytes,
                kv_disk_dir=args.kv_disk_dir,
                kv_disk_bytes=args.kv_disk_bytes,
            ),
            speculative=SpeculativeConfig(
                **{name: getattr(args, up) for name, up in SPECULATIVE_FIELDS.items()}
            ),
        )
    except ValueError as exc:
        # SpeculativeConfig's messages name its own fields (max_batch: --speculative-max-batch).
        names = [*ENGINE_FLAGS, *SPECULATIVE_FIELDS]
        flags = {
            name: "--" + SPECULATIVE_FIELDS.get(name, name).replace("_", "-") for name in names
        }
        if args.kv_cache_mb is not None:
            flags["kv_cache_bytes"] = "--kv-cache-mb"
        usage_error(args.parser, exc, flags)


def cmd_up(args: argparse.Namespace) -> int:
    from tandem.services.cli.up import cmd_up as up

    return up(args)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tandem", description=__doc__)
    sub = p.add_subparsers(dest="command", required=True)

    m = sub.add_parser("make-tiny-model", help="write a deterministic random Llama-style model")
    m.add_argument("dir", type=Path)
    m.add_argument("--preset", default="tiny", choices=["tiny", "medium", "small"])
    m.add_argument("--seed", type=int, default=0)
    m.set_defaults(func=cmd_make_tiny_model)

    g = sub.add_parser("generate", help="generate text in this process")
    g.add_argument("prompt", nargs="*", help="prompts (stdin when none)")
    g.add_argument("--model", help=MODEL_HELP)
    g.add_argument("--router", help="generate through a running router at host:port")
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
    _add_up_flags(g, only=ENGINE_FLAGS)
    g.set_defaults(func=cmd_generate, parser=g)

    u = sub.add_parser(
        "up",
        help="start a local cluster: redis, router, prefill, decode",
        description="Start a local cluster: Redis, router, prefill and decode workers. Every "
        "setting of tandem.services.up.UpConfig is a flag here and a TANDEM_* variable (the "
        "flag wins).",
    )
    # -- hand-written: the model a --model value names (tandem.services.cli.model) sets model_dir
    u.add_argument("--model", help=MODEL_HELP)
    _add_up_flags(u)
    u.set_defaults(func=cmd_up, parser=u)

    from tandem.ctl import add_parser as add_ctl_parser
    from tandem.sim.cli import add_parser as add_sim_parser

    add_ctl_parser(sub)
    add_sim_parser(sub)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))
