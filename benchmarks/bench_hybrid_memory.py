"""KV and recurrent-state bytes per request for the hybrid families (issue 42) against dense
models, from their configs alone (`tandem.model.layer_groups`): what a request holds at 1k,
8k and 32k tokens once its out-of-window pages are freed (per-group pools, not built yet),
what the engine holds as it serves them today (every attention layer's pages for the whole
sequence, plus a linear layer's state), and what a hand-off of a 4k-token prompt moves in each case
(a linear layer's state travels in a section of its own). bf16 cache and convolution state,
float32 recurrent state (as the engine keeps it), blocks of 16 tokens.

    .venv/bin/python benchmarks/bench_hybrid_memory.py

The configs are transformers' defaults for each family (`GptOssConfig()`: gpt-oss-120b's
36 layers; `Gemma3TextConfig()`: Gemma-3-4B's text stack; `Qwen3NextConfig()`: Qwen3-Next-
80B-A3B; `LlamaConfig()`: Llama-2-7B) and a Llama-3-8B shape (`LlamaConfig` with 8 KV
heads: 32 layers, 8 x 128). Writes
benchmarks/results/hybrid_memory.json and prints a markdown table.
"""

from __future__ import annotations

import json
from pathlib import Path

from tandem.model.layer_groups import LayerGroup, LayerKind, layer_groups

RESULTS = Path(__file__).resolve().parent / "results" / "hybrid_memory.json"
FAMILIES = {  # label -> (transformers config class, overrides)
    "gpt-oss (GptOssConfig)": ("GptOssConfig", {}),
    "Gemma 3 (Gemma3TextConfig)": ("Gemma3TextConfig", {}),
    "Qwen3-Next (Qwen3NextConfig)": ("Qwen3NextConfig", {}),
    "Llama-2-7B (LlamaConfig)": ("LlamaConfig", {}),
    "Llama-3-8B shape": ("LlamaConfig", {"num_key_value_heads": 8}),
}
CONTEXTS = (1024, 8192, 32768)
HANDOFF_TOKENS = 4096
BLOCK_SIZE = 16
DTYPE_BYTES = 2


def pages(groups: tuple[LayerGroup, ...], num_tokens: int) -> int:
    """Every attention layer's pages for the whole sequence: today's single pool (a sliding
    layer's out-of-window pages too; a linear layer has none)."""
    per_token = next(g.kv_token_bytes for g in groups if g.kv_token_bytes)
    num_layers = sum(len(g.layers) for g in groups if g.kind is not LayerKind.LINEAR)
    return -(-num_tokens // BLOCK_SIZE) * BLOCK_SIZE * per_token * num_layers


def served(groups: tuple[LayerGroup, ...], num_tokens: int) -> int:
    """What a request holds as the engine serves it today: `pages` and its linear state."""
    states = sum(g.state_bytes * len(g.layers) for g in groups if g.kind is LayerKind.LINEAR)
    return pages(groups, num_tokens) + states


def main() -> int:
    import transformers

    rows = []
    for label, (name, overrides) in FAMILIES.items():
        raw = getattr(transformers, name)(**overrides).to_dict()
        groups = layer_groups(raw, DTYPE_BYTES)
        row = {
            "config": label,
            "layers": {g.kind.value: len(g.layers) for g in groups},
            "window": next((g.window for g in groups if g.window), None),
            "request_mib": {
                str(n): round(sum(g.request_bytes(n, BLOCK_SIZE) for g in groups) / 2**20, 2)
                for n in CONTEXTS
            },
            "handoff_4k_mib": round(
                sum(g.request_bytes(HANDOFF_TOKENS, BLOCK_SIZE) for g in groups) / 2**20, 2
            ),
            "served_mib": {str(n): round(served(groups, n) / 2**20, 2) for n in CONTEXTS},
            "served_handoff_4k_mib": round(served(groups, HANDOFF_TOKENS) / 2**20, 2),
        }
        rows.append(row)
    print("| config | layers | window | " + " | ".join(f"MiB at {n}" for n in CONTEXTS)
          + " | 4k hand-off MiB |")  # fmt: skip
    print("|---|---|---|" + "---|" * len(CONTEXTS) + "---|")
    for r in rows:
        layers = ", ".join(f"{v} {k.split('_')[0]}" for k, v in r["layers"].items())
        sizes = " | ".join(
            f"{r['request_mib'][str(n)]} ({r['served_mib'][str(n)]})" for n in CONTEXTS
        )
        print(f"| {r['config']} | {layers} | {r['window'] or '-'} | {sizes} | "
              f"{r['handoff_4k_mib']} ({r['served_handoff_4k_mib']}) |")  # fmt: skip
    print("\n(per-group pools; in parentheses as served today)")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"block_size": BLOCK_SIZE, "dtype_bytes": DTYPE_BYTES,
                                   "rows": rows}, indent=2) + "\n")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
