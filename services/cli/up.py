"""`tandem up`: a local cluster of real processes, a demo on both paths, and how to call it."""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time
from collections.abc import MutableMapping
from pathlib import Path
from typing import TYPE_CHECKING

from tandem.services.cli.model import (
    requested_kv_cache_bytes,
    resolve_draft_model,
    resolve_model,
    up_kv_cache,
)

if TYPE_CHECKING:
    from tandem.client import TandemClient
    from tandem.services.up import UpConfig

# UpConfig fields that `tandem up` sets itself, not from a flag of their own: the flag that does.
SET_BY_CLI = {"model_dir": "--model"}

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


def up_config(args: argparse.Namespace) -> UpConfig:
    """UpConfig from `tandem up`'s flags and TANDEM_* variables (tandem.services.cli.main adds them,
    one per field), validated before any model is fetched: a bad value exits 2 naming its flag.
    model_dir is --model as given ("": the default model) and kv_cache_bytes the size asked
    for, else the field's default; `resolve` settles both."""
    from tandem.services.common.runtime.flags import build_config, leaves
    from tandem.services.up import UpConfig
    from tandem.services.up.config import SPECULATIVE_FIELDS

    names = {leaf.name for leaf in leaves(UpConfig)}
    values = {name: value for name, value in vars(args).items() if name in names}
    values["model_dir"] = args.model or ""
    # SpeculativeConfig's messages name its own fields (max_batch: --speculative-max-batch).
    names |= set(SPECULATIVE_FIELDS)
    flags = {name: "--" + SPECULATIVE_FIELDS.get(name, name).replace("_", "-") for name in names}
    flags |= SET_BY_CLI
    requested = requested_kv_cache_bytes(args)
    if requested is None:
        del values["kv_cache_bytes"]
    else:
        values["kv_cache_bytes"] = requested
    if args.kv_cache_mb is not None:
        flags["kv_cache_bytes"] = "--kv-cache-mb"
    return build_config(UpConfig, args.parser, values, flags)


def resolve(config: UpConfig, args: argparse.Namespace) -> tuple[UpConfig, str]:
    """`config` with the model directory --model names (fetched or converted once), the draft
    model's --draft-model names (resolved as the model's), and the KV cache asked for, else
    enough for one full context of that model; and a line saying what the cache holds."""
    model_dir = resolve_model(args.model)
    draft_model = resolve_draft_model(config.draft_model)
    requested = requested_kv_cache_bytes(args)
    kv_bytes, kv_line = up_kv_cache(
        model_dir, requested, config.device, config.dtype, config.kv_cache_dtype
    )
    resolved = dataclasses.replace(
        config, model_dir=str(model_dir), draft_model=draft_model, kv_cache_bytes=kv_bytes
    )
    return resolved, kv_line


def drop_up_variables(environ: MutableMapping[str, str]) -> None:
    """Remove the TANDEM_* variables of UpConfig's flags from `environ`: they were `tandem up`'s
    settings, and its children, which inherit its environment, get what they need of them as
    flags (a TANDEM_PORT left there would put every worker on the router's port)."""
    from tandem.services.common.runtime.flags import leaves
    from tandem.services.up import UpConfig

    for leaf in leaves(UpConfig):
        if leaf.name not in SET_BY_CLI:
            environ.pop(leaf.env, None)


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def cmd_up(args: argparse.Namespace) -> int:
    import signal

    from tandem.client import TandemClient
    from tandem.services.up import Cluster, wait_for_router

    config, kv_line = resolve(up_config(args), args)
    model_dir = Path(config.model_dir)
    drop_up_variables(os.environ)
    cluster = Cluster(config)
    print(
        f"starting redis, router, {config.num_prefill} prefill and {config.num_decode} decode "
        f"worker(s) serving {model_dir.name} ...\n{kv_line}",
        file=sys.stderr,
    )
    t0 = time.perf_counter()
    try:
        cluster.start()
    except ValueError as exc:  # the device asked for is not there: checked first
        cluster.stop()
        print(f"error: {exc}", file=sys.stderr)
        return 2
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
