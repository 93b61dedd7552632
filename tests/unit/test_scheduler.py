"""Scheduler and KV manager with plain data: exact chunks, block ids, preemption, roles."""

from __future__ import annotations

import pytest

from tandem.config import SchedulerConfig
from tandem.engine.kv_manager import KVCacheManager
from tandem.engine.request import Request, RequestStatus
from tandem.engine.sampling import SampleResult, SamplingParams
from tandem.engine.scheduler import Scheduler, SchedulerOutput

BS = 4


def make(
    num_blocks: int = 8, max_seqs: int = 8, budget: int = 64, threshold: int | None = None
) -> Scheduler:
    kv = KVCacheManager(num_blocks, BS)
    cfg = SchedulerConfig(
        max_num_seqs=max_seqs, max_num_batched_tokens=budget, long_prefill_token_threshold=threshold
    )
    return Scheduler(cfg, kv, max_model_len=1000)


def req(rid: str, n: int, max_tokens: int = 4, first: int = 0, **kw) -> Request:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
    return Request(rid, list(range(first, first + n)), params, **kw)


def run_step(s: Scheduler, token: int = 99) -> SchedulerOutput:
    out = s.schedule()
    samples = {
        x.request.request_id: [SampleResult(token, None, None)] for x in out.scheduled if x.sample
    }
    s.update(out, samples)
    s.kv.check_integrity()
    return out


def plan(out: SchedulerOutput) -> list[tuple[str, int, int, bool]]:
    return [(x.request.request_id, x.start, x.num_new_tokens, x.sample) for x in out.scheduled]


def test_chunked_prefill_under_token_budget() -> None:
    s = make(num_blocks=16, budget=8)
    s.add_request(req("a", 20))
    s.add_request(req("b", 3))
    assert plan(run_step(s)) == [("a", 0, 8, False)]
    assert plan(run_step(s)) == [("a", 8, 8, False)]
    # a's last chunk (4) + b's whole prompt (3) share the step
    assert plan(run_step(s)) == [("a", 16, 4, True), ("b", 0, 3, True)]
    assert plan(run_step(s)) == [("a", 20, 1, True), ("b", 3, 1, True)]
    # b took block 5 in step 3; a's 21st token opened block 6 in step 4
    assert s.kv.get_block_ids("a") == [0, 1, 2, 3, 4, 6]
    assert s.kv.get_block_ids("b") == [5]


def test_long_prefill_threshold_caps_one_requests_chunk() -> None:
    s = make(num_blocks=16, budget=64, threshold=6)
    s.add_request(req("a", 10))
    s.add_request(req("b", 10, first=50))
    assert plan(run_step(s)) == [("a", 0, 6, False), ("b", 0, 6, False)]


def test_max_num_seqs_limits_running() -> None:
    s = make(max_seqs=2)
    for rid in "abc":
        s.add_request(req(rid, 2, first=ord(rid)))
    out = run_step(s)
    assert [x.request.request_id for x in out.scheduled] == ["a", "b"]
    assert [r.request_id for r in s.waiting] == ["c"]


def test_finished_requests_free_their_blocks() -> None:
    s = make()
    s.add_request(req("a", 3, max_tokens=2))
    run_step(s)
    assert s.kv.num_free_blocks == 7
    run_step(s)  # second token: max_tokens reached
    assert not s.running and s.kv.num_free_blocks == 8


def test_eos_and_stop_token_ids_finish() -> None:
    s = make()
    s.add_request(req("a", 3, max_tokens=10, eos_token_ids=(99,)))
    run_step(s, token=99)
    assert not s.running
    r = req("b", 3, max_tokens=10, eos_token_ids=(99,))
    r.sampling_params = SamplingParams(max_tokens=10, ignore_eos=True, stop_token_ids=(7,))
    s.add_request(r)
    run_step(s, token=99)
    assert s.running == [r]
    run_step(s, token=7)
    assert r.status == RequestStatus.FINISHED_STOPPED and r.stop_reason == 7


def test_prefix_cache_hit_skips_compute() -> None:
    s = make(num_blocks=16)
    s.add_request(req("a", 10, max_tokens=1))
    run_step(s)  # a: 10 prompt tokens, 2 full blocks cached, then finishes
    assert s.kv.num_free_blocks == 16
    b = req("b", 10, max_tokens=1)
    b.prompt_token_ids = list(range(8)) + [70, 71, 72]
    s.add_request(b)
    out = run_step(s)
    assert plan(out) == [("b", 8, 3, True)]
    assert b.num_cached_tokens == 8
    # the cached blocks were a's first two (freed tail-first, so still in the cache)
    assert out.scheduled[0].block_ids[:2] == (0, 1)


def test_fully_cached_prompt_still_computes_its_last_token() -> None:
    s = make(num_blocks=16)
    s.add_request(req("a", 8, max_tokens=1))
    run_step(s)
    s.add_request(req("b", 8, max_tokens=1))
    assert plan(run_step(s)) == [("b", 4, 4, True)]  # last block recomputed, not reused


def test_preemption_frees_latest_request_and_recomputes() -> None:
    s = make(num_blocks=4, budget=64)
    s.add_request(req("a", 6, max_tokens=8))  # 2 blocks
    s.add_request(req("b", 6, max_tokens=8, first=20))  # 2 blocks
    run_step(s)
    assert s.kv.num_free_blocks == 0
    run_step(s)  # both reach 7 tokens: still fits
    run_step(s)  # 8 tokens each: still 2 blocks each
    assert s.num_preemptions == 0
    out = run_step(s)  # a needs a third block -> b is preempted
    assert out.preempted_ids == ["b"]
    assert s.num_preemptions == 1  # the worker's counter (GetStats, metrics)
    assert plan(out) == [("a", 8, 1, True)]
    b = s.waiting[0]
    assert b.request_id == "b" and b.status == RequestStatus.PREEMPTED
    assert b.num_computed_tokens == 0 and b.num_preemptions == 1
    assert b.output_token_ids == [99, 99, 99]
    # b freed [2, 3] tail-first, so its last block is the first one reused
    assert s.kv.get_block_ids("a") == [0, 1, 3]


def test_preempted_request_reuses_its_cached_blocks() -> None:
    s = make(num_blocks=5, budget=64)
    s.add_request(req("a", 8, max_tokens=20))
    s.add_request(req("b", 8, max_tokens=20, first=40))
    for _ in range(6):
        out = run_step(s)
        if out.preempted_ids:
            break
    assert out.preempted_ids == ["b"]
    # b's blocks went back to the free queue with their hashes; a cache hit revives them
    hits, n = s.kv.get_computed_blocks(s.waiting[0])
    assert n >= 8 and hits
    # 5 blocks never hold both as they grow: they take turns. The counter is every
    # preemption since start, a request preempted twice counted twice.
    requests = [*s.running, *s.waiting]
    for _ in range(20):
        run_step(s)
    assert s.num_preemptions == sum(r.num_preemptions for r in requests) >= 2


def test_abort_anywhere_frees_blocks() -> None:
    s = make()
    s.add_request(req("a", 5))
    s.add_request(req("b", 5, first=10))
    run_step(s)
    s.add_request(req("c", 5, first=30))
    assert s.finish("a", RequestStatus.FINISHED_ABORTED) is not None
    assert s.finish("c", RequestStatus.FINISHED_ABORTED) is not None
    assert s.finish("zzz", RequestStatus.FINISHED_ABORTED) is None
    assert [r.request_id for r in s.running] == ["b"]
    assert not s.waiting
    s.kv.check_integrity()
    assert s.kv.num_free_blocks == 6


def test_hand_off_pins_blocks_until_released() -> None:
    s = make()
    r = req("p", 9, max_tokens=10, hand_off=True)
    s.add_request(r)
    run_step(s)
    assert r.status == RequestStatus.HANDED_OFF and r.output_token_ids == [99]
    assert not s.running and s.kv.get_block_ids("p") == [0, 1, 2]
    assert not s.schedule().scheduled  # pinned, not scheduled
    s.finish("p", RequestStatus.FINISHED_STOPPED)
    assert s.kv.num_free_blocks == 8


def test_hand_off_request_that_stops_at_token_one_is_not_pinned() -> None:
    s = make()
    r = req("p", 9, max_tokens=1, hand_off=True)
    s.add_request(r)
    run_step(s)
    assert r.status == RequestStatus.FINISHED_LENGTH and s.kv.num_free_blocks == 8


def test_reserve_and_commit_kv_for_decode_role() -> None:
    s = make()
    r = req("d", 9, max_tokens=3)
    r.output_token_ids = [5]
    table, cached = s.reserve_kv(r) or ([], -1)
    assert (table, cached) == ([0, 1, 2], 0)
    assert r.status == RequestStatus.WAITING_FOR_KV
    assert not s.schedule().scheduled  # waits for its KV
    s.commit_kv("d")
    out = run_step(s)
    assert plan(out) == [("d", 9, 1, True)]  # only the first output token's KV is computed
    assert r.output_token_ids == [5, 99]
    with pytest.raises(ValueError, match="not waiting for KV"):
        s.commit_kv("d")


def test_committed_hand_offs_start_before_a_preempted_request_that_cannot() -> None:
    """A decode worker: p runs with 4 of 8 blocks; hand-offs b and c reserve and commit the
    other 4. p's next token needs a fifth block, so p preempts itself and waits, needing 5
    blocks with 4 free, while b and c hold the rest. Queued ahead of them, p would wait
    forever (nothing runs, nothing frees a block); queued behind them, b and c start,
    finish and give their blocks back, and then p recomputes and finishes."""
    s = make(num_blocks=8)
    s.add_request(req("p", 16, max_tokens=6))
    run_step(s)  # p's prompt: 4 blocks, its first token sampled
    for rid, first in (("b", 100), ("c", 200)):
        r = req(rid, 7, max_tokens=2, first=first)
        r.output_token_ids = [5]
        assert s.reserve_kv(r) is not None  # 2 blocks each
        s.commit_kv(rid)
    assert s.kv.num_free_blocks == 0
    out = run_step(s)
    assert out.preempted_ids == ["p"] and not out.scheduled
    # behind the committed hand-offs (newest commit first), ahead of any new arrival
    s.add_request(req("n", 4, first=300))
    assert [r.request_id for r in s.waiting] == ["c", "b", "p", "n"]
    out = run_step(s)
    assert plan(out) == [("c", 7, 1, True), ("b", 7, 1, True)]  # not stuck behind p
    steps = 0
    while s.has_work() and steps < 20:
        run_step(s)
        steps += 1
    assert not s.has_work()  # every request finished: p recomputed once b and c were done
    assert s.kv.num_free_blocks == 8


def test_reserve_kv_uses_local_prefix_cache_and_fails_cleanly() -> None:
    s = make(num_blocks=4)
    s.add_request(req("a", 9, max_tokens=1))
    run_step(s)
    r = req("d", 9, max_tokens=3)
    r.output_token_ids = [5]
    # a's blocks 0 and 1 hold the first 8 prompt tokens; block 3 was never used
    assert s.reserve_kv(r) == ([0, 1, 3], 8)
    big = req("e", 16, max_tokens=3, first=100)
    big.output_token_ids = [5]
    assert s.reserve_kv(big) is None
    assert "e" not in s.waiting_for_kv
    s.kv.check_integrity()


def test_max_model_len_finishes_with_length() -> None:
    kv = KVCacheManager(8, BS)
    s = Scheduler(SchedulerConfig(), kv, max_model_len=6)
    r = req("a", 5, max_tokens=100)
    s.add_request(r)
    run_step(s)
    assert r.status == RequestStatus.FINISHED_LENGTH and r.num_tokens == 6


def test_queued_prefill_tokens() -> None:
    s = make(budget=4, num_blocks=16)
    s.add_request(req("a", 10))
    s.add_request(req("b", 6, first=30))
    assert s.queued_prefill_tokens() == 16
    run_step(s)
    assert s.queued_prefill_tokens() == 12
