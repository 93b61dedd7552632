"""What metrics and tracing cost: router ITL and output tokens/s with both on vs both off.

    python benchmarks/bench_observability.py [--quick] [--rounds N] [--model-dir DIR]
        [--results-dir DIR] [--no-markdown-file]

Two identical stacks (one decode worker, 1 torch thread, and one router with a static
`--decode-addresses` list: no Redis, nothing polling in the background) run side by side:
"off" has neither metrics nor tracing; "on" serves /metrics on both processes (scraped once
a second here, as a busy Prometheus would) and exports every span to an OTLP collector in
this process (it accepts and drops them). The same closed-loop workload goes to one stack
at a time, in rounds whose order flips every round (AB BA ...), with fresh prompts per run,
so a drift of the shared machine's speed lands on both alike. The figure is the ratio on/off
of the pooled ITL p50 and of output tokens/s; the issue's target is <= 2% cost.

Results go to <results-dir>/observability.json; a complete, non-quick run into the default
results folder rewrites the "## Observability overhead (issue 16)" section of BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import statistics
import sys
import tempfile
import threading
import urllib.request
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parent))  # siblings import by name
from bench_serving import Server, ensure_model, log
from loadgen import RequestClass, RouterTarget, RunResult, Sla, Workload, run_workload
from report import (
    BENCHMARKS_MD,
    RESULTS_DIR,
    is_default_results_dir,
    machine_info,
    machine_summary,
    result_path,
    write_json,
    write_markdown_section,
)

SECTION = "## Observability overhead (issue 16)"
KV_CACHE_BYTES = 256 << 20
MIX = (RequestClass(1.0, (64, 256), (64, 128), "chat-like"),)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class SpanSink:
    """An OTLP/gRPC trace collector that counts and drops what it receives."""

    def __init__(self) -> None:
        from opentelemetry.proto.collector.trace.v1 import (
            trace_service_pb2,
            trace_service_pb2_grpc,
        )

        sink = self

        class Service(trace_service_pb2_grpc.TraceServiceServicer):
            def Export(self, request, context):  # type: ignore[no-untyped-def]  # noqa: N802
                sink.spans += sum(
                    len(ss.spans) for rs in request.resource_spans for ss in rs.scope_spans
                )
                return trace_service_pb2.ExportTraceServiceResponse()

        self.spans = 0
        self.server = grpc.server(futures.ThreadPoolExecutor(2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Service(), self.server)
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.server.start()

    def stop(self) -> None:
        self.server.stop(grace=None)


class Scraper:
    """GET /metrics of each address once a second, as Prometheus would."""

    def __init__(self, addresses: list[str]) -> None:
        self.addresses = addresses
        self.scrapes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(1.0):
            for a in self.addresses:
                try:
                    with urllib.request.urlopen(f"http://{a}/metrics", timeout=2) as resp:
                        resp.read()
                    self.scrapes += 1
                except OSError:
                    pass

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


def start_stack(name: str, model_dir: Path, log_dir: Path, sink_port: int | None) -> dict:
    """A decode worker and a router; with `sink_port`, metrics and tracing on."""
    metrics: list[str] = []
    extra_d: list[str] = []
    extra_r: list[str] = []
    env: dict[str, str] = {"OTEL_BSP_SCHEDULE_DELAY": "1000"}
    if sink_port is not None:
        pd, pr = free_port(), free_port()
        extra_d = ["--metrics-port", str(pd), "--otlp-endpoint", f"http://127.0.0.1:{sink_port}"]
        extra_r = ["--metrics-port", str(pr), "--otlp-endpoint", f"http://127.0.0.1:{sink_port}"]
        metrics = [f"127.0.0.1:{pd}", f"127.0.0.1:{pr}"]
    decode = Server(
        f"{name}-decode",
        ["-m", "tandem.services.decode", "--model-dir", str(model_dir), "--port", "0",
         "--transport", "local", "--kv-cache-bytes", str(KV_CACHE_BYTES),
         "--num-threads", "1", *extra_d],
        log_dir, env,
    )  # fmt: skip
    router = Server(
        f"{name}-router",
        ["-m", "tandem.services.router", "--model-dir", str(model_dir), "--port", "0",
         "--decode-addresses", decode.address, *extra_r],
        log_dir, env,
    )  # fmt: skip
    return {"decode": decode, "router": router, "metrics": metrics}


def one_run(address: str, workload: Workload) -> RunResult:
    async def go() -> RunResult:
        target = RouterTarget(address)
        try:
            return await run_workload(target, workload)
        finally:
            await target.close()

    return asyncio.run(go())


def measure(args: argparse.Namespace) -> dict[str, Any]:
    model_dir = ensure_model(Path(args.model_dir))
    log_dir = Path(tempfile.mkdtemp(prefix="tandem-bench-obs-"))
    sink = SpanSink()
    stacks = {
        "off": start_stack("off", model_dir, log_dir, None),
        "on": start_stack("on", model_dir, log_dir, sink.port),
    }
    scraper = Scraper(stacks["on"]["metrics"])
    requests, concurrency = (6, 3) if args.quick else (16, 4)
    runs: dict[str, list[dict[str, Any]]] = {"off": [], "on": []}
    pooled: dict[str, list[RunResult]] = {"off": [], "on": []}
    try:
        for mode in ("off", "on"):  # warm both: allocator, first-request paths
            one_run(stacks[mode]["router"].address, _workload(2, concurrency, 10_000))
        for rnd in range(args.rounds):
            order = ("off", "on") if rnd % 2 == 0 else ("on", "off")
            for mode in order:
                # Same shape per round, fresh token contents per run (no prefix-cache hits).
                w = _workload(requests, concurrency, rnd * 2 + (mode == "on"), seed=rnd)
                res = one_run(stacks[mode]["router"].address, w)
                s = res.summary(_SLA)
                pooled[mode].append(res)
                runs[mode].append(
                    {"round": rnd, "itl_p50_ms": s["itl_ms"]["p50"],
                     "tok_s": s["throughput_tok_s"], "failed": s["num_failed"]}
                )  # fmt: skip
                log(f"round {rnd} {mode}: ITL p50 {s['itl_ms']['p50']:.2f} ms, "
                    f"{s['throughput_tok_s']:.0f} tok/s")  # fmt: skip
    finally:
        scraper.stop()
        for stack in stacks.values():
            stack["router"].stop()
            stack["decode"].stop()
        sink.stop()
    summary = {m: RunResult.concat(pooled[m]).summary(_SLA) for m in pooled}
    itl_ratio = summary["on"]["itl_ms"]["p50"] / summary["off"]["itl_ms"]["p50"]
    tok_ratio = summary["on"]["throughput_tok_s"] / summary["off"]["throughput_tok_s"]
    pairs = zip(runs["on"], runs["off"], strict=True)
    pair_itl = [on["itl_p50_ms"] / off["itl_p50_ms"] for on, off in pairs]
    return {
        "benchmark": "observability overhead",
        "command": "python benchmarks/bench_observability.py" + (" --quick" if args.quick else ""),
        "machine": machine_info(),
        "rounds": args.rounds,
        "requests_per_run": requests,
        "concurrency": concurrency,
        "runs": runs,
        "pooled": {
            m: {
                "itl_ms": summary[m]["itl_ms"],
                "tok_s": summary[m]["throughput_tok_s"],
                "failed": summary[m]["num_failed"],
            }
            for m in summary
        },  # fmt: skip
        "itl_p50_ratio_on_off": itl_ratio,
        "tok_s_ratio_on_off": tok_ratio,
        "itl_p50_ratio_median_of_rounds": statistics.median(pair_itl),
        "spans_exported": sink.spans,
        "scrapes": scraper.scrapes,
        "log_dir": str(log_dir),
    }


_SLA = Sla(ttft_ms=10_000.0, itl_p90_ms=1_000.0)


def _workload(n: int, concurrency: int, salt: int, seed: int = 0) -> Workload:
    return Workload(
        classes=MIX, num_requests=n, concurrency=concurrency, seed=seed, prompt_salt=salt
    )


def markdown(r: dict[str, Any]) -> str:
    m = r["machine"]
    rows = "\n".join(
        f"| {on['round']} | {off['itl_p50_ms']:.2f} | {on['itl_p50_ms']:.2f} | "
        f"{off['tok_s']:.0f} | {on['tok_s']:.0f} |"
        for on, off in zip(r["runs"]["on"], r["runs"]["off"], strict=True)
    )
    p = r["pooled"]
    where = machine_summary(m)
    return f"""{SECTION}

`.venv/bin/{r["command"]}` ({where}). One decode worker (1 torch thread) and one
router per stack, static addresses, no Redis; "on" = `--metrics-port` on both processes
(scraped every second) and `--otlp-endpoint` to an in-process collector that drops the spans
({r["spans_exported"]} spans received, {r["scrapes"]} scrapes). {r["rounds"]} rounds of
{r["requests_per_run"]} requests at concurrency {r["concurrency"]}, prompts 64-256 tokens,
outputs 64-128, order alternating per round.

| round | ITL p50 off (ms) | ITL p50 on (ms) | tok/s off | tok/s on |
|---|---|---|---|---|
{rows}

Pooled: ITL p50 {p["off"]["itl_ms"]["p50"]:.2f} ms off, {p["on"]["itl_ms"]["p50"]:.2f} ms on:
ratio on/off **{r["itl_p50_ratio_on_off"]:.3f}** (median of rounds
{r["itl_p50_ratio_median_of_rounds"]:.3f}); output tokens/s ratio on/off
**{r["tok_s_ratio_on_off"]:.3f}**. Target: <= 2% cost (ITL ratio <= 1.02, tokens/s ratio
>= 0.98). Failed requests: {p["off"]["failed"]} off, {p["on"]["failed"]} on.
"""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--rounds", type=int, default=0, help="default: 8 (2 with --quick)")
    p.add_argument(
        "--model-dir", default=str(Path.home() / ".cache/tandem/models/tandem-tiny-small")
    )
    p.add_argument("--results-dir", default=str(RESULTS_DIR))
    p.add_argument("--no-markdown-file", action="store_true")
    args = p.parse_args(argv)
    args.rounds = args.rounds or (2 if args.quick else 8)
    result = measure(args)
    out = Path(args.results_dir)
    write_json(result_path(out, "observability", "-quick" if args.quick else ""), result, indent=2)
    body = markdown(result)
    print(body)
    if not args.quick and not args.no_markdown_file and is_default_results_dir(out):
        write_markdown_section(BENCHMARKS_MD, SECTION, body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
