"""The GPU check: what only a GPU can tell about the engine, as one prepared script.

    scripts/gpu-check [--cpu] [--parts PART,...|all] [--out DIR]    (default: the one command,
                      preflight,startup,throughput,kernels,e2e,quant,moe, <= 470 s on an H200)
    scripts/gpu-check --stamp        (the tree's commit and digest, before copying it to the GPU)

One module per part (each module's docstring says what its part checks):
  preflight.py      C compiler, Python.h, driver and CUDA versions, one Triton launch (if it
                    fails, the later parts use the torch attention backend)
  startup.py        an engine built as a values-gpu.yaml worker builds it (no block count,
                    gpu_memory_utilization), warmed up, token-identical to one engine
  parity.py         the engine vs HF transformers on the same random weights (tiny Llama, Qwen3)
  throughput.py     the engine's output tokens/s on workload W (Llama-3-8B-shaped) and its
                    fraction of W's roofline
  kernels_bench.py  the Triton attention kernels: correct on the device, decode GB/s vs a
                    device copy (bf16 and FP8 KV), prefill TFLOP/s vs torch SDPA
  e2e_bench.py      batch-1 inter-token latency, CUDA graphs vs eager, vs the weights roofline;
                    a decode step's device time by kernel category (torch.profiler)
  quant_bench.py    fp8 / int8 / int4 weights through each scheme's production linear path and
                    the FP8 KV kernels, correct on the device; every candidate kernel's speed
                    vs bf16 in Llama-3-8B shapes; the engine with fp8 / int4 weights (and fp8
                    KV) vs bf16 at batch 1 and 64
  moe_bench.py      the fused MoE kernel vs torch's grouped GEMMs on a Qwen3-30B-A3B layer
  nixl_pull.py      a NIXL read of KV blocks from a second process vs a same-device copy, GB/s
                    (CUDA IPC on one GPU, not RDMA between pods)
  serve.py          prefill + decode worker + router as processes, token-identical to one engine
  tiles_sweep.py    the attention kernels' launch configurations (tiles, stages, warps) timed on
                    the device, each checked against the reference first
and around them:
  sizes.py          the CUDA run's sizes and budgets, and the tiny ones of `--cpu` (CI)
  common.py         Context, Log, PartSkipped / PartFailed, environment(), timing, engine helpers
  cli.py            `main`: arguments, each part under its budget, gpu-check.json and .log

Preflight, startup, parity, throughput, kernels, e2e, quant, moe and tiles import no grpc, redis
or kubernetes (serve and nixl import theirs lazily).
"""

from .cli import main

__all__ = ["main"]
