"""`tandem up`: a local cluster of real processes, a demo on both paths, and how to call it."""

from __future__ import annotations

import argparse
import sys
import time
from typing import TYPE_CHECKING

from services.cli.model import kv_cache_bytes, resolve_model, up_kv_cache

if TYPE_CHECKING:
    from tandem.client import TandemClient

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


def cmd_up(args: argparse.Namespace) -> int:
    import shlex
    import signal

    from services.up import Cluster, UpConfig, wait_for_router
    from tandem.client import TandemClient

    model_dir = resolve_model(args.model)
    requested = (
        None if args.kv_cache_mb is None and args.kv_cache_bytes is None else (kv_cache_bytes(args))
    )
    kv_bytes, kv_line = up_kv_cache(model_dir, requested, args.device, args.dtype)
    config = UpConfig(
        model_dir=str(model_dir),
        port=args.port,
        http_port=args.http_port,
        num_prefill=args.num_prefill,
        num_decode=args.num_decode,
        transport=args.transport,
        kv_cache_bytes=kv_bytes,
        device=args.device,
        gpu_memory_utilization=args.gpu_memory_utilization,
        dtype=args.dtype,
        autoscale=args.autoscale,
        admin_port=args.admin_port,
        controller_args=tuple(shlex.split(args.controller_args)),
        restart_backoff_s=args.restart_backoff_s,
        restart_max_backoff_s=args.restart_max_backoff_s,
        max_restarts=args.max_restarts,
        restart_window_s=args.restart_window_s,
        api_keys=args.api_keys,
        max_queue_delay_s=args.max_queue_delay_s,
        host_cores=args.host_cores,
    )
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
