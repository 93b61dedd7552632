"""The GPU check: what only a GPU can tell about the engine, as one prepared script.

    scripts/gpu-check [--cpu] [--parts parity,throughput,nixl,serve] [--out DIR]

One module per part (each module's docstring says what its part checks):
  parity.py      the engine vs HF transformers on the same random weights (tiny Llama, Qwen3)
  throughput.py  engine vs HF `generate` output tokens/s on workload W (Llama-3-8B-shaped)
  nixl_pull.py   a NIXL read of KV blocks from a second process vs a same-device copy, GB/s
  serve.py       prefill + decode worker + router as processes, token-identical to one engine
and around them:
  sizes.py       the CUDA run's sizes and budgets, and the tiny ones of `--cpu` (CI)
  common.py      Context, Log, PartSkipped / PartFailed, environment(), engine/device helpers
  cli.py         `main`: arguments, each part under its budget, gpu-check.json and .log

Parity and throughput import no grpc, redis or kubernetes (serve and nixl import theirs
lazily).
"""

from .cli import main

__all__ = ["main"]
