"""What an engine holds besides its weights and KV cache, structure by structure.

Two kinds, told apart by their bound:

  per request   one entry per request the engine holds (`bound` None): back to 0 whenever
                no request is in flight; a count that stays above 0 is a request's state
                that outlived it.
  bounded       a cache keyed by something other than a request (a grammar, a product
                shape): at most `bound` entries, however long the worker runs.

A worker exports both (`tandem_worker_state_entries` and `tandem_worker_state_bound` by
structure); the prefill-memory test and the soak read them. The reads are single `len`
calls, safe from another thread as a hint (the numbers may be one step old).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

from tandem.model.linear import MatmulKind, onednn_row_counts

if TYPE_CHECKING:
    from tandem.engine.engine import LLMEngine


class StateSize(NamedTuple):
    entries: int
    bound: int | None  # None: per request, 0 when the engine holds none


def engine_footprint(engine: LLMEngine) -> dict[str, StateSize]:
    """Every structure of `engine` that grows with its traffic, by name."""
    sched = engine.scheduler
    sizes = {
        "engine_requests": StateSize(len(engine._requests), None),
        "engine_text_streams": StateSize(len(engine._texts), None),
        "scheduler_requests": StateSize(
            len(sched.waiting)
            + len(sched.running)
            + len(sched.waiting_for_kv)
            + len(sched.handed_off),
            None,
        ),
        "kv_block_tables": StateSize(len(engine.kv.block_tables), None),
        "kv_published_requests": StateSize(len(engine.kv._num_cached_blocks), None),
        "kv_first_live": StateSize(len(engine.kv._first_live), None),
    }
    tables = engine.runner.block_tables
    if tables is not None:
        sizes["device_block_table_rows"] = StateSize(len(tables.request_ids()), None)
    if engine.grammars is not None:
        grammars = engine.grammars
        sizes["grammar_cache"] = StateSize(len(grammars._compiled), grammars.cache_size)
    runner, model = engine.runner, engine.model
    if model.linear_states is not None:  # linear-attention layers (Qwen3-Next)
        sizes["linear_state_slots"] = StateSize(len(runner._state_slots), None)
        sizes["linear_state_positions"] = StateSize(len(runner._state_pos), None)
        ckpts = engine.kv.checkpoints
        if ckpts is not None:
            sizes["linear_state_checkpoints"] = StateSize(len(ckpts), ckpts.num_slots)
    if engine.speculator is not None:
        sizes.update((k, StateSize(*v)) for k, v in engine.speculator.footprint().items())
    if engine.state_handoff is not None:
        sizes["state_handoff_reserved"] = StateSize(engine.state_handoff.num_reserved(), None)
    if engine.draft_handoff is not None:  # a draft model: its requests' KV, hand-offs
        proposer = engine.draft_handoff.proposer
        sizes["draft_handoff_reserved"] = StateSize(engine.draft_handoff.num_reserved(), None)
        sizes["draft_kv_requests"] = StateSize(len(proposer._tables), None)
        sizes["draft_written"] = StateSize(len(proposer._written), None)
    if getattr(model, "matmul", None) is MatmulKind.ONEDNN:
        max_rows = engine.config.scheduler.max_step_rows
        sizes["onednn_row_counts"] = StateSize(
            len(model.onednn_row_counts), len(onednn_row_counts(max_rows))
        )
    return sizes
