"""Structured outputs (issue 27) on the default model, in one process:

    .venv/bin/python benchmarks/bench_structured.py [--rounds 3] [--batch 4] [--threads 2]

1. compile: a large JSON schema (120 properties, nested objects, enums, bounded numbers)
   checked without a vocabulary (what the router does), compiled against SmolLM2's 49,152
   tokens (what an engine does, once per content), and the cache hit after it.
2. mask: the cost per constrained token of the allowed-token bitmask (llguidance) and of
   applying it to the logits (tandem.engine.sampling.apply_token_bitmask), over the tokens of
   JSON outputs.
3. ITL: `LLMEngine` decoding batches of `--batch` requests, each round one batch with a JSON
   schema constraint and one without (same prompts, greedy, alternating which goes first:
   the machine is shared), ITL = the time between a request's consecutive tokens.

Writes <results-dir>/structured.json and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # siblings import by name
from report import RESULTS_DIR, machine_info, machine_summary, percentile, result_path, write_json

from tandem.config import CacheConfig, EngineConfig
from tandem.engine import grammar
from tandem.engine.engine import LLMEngine
from tandem.engine.grammar import Constraint, GrammarCompiler, token_bitmask
from tandem.engine.sampling import SamplingParams, apply_token_bitmask

# What the ITL rounds ask for: long enough to decode for a while, bounded so it ends.
ITEMS_SCHEMA = {
    "type": "object",
    "properties": {
        "items": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "name": {"type": "string", "maxLength": 24},
                    "quantity": {"type": "integer", "minimum": 1, "maximum": 99},
                    "unit": {"enum": ["kg", "g", "piece", "litre"]},
                },
                "required": ["name", "quantity", "unit"],
                "additionalProperties": False,
            },
            "minItems": 4,
            "maxItems": 4,
        }
    },
    "required": ["items"],
    "additionalProperties": False,
}
QUESTIONS = [
    "List four things to buy for a picnic, as JSON.",
    "List four ingredients of a cake, as JSON.",
    "List four items for a camping trip, as JSON.",
    "List four fruits for a salad, as JSON.",
    "List four tools for a garden, as JSON.",
    "List four things for a school bag, as JSON.",
    "List four parts of a bicycle, as JSON.",
    "List four drinks for a party, as JSON.",
]


def large_schema(num_properties: int = 120) -> dict[str, Any]:
    props: dict[str, Any] = {}
    for i in range(num_properties):
        props[f"field_{i}"] = {
            "type": "object",
            "properties": {
                "label": {"type": "string", "pattern": "^[a-z]{3,12}$"},
                "count": {"type": "integer", "minimum": 0, "maximum": 10_000},
                "kind": {"enum": ["alpha", "beta", "gamma", f"kind{i}"]},
                "values": {"type": "array", "items": {"type": "number"}, "maxItems": 8},
            },
            "required": ["label", "count"],
        }
    return {"type": "object", "properties": props, "required": list(props)[:40]}


def bench_compile(compiler: GrammarCompiler) -> dict[str, float]:
    schema = large_schema()
    text = json.dumps(schema)
    grammar._grammar_and_error.cache_clear()
    t0 = time.perf_counter()
    constraint = Constraint.json_schema(schema)
    check_ms = (time.perf_counter() - t0) * 1e3
    t0 = time.perf_counter()
    compiler.matcher(constraint)
    compile_ms = (time.perf_counter() - t0) * 1e3
    hits = []
    for _ in range(20):
        t0 = time.perf_counter()
        compiler.matcher(Constraint.json_schema(schema))  # equal content: cached
        hits.append((time.perf_counter() - t0) * 1e3)
    return {
        "schema_bytes": len(text),
        "check_ms": check_ms,
        "compile_ms": compile_ms,
        "cache_hit_ms": statistics.median(hits),
    }


def chat_prompt(engine: LLMEngine, question: str) -> list[int]:
    assert engine.tokenizer is not None
    return engine.tokenizer.encode_chat([{"role": "user", "content": question}])[0]


def bench_mask(engine: LLMEngine, prompts: list[list[int]]) -> dict[str, float]:
    """Bitmask and apply cost per token, replaying the constrained outputs' tokens."""
    assert engine.grammars is not None
    constraint = Constraint.json_schema(ITEMS_SCHEMA)
    params = SamplingParams(max_tokens=160, temperature=0.0, constraint=constraint)
    outputs = [c.token_ids for c in engine.generate(prompts, params)]
    vocab = engine.model.config.vocab_size
    logits = torch.randn(1, vocab)
    fill_us, apply_us = [], []
    for tokens in outputs:
        matcher = engine.grammars.matcher(constraint)
        for token in tokens[:-1]:
            t0 = time.perf_counter()
            bitmask = token_bitmask([matcher], vocab)
            t1 = time.perf_counter()
            apply_token_bitmask(logits, [0], bitmask)
            t2 = time.perf_counter()
            fill_us.append((t1 - t0) * 1e6)
            apply_us.append((t2 - t1) * 1e6)
            assert matcher.accept(token)
    return {
        "tokens": len(fill_us),
        "bitmask_us_mean": statistics.fmean(fill_us),
        "bitmask_us_p50": statistics.median(fill_us),
        "bitmask_us_max": max(fill_us),
        "apply_us_mean": statistics.fmean(apply_us),
    }


def decode_itls(
    engine: LLMEngine, prompts: list[list[int]], params: SamplingParams
) -> tuple[list[float], int, int]:
    """(ITLs in ms of every request, tokens generated, requests that ended with stop)."""
    for i, prompt in enumerate(prompts):
        engine.add_request(engine.spec(f"itl-{engine.num_steps}-{i}", prompt, params))
    last: dict[str, float] = {}
    itls: list[float] = []
    tokens = stops = 0
    while engine.has_unfinished():
        outs = engine.step()
        now = time.perf_counter()
        for out in outs:
            if not out.new_token_ids:
                continue
            tokens += len(out.new_token_ids)
            if out.request_id in last:
                itls.append((now - last[out.request_id]) * 1e3)
            last[out.request_id] = now
            stops += out.finished and out.finish_reason == "stop"
    return itls, tokens, stops


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--model-dir", type=Path, default=None)
    ap.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    args = ap.parse_args()
    if args.model_dir is None:
        from tandem.services.cli.model import ensure_default_model

        args.model_dir = ensure_default_model()
    engine = LLMEngine(
        EngineConfig(
            str(args.model_dir),
            dtype=args.dtype,
            num_threads=args.threads,
            cache=CacheConfig(kv_cache_bytes=256 << 20),
        )
    )
    assert engine.grammars is not None
    t0 = time.perf_counter()
    engine.grammars.load()
    trie_ms = (time.perf_counter() - t0) * 1e3
    compile_fig = {"token_trie_ms": trie_ms, **bench_compile(engine.grammars)}
    prompts = [chat_prompt(engine, q) for q in QUESTIONS[: args.batch]]
    mask_fig = bench_mask(engine, prompts)

    free = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    constrained = SamplingParams(
        max_tokens=args.max_tokens, temperature=0.0, constraint=Constraint.json_schema(ITEMS_SCHEMA)
    )
    decode_itls(engine, prompts, free)  # warm-up
    runs: dict[str, dict[str, list[float] | int]] = {
        name: {"itl_ms": [], "tokens": 0, "stops": 0} for name in ("free", "json_schema")
    }
    for r in range(args.rounds):
        order = [("free", free), ("json_schema", constrained)]
        for name, params in order if r % 2 == 0 else order[::-1]:
            itls, tokens, stops = decode_itls(engine, prompts, params)
            run = runs[name]
            run["itl_ms"] += itls  # type: ignore[operator]
            run["tokens"] += tokens  # type: ignore[operator]
            run["stops"] += stops  # type: ignore[operator]
    itl = {
        name: {
            "mean_ms": statistics.fmean(run["itl_ms"]),  # type: ignore[arg-type]
            "p50_ms": statistics.median(run["itl_ms"]),  # type: ignore[arg-type]
            "p90_ms": percentile(run["itl_ms"], 90),  # type: ignore[arg-type]
            "tokens": run["tokens"],
            "stops": run["stops"],
        }
        for name, run in runs.items()
    }
    ratio = itl["json_schema"]["mean_ms"] / itl["free"]["mean_ms"]
    ratio_p50 = itl["json_schema"]["p50_ms"] / itl["free"]["p50_ms"]
    machine = machine_info(
        model_dir=str(args.model_dir), dtype=engine.config.resolved_dtype, threads=args.threads
    )
    data = {
        "machine": machine,
        "compile": compile_fig,
        "mask": mask_fig,
        "itl": itl,
        "itl_ratio": ratio,
        "itl_ratio_p50": ratio_p50,
        "batch": args.batch,
        "rounds": args.rounds,
    }
    write_json(result_path(args.results_dir, "structured"), data, indent=2)
    c, m = compile_fig, mask_fig
    print(f"machine: {machine_summary(machine)}; {engine.config.resolved_dtype}, "
          f"{args.threads} threads, batch {args.batch}, {args.rounds} rounds")  # fmt: skip
    print("| figure | value |\n|---|---|")
    print(f"| token trie of the 49,152-token vocabulary (once per engine) | {trie_ms:.0f} ms |")
    print(f"| large schema ({c['schema_bytes']} bytes): check, no vocabulary | "
          f"{c['check_ms']:.1f} ms |")  # fmt: skip
    print(f"| large schema: compile against the vocabulary | {c['compile_ms']:.1f} ms |")
    print(f"| large schema: cache hit | {c['cache_hit_ms'] * 1e3:.0f} us |")
    spread = f"{m['bitmask_us_mean']:.0f} / {m['bitmask_us_p50']:.0f} / {m['bitmask_us_max']:.0f}"
    print(f"| bitmask per token, mean / p50 / max ({m['tokens']} tokens) | {spread} us |")
    print(f"| applying it to one row of logits, mean | {m['apply_us_mean']:.0f} us |")
    for name, fig in itl.items():
        print(f"| ITL {name}: mean / p50 / p90 ({fig['tokens']} tokens, {fig['stops']} stops) | "
              f"{fig['mean_ms']:.1f} / {fig['p50_ms']:.1f} / {fig['p90_ms']:.1f} ms |")  # fmt: skip
    print(f"| ITL ratio json_schema / free: mean, p50 | {ratio:.3f}, {ratio_p50:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
