"""Part `mla`: the paged MLA decode kernel (kernels/mla_decode.py, DeepSeek-V3's absorbed
decode over the latent cache) on the device.

1. Correctness, bf16: a ragged batch (1 token, a block boundary, several splits) over a
   shuffled, NaN-poisoned cache at DeepSeek-V3's shape (128 heads, kv_lora_rank 512 + rope
   64) against the float64 reference (`tandem.kernels.reference.mla_decode_context`), at
   the bf16 tolerance of tests/kernels/test_mla_decode.py.
2. Bandwidth: batch 1 / 16 / 64 x contexts 1k / 4k / 16k (blocks of 16). Bytes read are the
   entries (context x 576 x 2 bytes, summed over the batch, read once per tile of 16 heads:
   the re-reads are L2 hits), over the median kernel time (L2 flushed before each call),
   as a fraction of the device copy's bandwidth (read + written), as the `kernels` part
   does for the dense decode. And the torch form it replaces (tandem.model.mla's gathered
   bmm: gather, scores, softmax, P @ latent) at batch 16 x 4k, as a speedup.

A wrong result fails the part; speeds are figures. With --cpu: a tiny shape (16 heads, 32 +
8) under Triton's interpreter (a smoke run). Not in the default parts: `--parts mla`.
"""

from __future__ import annotations

import functools
import math
import traceback
from typing import Any

import torch

from .common import Context, Figures, PartFailed, copy_bandwidth, free_memory, median_time_s
from .kernels_bench import compare, use_interpreter

DTYPE = torch.bfloat16
TOLERANCE = (1.6e-2, 1.6e-2)  # bf16 (tests/kernels/test_mla_decode.py)
BLOCK = 16
SMOKE = "smoke: CPU tensors, Triton's interpreter, tiny shapes; times are not speeds"


def _case(lens: list[int], heads: int, lat: int, rope: int, dev: str, poison: bool) -> Any:
    """q_lat, q_rot, the layer's cache view, shuffled tables and lengths. With `poison`
    every slot no row owns is NaN (block 0 is the tables' padding)."""
    half = (lat + rope) // 2
    blocks = [math.ceil(n / BLOCK) for n in lens]
    num_blocks = sum(blocks) + 1
    cache = torch.randn(num_blocks, 2, BLOCK, 1, half, device=dev).to(DTYPE)
    ids = torch.randperm(num_blocks - 1, device=dev) + 1
    tables = torch.zeros(len(lens), max(blocks) + 1, dtype=torch.int32, device=dev)
    used = 0
    for r, (n, b) in enumerate(zip(lens, blocks, strict=True)):
        tables[r, :b] = ids[used : used + b].to(torch.int32)
        used += b
        if poison and n % BLOCK:
            cache[int(tables[r, b - 1]), :, n % BLOCK :] = float("nan")
    if poison:
        cache[0] = float("nan")
    q_lat = torch.randn(len(lens), heads, lat, device=dev).to(DTYPE)
    q_rot = torch.randn(len(lens), heads, rope, device=dev).to(DTYPE)
    ctx = torch.tensor(lens, dtype=torch.int32, device=dev)
    return q_lat, q_rot, cache, tables, ctx


def _torch_context(q_lat, q_rot, cache, tables, lens, scale):  # type: ignore[no-untyped-def]
    """tandem.model.mla.absorbed_decode's attention (before W_UV): the rows' blocks
    gathered, padding masked by a key bias."""
    from tandem.model.attention import DecodeGroup
    from tandem.model.mla import gather_entries

    group = DecodeGroup.build(0, tables, lens, BLOCK)
    rows, lat = q_lat.shape[0], q_lat.shape[2]
    query = torch.cat((q_lat, q_rot), dim=-1)
    entries = gather_entries(cache, tables.flatten().long()).view(rows, -1, query.shape[-1])
    scores = torch.bmm(query, entries.transpose(1, 2)).float()
    probs = torch.softmax(scores.mul_(scale).add_(group.key_bias), dim=-1).to(entries.dtype)
    return torch.bmm(probs, entries[..., :lat])


def check_mla(ctx: Context) -> Figures:
    if not ctx.cuda:
        use_interpreter()
    from tandem.kernels.mla_decode import mla_decode_attention
    from tandem.kernels.reference import mla_decode_context

    dev, cuda, sz = ctx.device, ctx.cuda, ctx.sizes
    heads, lat, rope = (128, 512, 64) if cuda else (16, 32, 8)
    scale = (128 + rope) ** -0.5  # DeepSeek-V3's qk_head_dim (the yarn factor aside)
    figures: Figures = {"mode": "benchmark" if cuda else SMOKE, "heads": heads,
                        "kv_lora_rank": lat, "rope": rope, "block_size": BLOCK}  # fmt: skip
    time_s = functools.partial(median_time_s, device=dev, reps=sz.kn_reps)
    torch.manual_seed(0)
    try:  # 1. correctness
        lens = [1, BLOCK, 300, 1000] if cuda else [1, BLOCK, 70]
        q_lat, q_rot, cache, tables, ctx_lens = _case(lens, heads, lat, rope, dev, True)
        out = mla_decode_attention(q_lat, q_rot, cache, tables, ctx_lens, scale)
        cpu = cache.cpu()
        want = torch.stack([
            mla_decode_context(q_lat[r].cpu(), q_rot[r].cpu(), cpu, tables[r].tolist(), n, scale)
            for r, n in enumerate(lens)
        ]).to(dev)  # fmt: skip
        figures["correct"] = compare(out.float(), want.float(), *TOLERANCE)
    except Exception as exc:  # a launch or compile error on this device
        ctx.log(traceback.format_exc().rstrip())
        raise PartFailed(f"{type(exc).__name__}: {exc}", figures) from None
    ctx.log(f"mla: decode vs the reference: {figures['correct']}")
    if not figures["correct"]["passed"]:
        raise PartFailed(f"wrong results on {dev}: {figures['correct']}", figures)

    # 2. bandwidth
    figures["copy"] = copy_bandwidth(dev, sz.kn_copy_bytes, reps=sz.kn_reps)
    copy_gb_s = figures["copy"]["gb_s"]
    flush = torch.empty(sz.kn_flush_bytes, dtype=torch.uint8, device=dev) if cuda else None
    batches, contexts = ((1, 16, 64), (1024, 4096, 16384)) if cuda else ((2,), (64, 256))
    cases = []
    for batch in batches:
        for context in contexts:
            args = _case([context] * batch, heads, lat, rope, dev, False)
            call = functools.partial(mla_decode_attention, *args, scale)
            seconds = time_s(call, flush=flush)
            read = batch * context * (lat + rope) * DTYPE.itemsize
            gb_s = read / seconds / 1e9
            cases.append({"batch": batch, "context": context, "time_us": round(seconds * 1e6, 1),
                          "gb_s": round(gb_s, 1),
                          "of_copy": round(gb_s / copy_gb_s, 3)})  # fmt: skip
            ctx.log(f"mla: batch {batch:3d} x {context:6d}: {cases[-1]['time_us']:9.1f} us, "
                    f"{gb_s:8.4g} GB/s = {gb_s / copy_gb_s:.2f} of the copy")  # fmt: skip
            del args, call
            free_memory(dev)
    figures["decode"] = cases
    batch, context = (16, 4096) if cuda else (2, 64)
    q_lat, q_rot, cache, tables, lens_t = _case([context] * batch, heads, lat, rope, dev, False)
    kernel = time_s(lambda: mla_decode_attention(q_lat, q_rot, cache, tables, lens_t, scale))
    eager = time_s(lambda: _torch_context(q_lat, q_rot, cache, tables, lens_t, scale))
    figures["vs_torch"] = {"batch": batch, "context": context,
                           "kernel_us": round(kernel * 1e6, 1), "torch_us": round(eager * 1e6, 1),
                           "speedup": round(eager / kernel, 2)}  # fmt: skip
    ctx.log(f"mla: vs the torch form {figures['vs_torch']}")
    free_memory(dev)
    if not cuda:
        figures["note"] = "not judged as speed: a smoke run"
    return figures
