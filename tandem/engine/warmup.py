"""An engine's warm-up: the steps, compilations and graph captures before traffic."""

from __future__ import annotations

import logging
import time
from typing import Any

from tandem.engine.device import use_device
from tandem.engine.loading import compile_matmuls
from tandem.engine.ranks import decode_capture_plan
from tandem.engine.request import RequestSpec
from tandem.engine.sampling import SamplingParams

log = logging.getLogger(__name__)
WARMUP_REQUEST_ID = "__tandem_warmup__"


def warm_up(engine: Any) -> None:  # an LLMEngine (which imports this module: not typed here)
    """Run one prefill step at the full token budget and a few decode steps before
    traffic, so the first requests do not pay for allocator growth and kernel set-up,
    compile every oneDNN matmul kernel the engine can need (`compile_matmuls`) and the
    attention kernel variants those steps did not hit, then (on CUDA with
    the Triton backend) capture the decode steps' CUDA graphs (with tensor parallelism
    every rank captures the same ones, the collectives inside: `decode_capture_plan`).
    Leaves no trace: no cached prefix, no KV events, no counters, nothing in a KV tier.

    Makes the engine's device current in the calling thread, which should be the one
    that steps the engine (see `tandem.engine.device`)."""
    use_device(engine.config.device)
    if engine.tiers is not None:  # nothing of the warm-up goes down a tier
        engine.tiers.paused = True
    if engine.grammars is not None:
        try:  # the vocabulary's token trie, before the first constrained request
            engine.grammars.load()
        except ValueError as exc:
            log.warning("%s; constrained requests will be refused", exc)
    n = max(1, min(engine.config.scheduler.max_num_batched_tokens, engine.max_model_len - 5))
    vocab = engine.model.config.vocab_size
    prompt = [(7 + i) % vocab for i in range(n)]
    params = SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.0)
    engine.add_request(RequestSpec(WARMUP_REQUEST_ID, tuple(prompt), params))
    t0, first = time.perf_counter(), True
    while engine.has_unfinished():
        outputs = engine.step()
        if first:  # the whole prompt in one step: a first (pessimistic) prefill rate
            engine.warmup_prefill_tokens_per_s = n / max(time.perf_counter() - t0, 1e-6)
            first = False
        for out in outputs:
            if out.handed_off:  # the prefill role pins the blocks; nobody will read them
                engine.release(out.request_id)
    engine.kv.reset_prefix_cache()
    if engine.tiers is not None:
        engine.tiers.paused = False
        engine.tiers.prefill_tokens_per_s = engine.warmup_prefill_tokens_per_s
    engine.take_kv_events()
    engine.num_steps = engine.num_tokens_computed = 0
    if engine.speculator is not None:  # its drafts are not traffic's
        engine.speculator.reset_stats()
    compile_matmuls(engine.model, engine.config)
    engine.model.attention.warm_up(
        engine.kv_cache[:, 0], engine.model.config.num_q_heads, engine.max_model_len
    )
    if engine._graphs_wanted and engine.runner.graphs is None:
        t0 = time.perf_counter()
        plan = decode_capture_plan(engine.config, engine.max_model_len, engine.num_blocks)
        engine.runner.capture_graphs(plan)
        log.info(
            "captured CUDA graphs of decode steps for %d batch sizes (1..%d) in %.1fs",
            len(plan.sizes), plan.sizes[-1], time.perf_counter() - t0,
        )  # fmt: skip
