"""`tandem` command line: make-tiny-model, generate, up, ctl, sim."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from services.cli.model import (
    DEFAULT_MODEL_DIR,
    DEFAULT_MODEL_ENV,
    MODEL_CACHE_DIR,
    MODEL_HELP,
    ensure_default_model,
    ensure_random_model,
    kv_cache_bytes,
    resolve_model,
    up_kv_cache,
)
from tandem.config import MODEL_DTYPES, CacheConfig

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
    from tandem.model.tiny import make_tiny_model, num_params

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
    from tandem.config import EngineConfig
    from tandem.engine.engine import LLMEngine
    from tandem.gpus import check_device

    if args.router:
        return cmd_generate_remote(args)
    model_dir = resolve_model(args.model)
    try:
        params = _sampling_params(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    config = EngineConfig(
        model_dir=str(model_dir),
        device=args.device,
        dtype=args.dtype,
        cache=CacheConfig(
            kv_cache_bytes=kv_cache_bytes(args),
            gpu_memory_utilization=args.gpu_memory_utilization,
        ),
    )
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
    for c in done:
        print(c.text if not args.token_ids else " ".join(map(str, c.token_ids)))
    n = sum(len(c.token_ids) for c in done)
    print(f"[{n} tokens in {elapsed:.2f}s, {n / elapsed:.1f} tok/s]", file=sys.stderr)
    return 0


def _add_engine_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", default="cpu", help="torch device: cpu, cuda, cuda:1")
    parser.add_argument(
        "--dtype",
        default="auto",
        choices=["auto", *MODEL_DTYPES],
        help="model dtype; auto: bfloat16 on CUDA, float32 on CPU",
    )
    _add_kv_cache_flags(parser)


def _add_kv_cache_flags(parser: argparse.ArgumentParser) -> None:
    # The field's own name, as the services' flags; --kv-cache-mb is the old spelling.
    parser.add_argument(
        "--kv-cache-bytes",
        type=int,
        default=None,
        help=f"KV cache per worker on a CPU (default: {CacheConfig().kv_cache_bytes}; `tandem up`: "
        "enough for one full context of the model, at least that)",
    )
    parser.add_argument("--kv-cache-mb", type=int, default=None, help="(old spelling) MiB")
    parser.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=CacheConfig().gpu_memory_utilization,
        help="on a GPU, the fraction of its memory for weights, activations and KV cache "
        "(`tandem up`: of each GPU, split among the workers placed on it)",
    )


def cmd_up(args: argparse.Namespace) -> int:
    from services.cli.up import cmd_up as up

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
    _add_engine_flags(g)
    g.set_defaults(func=cmd_generate)

    u = sub.add_parser("up", help="start a local cluster: redis, router, prefill, decode")
    u.add_argument("--model", help=MODEL_HELP)
    u.add_argument("--port", type=int, default=50051, help="router port (gRPC)")
    u.add_argument(
        "--http-port", type=int, default=8000, help="the OpenAI HTTP API's port; -1: off"
    )
    u.add_argument("--num-prefill", type=int, default=1)
    u.add_argument("--num-decode", type=int, default=1)
    u.add_argument("--transport", default="nixl", choices=["nixl", "local"])
    _add_engine_flags(u)
    u.add_argument(
        "--autoscale", action="store_true", help="run the ratio controller: add/remove workers"
    )
    u.add_argument("--admin-port", type=int, default=50061, help="controller admin API port")
    u.add_argument(
        "--api-keys",
        action="store_true",
        help="require an API key on the router (one is generated and printed)",
    )
    u.add_argument(
        "--controller-args",
        default="",
        help="controller flags (python -m services.controller --help), e.g. '--max-prefill 4'",
    )
    from dataclasses import fields

    from services.up import UpConfig  # the CLI's one way into services, as in cmd_up

    up_default = {f.name: f.default for f in fields(UpConfig)}
    u.add_argument(
        "--max-restarts",
        type=int,
        default=up_default["max_restarts"],
        help="restarts of one process within --restart-window-s before tandem up stops the "
        "cluster and exits 1 (0: the first crash does)",
    )
    u.add_argument("--restart-window-s", type=float, default=up_default["restart_window_s"])
    u.add_argument(
        "--restart-backoff-s",
        type=float,
        default=up_default["restart_backoff_s"],
        help="delay before restarting a crashed process; doubles per crash in the window",
    )
    u.add_argument(
        "--restart-max-backoff-s", type=float, default=up_default["restart_max_backoff_s"]
    )
    u.add_argument(
        "--host-cores",
        type=int,
        default=0,
        help="with --autoscale: the cores the host capacity rule counts (0: measured)",
    )
    u.add_argument(
        "--max-queue-delay-s",
        type=float,
        default=up_default["max_queue_delay_s"],
        help="refuse a request at once (HTTP 429 / RESOURCE_EXHAUSTED, with Retry-After) when "
        "its expected wait for the first token exceeds this; 0: no limit",
    )
    u.set_defaults(func=cmd_up)

    from tandem.ctl import add_parser as add_ctl_parser
    from tandem.sim.cli import add_parser as add_sim_parser

    add_ctl_parser(sub)
    add_sim_parser(sub)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))
