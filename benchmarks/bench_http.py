"""What the OpenAI HTTP front costs: the same load through the router's gRPC API and its
OpenAI-compatible HTTP API (issue 17).

    python benchmarks/bench_http.py [--quick] [--rounds N] [--model-dir DIR]
        [--results-dir DIR] [--no-markdown-file]

One `tandem up` cluster (tandem.services.up.Cluster): Redis, one decode worker (1 torch thread, via
OMP_NUM_THREADS) and no prefill worker, so every request is prefilled where it is decoded and
the two fronts differ only in how a request reaches the router and its tokens leave it. The
router serves both: gRPC (`tandem.v1.Router`, through `tandem.client.AsyncTandemClient`) and
HTTP (`/v1/completions` with `stream=True`, through the real `openai.AsyncOpenAI` client,
SSE). One client of each kind lives for the whole benchmark, as an application's would.

The same closed-loop workload (prompts of random token ids, greedy, `ignore_eos`, a fixed
output length) goes to one front at a time, in rounds whose order flips every round (AB BA
...), each run with the same shape and fresh prompt contents (no prefix-cache hits), so a
drift of the shared machine's speed lands on both alike. Client-side timings as in
`loadgen.py`: TTFT = send -> first chunk with a token; ITL = gaps between chunks, a chunk
of k tokens counted as k gaps of gap / k. gRPC chunks carry their token ids; an SSE chunk
carries text only, so it counts as one token, and the usage chunk (`include_usage`) gives
the request's true total: a chunk of several tokens (the decode worker merges tokens that
piled up while its reader lagged) is then one ITL sample on HTTP, and the report says how
many requests had one. A second phase sends one request at a time, for TTFT without
queueing. The figures are ratios HTTP/gRPC of the pooled percentiles; the issue's target:
HTTP adds <= 5% to ITL p50 (under load).
The router's CPU seconds (from /proc) and this process's (the clients) are kept per run.

Results go to <results-dir>/http_vs_grpc.json and http_vs_grpc.png; a complete, non-quick
run into the default results folder rewrites the "## OpenAI HTTP front vs gRPC (issue 17)"
section of BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import textwrap
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import openai

sys.path.insert(0, str(Path(__file__).resolve().parent))  # siblings import by name
from bench_serving import cpu_seconds, ensure_model, log
from loadgen import (
    RequestClass,
    RequestSpec,
    RouterTarget,
    RunResult,
    Sla,
    Target,
    Workload,
    run_workload,
)
from report import (
    BENCHMARKS_MD,
    RESULTS_DIR,
    is_default_results_dir,
    machine_info,
    machine_summary,
    percentile,
    result_path,
    verdict,
    write_json,
    write_markdown_section,
)

from tandem.client import TandemError
from tandem.services.up import Cluster, UpConfig, wait_for_router

SECTION = "## OpenAI HTTP front vs gRPC (issue 17)"
FRONTS = ("grpc", "http")
PROMPT_LEN = (64, 256)
OUTPUT_LEN = 64
MIX = (RequestClass(1.0, PROMPT_LEN, (OUTPUT_LEN, OUTPUT_LEN), "fixed-64"),)
_SLA = Sla(ttft_ms=10_000.0, itl_p90_ms=1_000.0)  # not a target here; loadgen wants one


class OpenAITarget:
    """The router's HTTP API through the openai client: /v1/completions, streamed."""

    def __init__(self, http_address: str) -> None:
        self.name = f"openai http://{http_address}/v1"
        self.client = openai.AsyncOpenAI(
            base_url=f"http://{http_address}/v1", api_key="x", max_retries=0
        )
        self.model = ""

    async def stream(self, spec: RequestSpec, info: dict[str, Any]) -> AsyncIterator[int]:
        if not self.model:
            self.model = (await self.client.models.list()).data[0].id
        try:
            chunks = await self.client.completions.create(
                model=self.model,
                prompt=spec.prompt,
                max_tokens=spec.max_tokens,
                temperature=0.0,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"ignore_eos": True},
            )
            async for chunk in chunks:
                # A content chunk is counted as one token (an SSE chunk does not say how many
                # it carries; `_settle` corrects the total from the usage chunk); the closing
                # chunk has the finish reason and no text, the last one the usage.
                if chunk.choices and chunk.choices[0].finish_reason is None:
                    yield 1
                elif chunk.choices:
                    info["finish_reason"] = chunk.choices[0].finish_reason
                if chunk.usage is not None:
                    info["completion_tokens"] = chunk.usage.completion_tokens
        except openai.APIError as exc:  # loadgen records a TandemError as a failed request
            raise TandemError(grpc.StatusCode.UNKNOWN, f"{type(exc).__name__}: {exc}") from None

    async def close(self) -> None:
        await self.client.close()


def _settle(res: RunResult) -> int:
    """Give each HTTP request its true token count (the usage chunk's) where some SSE chunk
    carried several tokens; returns how many requests had one. Their ITL samples stay one per
    chunk (a merged chunk's gap counts once, whole), which can only raise HTTP's ITL."""
    merged = 0
    for r in res.records:
        total = r.info.get("completion_tokens")
        if total is None or total == r.output_tokens:
            continue
        merged += 1
        r.output_tokens = total
        if r.error.startswith("got ") and total == r.max_tokens:
            r.error = ""
    return merged


def _workload(n: int, concurrency: int, salt: int, seed: int = 0) -> Workload:
    return Workload(
        classes=MIX, num_requests=n, concurrency=concurrency, seed=seed, prompt_salt=salt
    )


@dataclass(frozen=True, slots=True)
class Phase:
    """One load, sent through each front in alternating rounds."""

    name: str
    rounds: int
    requests: int  # per run
    concurrency: int
    salt_base: int  # prompt contents differ between phases, rounds and fronts


async def _rounds(
    targets: dict[str, Target], router_pid: int, phase: Phase
) -> tuple[dict[str, list[dict[str, Any]]], dict[str, list[RunResult]]]:
    runs: dict[str, list[dict[str, Any]]] = {f: [] for f in FRONTS}
    results: dict[str, list[RunResult]] = {f: [] for f in FRONTS}
    for rnd in range(phase.rounds):
        order = FRONTS if rnd % 2 == 0 else FRONTS[::-1]
        for front in order:
            # Same shape per round, fresh token contents per run (no prefix-cache hits).
            salt = phase.salt_base + rnd * 2 + (front == "http")
            w = _workload(phase.requests, phase.concurrency, salt, seed=rnd)
            router_cpu0, client_cpu0 = cpu_seconds(router_pid), time.process_time()
            res = await run_workload(targets[front], w)
            router_cpu = cpu_seconds(router_pid) - router_cpu0
            client_cpu = time.process_time() - client_cpu0
            if merged := _settle(res):
                log(f"{phase.name} round {rnd} {front}: {merged} requests had a multi-token chunk")
            s = res.summary(_SLA)
            results[front].append(res)
            runs[front].append(
                {
                    "round": rnd,
                    "ttft_p50_ms": s["ttft_ms"]["p50"],
                    "itl_p50_ms": s["itl_ms"]["p50"],
                    "itl_p99_ms": s["itl_ms"]["p99"],
                    "second_token_gap_p50_ms": s["second_token_gap_ms"]["p50"],
                    "tok_s": s["throughput_tok_s"],
                    "tokens_per_chunk": s["tokens_per_chunk"],
                    "failed": s["num_failed"],
                    "errors": s["errors"],
                    "router_cpu_s": router_cpu,
                    "client_cpu_s": client_cpu,
                    "output_tokens": s["output_tokens"],
                }
            )
            log(
                f"{phase.name} round {rnd} {front}: TTFT p50 {s['ttft_ms']['p50']:.1f} ms, "
                f"ITL p50 {s['itl_ms']['p50']:.2f} ms, token 1->2 gap p50 "
                f"{s['second_token_gap_ms']['p50']:.2f} ms, {s['throughput_tok_s']:.0f} tok/s, "
                f"router CPU {router_cpu * 1e6 / max(1, s['output_tokens']):.0f} us/token"
            )
    return runs, results


def _pooled(runs: list[dict[str, Any]], results: list[RunResult]) -> dict[str, Any]:
    res = RunResult.concat(results)
    s = res.summary(_SLA)
    itls = res.itls()
    tokens = max(1, s["output_tokens"])
    return {
        "ttft_ms": s["ttft_ms"],
        "itl_ms": s["itl_ms"],
        "second_token_gap_ms": s["second_token_gap_ms"],
        "itl_below_1ms_fraction": sum(x < 1e-3 for x in itls) / max(1, len(itls)),
        "e2e_ms": s["e2e_ms"],
        "tok_s": s["throughput_tok_s"],
        "tokens_per_chunk": s["tokens_per_chunk"],
        "chunks_per_request": sorted({r.num_chunks for r in res.records}),
        "requests_with_a_multi_token_chunk": sum(
            r.num_chunks < r.output_tokens for r in res.records
        ),
        "num_ok": s["num_ok"],
        "failed": s["num_failed"],
        "errors": s["errors"],
        "router_cpu_us_per_token": 1e6 * sum(r["router_cpu_s"] for r in runs) / tokens,
        "client_cpu_us_per_token": 1e6 * sum(r["client_cpu_s"] for r in runs) / tokens,
    }


def _ratios(pooled: dict[str, dict[str, Any]]) -> dict[str, float]:
    g, h = pooled["grpc"], pooled["http"]
    out = {
        f"{key.split('_')[0]}_{q}": h[key][q] / g[key][q]
        for key in ("ttft_ms", "itl_ms")
        for q in ("p50", "p99")
    }
    out["tok_s"] = h["tok_s"] / g["tok_s"]
    return out


def measure(args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, dict[str, list[float]]]]:
    """The results (for the JSON) and, per front, every request's TTFT and every token's ITL
    in ms (for the plot)."""
    phases = (
        Phase("loaded", args.rounds, *((6, 3) if args.quick else (16, 4)), salt_base=0),
        # One request at a time: TTFT without queueing behind other requests' prefills.
        Phase("idle", 1 if args.quick else 2, 4 if args.quick else 8, 1, salt_base=1000),
    )
    model_dir = ensure_model(Path(args.model_dir))
    # The workers inherit our environment: one torch thread for the decode worker leaves the
    # other core to the router and the clients (as bench_observability's --num-threads 1).
    os.environ["OMP_NUM_THREADS"] = "1"
    config = UpConfig(
        model_dir=str(model_dir),
        port=0,
        http_port=0,
        num_prefill=0,
        num_decode=1,
        transport="local",
    )
    cluster = Cluster(config)
    log("starting the cluster (redis, decode-0, router)")
    cluster.start()
    try:
        wait_for_router(cluster.router_address)
        router_pid = next(c.proc.pid for c in cluster.children if c.name == "router")

        async def go() -> dict[str, Any]:
            targets: dict[str, Target] = {
                "grpc": RouterTarget(cluster.router_address, "grpc"),
                "http": OpenAITarget(cluster.http_address),
            }
            try:
                for front in FRONTS:  # warm both: connections, first-request paths, the engine
                    await run_workload(targets[front], _workload(4, 4, 10_000 + len(front)))
                return {ph.name: await _rounds(targets, router_pid, ph) for ph in phases}
            finally:
                for t in targets.values():
                    await t.close()

        measured = asyncio.run(go())
    finally:
        cluster.stop()
    out: dict[str, Any] = {
        "benchmark": "OpenAI HTTP front vs gRPC",
        "command": "python benchmarks/bench_http.py" + (" --quick" if args.quick else ""),
        "machine": machine_info(),
        "setup": {
            "cluster": "tandem up: redis, 1 decode worker (colocated prefill), 0 prefill",
            "decode_torch_threads": 1,
            "transport": config.transport,
            "model_dir": str(model_dir),
            "grpc": "tandem.client.AsyncTandemClient.stream",
            "http": f"openai {openai.__version__} AsyncOpenAI completions.create(stream=True)",
        },
        "prompt_len": list(PROMPT_LEN),
        "output_len": OUTPUT_LEN,
    }
    samples: dict[str, dict[str, list[float]]] = {}
    for ph in phases:
        runs, results = measured[ph.name]
        pooled = {f: _pooled(runs[f], results[f]) for f in FRONTS}
        pairs = zip(runs["http"], runs["grpc"], strict=True)
        out[ph.name] = {
            "rounds": ph.rounds,
            "requests_per_run": ph.requests,
            "concurrency": ph.concurrency,
            "runs": runs,
            "pooled": pooled,
            "ratio_http_grpc": _ratios(pooled),
            "itl_p50_ratio_median_of_rounds": statistics.median(
                h["itl_p50_ms"] / g["itl_p50_ms"] for h, g in pairs
            ),
        }
        for f in FRONTS:
            res = RunResult.concat(results[f])
            samples.setdefault(f, {})[f"{ph.name}_ttft"] = [
                r.ttft_s * 1e3 for r in res.records if r.ok
            ]
            samples[f][f"{ph.name}_itl"] = [x * 1e3 for x in res.itls()]
    itl_ratio = out["loaded"]["ratio_http_grpc"]["itl_p50"]
    out["target"] = {"itl_p50_ratio_max": 1.05, "met": itl_ratio <= 1.05}
    # The distributions, as percentiles 1..99 (the plot draws every sample).
    out["percentiles_1_99_ms"] = {
        f: {k: [round(percentile(v, q), 4) for q in range(1, 100)] for k, v in d.items()}
        for f, d in samples.items()
    }
    out["run_dir"] = str(cluster.run_dir)
    return out, samples


def plot(r: dict[str, Any], samples: dict[str, dict[str, list[float]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import matplotlib.ticker

    colors = {"grpc": "tab:blue", "http": "tab:orange"}
    labels = {"grpc": "gRPC (AsyncTandemClient)", "http": "HTTP (openai, SSE)"}
    loaded, idle = r["loaded"], r["idle"]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    ax = axes[0]
    for f in FRONTS:
        runs = loaded["runs"][f]
        ax.plot([x["round"] for x in runs], [x["itl_p50_ms"] for x in runs], "o-",
                color=colors[f], label=labels[f])  # fmt: skip
    ax.set_xlabel("round")
    ax.set_xticks(range(loaded["rounds"]))
    ax.set_ylabel("ITL p50 (ms)")
    ax.set_title(f"ITL p50 per round (concurrency {loaded['concurrency']})")
    ax.legend()
    ax = axes[1]
    for f in FRONTS:
        _cdf(ax, samples[f]["loaded_itl"], colors[f], "-", labels[f])
    ax.set_xlabel("ITL (ms, log scale)")
    ax.set_title(f"ITL, every token, concurrency {loaded['concurrency']}: CDF")
    ax = axes[2]
    for f in FRONTS:
        conc = loaded["concurrency"]
        _cdf(ax, samples[f]["loaded_ttft"], colors[f], "-", f"{labels[f]}, concurrency {conc}")
        _cdf(ax, samples[f]["idle_ttft"], colors[f], "--", f"{labels[f]}, one at a time")
    ax.set_xlabel("TTFT (ms, log scale)")
    ax.set_title("TTFT: CDF")
    for ax in axes[1:]:
        ax.set_xscale("log")
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())  # labels overlap
        ax.set_ylabel("fraction of samples <=")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    q, qi = loaded["ratio_http_grpc"], idle["ratio_http_grpc"]
    fig.suptitle(
        f"OpenAI HTTP front vs gRPC, same router, HTTP/gRPC: ITL p50 {q['itl_p50']:.3f}, "
        f"tok/s {q['tok_s']:.3f}, TTFT p50 {q['ttft_p50']:.3f} (one at a time: "
        f"{qi['ttft_p50']:.3f})"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _cdf(ax: Any, values: list[float], color: str, style: str, label: str) -> None:
    xs = sorted(values)
    ys = [(i + 1) / len(xs) for i in range(len(xs))]
    ax.step(xs, ys, style, where="post", color=color, label=label)


def _n(count: int, noun: str) -> str:
    return f"{count} {noun}" + ("" if count == 1 else "s")


def markdown(r: dict[str, Any], stem: str) -> str:
    m, loaded, idle = r["machine"], r["loaded"], r["idle"]
    g, h = loaded["pooled"]["grpc"], loaded["pooled"]["http"]
    q = loaded["ratio_http_grpc"]
    n = r["output_len"]
    where = machine_summary(m)
    merged = {
        f: sum(ph["pooled"][f]["requests_with_a_multi_token_chunk"] for ph in (loaded, idle))
        for f in FRONTS
    }
    total = sum(ph["rounds"] * ph["requests_per_run"] for ph in (loaded, idle))
    chunks = (
        f"every request of both fronts delivered its {n} tokens in {n} chunks, so each SSE "
        "chunk carried one token"
        if not any(merged.values())
        else "a chunk carries several tokens when they piled up while the decode worker's "
        "reader lagged (`output_batches`); requests with such a chunk: gRPC "
        f"{merged['grpc']}, HTTP {merged['http']} of {total}. An SSE chunk does not say how "
        "many tokens it carries (the usage chunk gives the total), so on HTTP such a gap "
        "counts as one ITL sample, not k samples of gap / k"
    )
    setup = (
        f"`.venv/bin/{r['command']}` ({where}). One `tandem up` cluster: Redis, one decode "
        "worker (1 torch thread) and **no prefill worker**, so every request is prefilled "
        "where it is decoded and the fronts differ only at the router's edge. The router "
        "serves both: gRPC through `tandem.client.AsyncTandemClient.stream`, HTTP through "
        f"`{r['setup']['http']}` on `/v1/completions` (SSE, "
        '`extra_body={"ignore_eos": True}`), one client of each for the whole run. Loaded: '
        f"{_n(loaded['rounds'], 'round')} of {loaded['requests_per_run']} requests at "
        f"concurrency {loaded['concurrency']} per front; one at a time: "
        f"{_n(idle['rounds'], 'round')} of "
        f"{idle['requests_per_run']} requests at concurrency 1 (TTFT without queueing). "
        f"Prompts {r['prompt_len'][0]}-{r['prompt_len'][1]} random token ids, {n} greedy "
        "output tokens each (`ignore_eos`), order alternating per round, fresh prompt "
        "contents per run. Client-side timings (loadgen's definitions); "
        f"{chunks}. Results: `benchmarks/results/{stem}.json`."
    )
    met = verdict(r["target"]["met"], "met", "**not met**")
    target = (
        f"Target: HTTP adds <= 5% to ITL p50 (ratio <= 1.05, loaded): {met} "
        f"({q['itl_p50']:.3f}; median of the per-round ratios "
        f"{loaded['itl_p50_ratio_median_of_rounds']:.3f}). Router CPU per token = the router "
        "process's CPU seconds (/proc) over the run's output tokens; client CPU = this "
        "benchmark process's (client library, asyncio, loadgen)."
    )
    gi, hi = idle["pooled"]["grpc"], idle["pooled"]["http"]
    bunched = hi["second_token_gap_ms"]["p50"] < 0.25 * gi["second_token_gap_ms"]["p50"]
    note = (
        "HTTP's token 1 -> 2 gap p50 is "
        f"{hi['second_token_gap_ms']['p50']:.2f} ms (gRPC "
        f"{gi['second_token_gap_ms']['p50']:.2f} ms) one at a time, and "
        f"{100 * h['itl_below_1ms_fraction']:.1f}% of HTTP's ITL samples under load are "
        f"below 1 ms (gRPC {100 * g['itl_below_1ms_fraction']:.1f}%): the first SSE chunk "
        "reaches the client together with the next, i.e. it is held back after the response "
        "headers, which shows as TTFT, not ITL. Diagnosed on 2026-12-01 (not rechecked by "
        "this script): Nagle's algorithm. `openai_http.py` listens on a socket from "
        "`socket.create_server`, whose `proto` is 0, so asyncio does not set TCP_NODELAY on "
        "the connections it accepts (`_set_nodelay` wants `proto == IPPROTO_TCP`) and uvicorn "
        "does not either; on a kept-alive connection the first chunk after the headers then "
        "waits for the client's delayed ACK (~40 ms on Linux)."
    )

    def row(name: str, x: dict[str, Any]) -> str:
        t, i, gap = x["ttft_ms"], x["itl_ms"], x["second_token_gap_ms"]
        return (
            f"| {name} | {t['p50']:.1f} / {t['p99']:.1f} | {i['p50']:.2f} / {i['p99']:.2f} "
            f"| {gap['p50']:.2f} | {x['tok_s']:.1f} | {x['router_cpu_us_per_token']:.0f} "
            f"| {x['client_cpu_us_per_token']:.0f} | {x['failed']} |"
        )

    def ratio_row(x: dict[str, float], gg: dict[str, Any], hh: dict[str, Any], bold: str) -> str:
        cpu_r = hh["router_cpu_us_per_token"] / gg["router_cpu_us_per_token"]
        cpu_c = hh["client_cpu_us_per_token"] / gg["client_cpu_us_per_token"]
        itl = f"{bold}{x['itl_p50']:.3f}{bold}"
        return (
            f"| HTTP / gRPC | {x['ttft_p50']:.3f} / {x['ttft_p99']:.3f} "
            f"| {itl} / {x['itl_p99']:.3f} | | {x['tok_s']:.3f} | {cpu_r:.2f} "
            f"| {cpu_c:.2f} | |"
        )

    head = (
        "| front | TTFT p50 / p99 (ms) | ITL p50 / p99 (ms) | token 1 -> 2 gap p50 (ms) "
        "| output tok/s | router CPU per token (us) | client CPU per token (us) | failed |\n"
        "|---|---|---|---|---|---|---|---|"
    )
    rounds = "\n".join(
        f"| {hh['round']} | {'gRPC, HTTP' if hh['round'] % 2 == 0 else 'HTTP, gRPC'} | "
        f"{gg['itl_p50_ms']:.2f} | {hh['itl_p50_ms']:.2f} | {gg['ttft_p50_ms']:.1f} | "
        f"{hh['ttft_p50_ms']:.1f} | {gg['tok_s']:.0f} | {hh['tok_s']:.0f} |"
        for gg, hh in zip(loaded["runs"]["grpc"], loaded["runs"]["http"], strict=True)
    )
    lines = [
        SECTION,
        "",
        textwrap.fill(setup, 95, break_on_hyphens=False),
        "",
        f"Loaded (concurrency {loaded['concurrency']}):",
        "",
        head,
        row("gRPC", g),
        row("HTTP", h),
        ratio_row(q, g, h, "**"),
        "",
        "One at a time:",
        "",
        head,
        row("gRPC", gi),
        row("HTTP", hi),
        ratio_row(idle["ratio_http_grpc"], gi, hi, ""),
        "",
        textwrap.fill(target, 95, break_on_hyphens=False),
    ]
    if bunched:
        lines += ["", textwrap.fill(note, 95, break_on_hyphens=False)]
    lines += [
        "",
        "Loaded, per round:",
        "",
        "| round | order | ITL p50 gRPC (ms) | ITL p50 HTTP (ms) | TTFT p50 gRPC (ms) "
        "| TTFT p50 HTTP (ms) | tok/s gRPC | tok/s HTTP |",
        "|---|---|---|---|---|---|---|---|",
        rounds,
        "",
        f"![http vs grpc](benchmarks/results/{stem}.png)",
        "",
    ]
    return "\n".join(lines)


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
    result, samples = measure(args)
    out = Path(args.results_dir)
    out.mkdir(parents=True, exist_ok=True)
    stem = "http_vs_grpc-quick" if args.quick else "http_vs_grpc"
    write_json(result_path(out, stem), result, indent=1)
    plot(result, samples, result_path(out, stem, ext="png"))
    body = markdown(result, stem)
    print(body)
    if not args.quick and not args.no_markdown_file and is_default_results_dir(out):
        write_markdown_section(BENCHMARKS_MD, SECTION, body)
    return 0


if __name__ == "__main__":
    sys.exit(main())
