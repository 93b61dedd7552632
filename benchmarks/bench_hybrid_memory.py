"""KV and recurrent-state bytes per request for the hybrid families (issue 42) against dense
models: what the engine's KV manager holds for one request of 1k, 8k and 32k tokens once its
prompt is prefilled (in chunks of 2048), its peak while prefilling, and
what a hand-off of a 4k-token prompt moves -- measured by running the manager's own
bookkeeping (`KVCacheManager` with the model's `KVLayout`: sliding tables free what every
later window has passed; a linear layer's state is outside the pages) -- against one table
of every attention layer for the whole sequence (the layout before sliding tables, in
parentheses). bf16 cache and convolution state, float32 recurrent state (as the engine keeps
it), blocks of 16 tokens.

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

from tandem.engine.kv_manager import KVCacheManager
from tandem.engine.request import Request
from tandem.engine.sampling import SamplingParams
from tandem.model.config import ModelConfig
from tandem.model.layer_groups import LayerGroup, LayerKind, layer_groups

RESULTS = Path(__file__).resolve().parent / "results" / "hybrid_memory.json"
FAMILIES = {  # label -> (transformers config class, architecture, overrides)
    "gpt-oss (GptOssConfig)": ("GptOssConfig", "GptOssForCausalLM", {}),
    "Gemma 3 (Gemma3TextConfig)": ("Gemma3TextConfig", "Gemma3ForCausalLM", {}),
    "Qwen3-Next (Qwen3NextConfig)": ("Qwen3NextConfig", "Qwen3NextForCausalLM", {}),
    "Llama-2-7B (LlamaConfig)": ("LlamaConfig", "LlamaForCausalLM", {}),
    "Llama-3-8B shape": ("LlamaConfig", "LlamaForCausalLM", {"num_key_value_heads": 8}),
}
CONTEXTS = (1024, 8192, 32768)
HANDOFF_TOKENS = 4096
BLOCK_SIZE = 16
DTYPE_BYTES = 2
CHUNK = 2048  # prefill chunk (the default max_num_batched_tokens)


def one_table(groups: tuple[LayerGroup, ...], num_tokens: int) -> int:
    """Every attention layer's pages for the whole sequence, a linear layer's state: one
    table of all attention layers (the layout before sliding tables)."""
    per_token = next(g.kv_token_bytes for g in groups if g.kv_token_bytes)
    num_layers = sum(len(g.layers) for g in groups if g.kind is not LayerKind.LINEAR)
    return -(-num_tokens // BLOCK_SIZE) * BLOCK_SIZE * per_token * num_layers + state(groups)


def state(groups: tuple[LayerGroup, ...]) -> int:
    return sum(g.state_bytes * len(g.layers) for g in groups if g.kind is LayerKind.LINEAR)


def held(config: ModelConfig, groups: tuple[LayerGroup, ...], num_tokens: int) -> dict[str, int]:
    """Bytes one request holds in the engine's KV manager: at its peak while its prompt of
    `num_tokens` is prefilled in chunks, as its first decode step starts (its next token's
    windows), and what a hand-off of it after the prompt moves (`handoff_blocks`)."""
    layout = config.kv_layout
    block = BLOCK_SIZE * config.kv_elements_per_token * DTYPE_BYTES
    num_blocks = layout.peak_blocks(num_tokens + 1, BLOCK_SIZE, CHUNK)
    kv = KVCacheManager(num_blocks, BLOCK_SIZE, False, False, groups, None, layout)
    request = Request("r", [0] * num_tokens, SamplingParams(max_tokens=2))
    peak = 0
    while request.num_computed_tokens < num_tokens:
        n = min(CHUNK, num_tokens - request.num_computed_tokens)
        assert kv.allocate_slots(request, n) is not None
        peak = max(peak, len(kv.held_blocks("r")))
        request.num_computed_tokens += n
    handoff = len(kv.handoff_blocks("r", num_tokens))  # frees what the next token won't read
    after = len(kv.held_blocks("r"))
    extra = state(groups)
    return {"peak": peak * block + extra, "decoding": after * block + extra,
            "handoff": handoff * block + extra}  # fmt: skip


def main() -> int:
    import transformers

    rows = []
    for label, (name, arch, overrides) in FAMILIES.items():
        raw = getattr(transformers, name)(**overrides).to_dict() | {"architectures": [arch]}
        groups = layer_groups(raw, DTYPE_BYTES)
        config = ModelConfig.from_hf(raw)
        sizes = {n: held(config, groups, n) for n in CONTEXTS}
        mib = 1 / 2**20
        row = {
            "config": label,
            "layers": {g.kind.value: len(g.layers) for g in groups},
            "window": next((g.window for g in groups if g.window), None),
            "kv_layout": config.kv_layout.describe() if config.kv_layout.num_tables > 1 else "",
            "request_mib": {str(n): round(s["decoding"] * mib, 2) for n, s in sizes.items()},
            "peak_mib": {str(n): round(s["peak"] * mib, 2) for n, s in sizes.items()},
            "handoff_4k_mib": round(held(config, groups, HANDOFF_TOKENS)["handoff"] * mib, 2),
            "one_table_mib": {str(n): round(one_table(groups, n) * mib, 2) for n in CONTEXTS},
            "one_table_handoff_4k_mib": round(one_table(groups, HANDOFF_TOKENS) * mib, 2),
        }
        rows.append(row)
    print("| config | layers | window | " + " | ".join(f"MiB at {n}" for n in CONTEXTS)
          + f" | peak MiB at {CONTEXTS[-1]} | 4k hand-off MiB |")  # fmt: skip
    print("|---|---|---|" + "---|" * len(CONTEXTS) + "---|---|")
    for r in rows:
        layers = ", ".join(f"{v} {k.split('_')[0]}" for k, v in r["layers"].items())
        sizes = " | ".join(
            f"{r['request_mib'][str(n)]} ({r['one_table_mib'][str(n)]})" for n in CONTEXTS
        )
        print(f"| {r['config']} | {layers} | {r['window'] or '-'} | {sizes} | "
              f"{r['peak_mib'][str(CONTEXTS[-1])]} | "
              f"{r['handoff_4k_mib']} ({r['one_table_handoff_4k_mib']}) |")  # fmt: skip
    print("\n(as the engine holds them; in parentheses one table of every attention layer)")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps({"block_size": BLOCK_SIZE, "dtype_bytes": DTYPE_BYTES,
                                   "rows": rows}, indent=2) + "\n")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
