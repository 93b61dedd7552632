"""The router's in-flight accounting and prefix key (tandem.routing), exact."""

from __future__ import annotations

from tandem.routing import InflightLoad, Placement, RouteKind, WorkerLoad, prefix_key

P = WorkerLoad(worker_id="p0", role="prefill", address="a:1", queued_prefill_tokens=5)
D = WorkerLoad(worker_id="d0", role="decode", address="a:2", num_running=1)


def test_disaggregated_request_counts_until_token_1_then_until_the_end() -> None:
    load = InflightLoad()
    dispatch = load.dispatch(Placement(D, P, RouteKind.KV_AFFINITY, "kv"), 100)
    assert load.with_inflight(P).inflight_prefill_tokens == 100
    assert load.with_inflight(P).prefill_queue == 105
    assert load.with_inflight(D).inflight_requests == 1
    dispatch.prefill_done()
    assert load.with_inflight(P).inflight_prefill_tokens == 0
    assert load.with_inflight(D).inflight_requests == 1
    dispatch.finish()
    assert load.decode_requests == {} and load.prefill_tokens == {}


def test_finish_without_token_1_also_returns_the_prefill_tokens_once() -> None:
    load = InflightLoad()
    first = load.dispatch(Placement(D, P, RouteKind.KV_AFFINITY, "kv"), 100)
    second = load.dispatch(Placement(D, P, RouteKind.KV_AFFINITY, "kv"), 30)
    first.finish()
    first.finish()  # error paths may finish twice: counted once
    first.prefill_done()
    assert load.prefill_tokens == {"p0": 30}
    assert load.decode_requests == {"d0": 1}
    second.finish()
    assert load.decode_requests == {} and load.prefill_tokens == {}


def test_colocated_request_counts_only_on_the_decode_worker() -> None:
    load = InflightLoad()
    dispatch = load.dispatch(Placement(D, None, RouteKind.SHORT_PROMPT, "short"), 10)
    assert not dispatch.prefill_pending
    assert load.prefill_tokens == {} and load.decode_requests == {"d0": 1}
    dispatch.finish()
    assert load.decode_requests == {}


def test_with_inflight_keeps_the_reported_load() -> None:
    load = InflightLoad()
    load.dispatch(Placement(D, P, RouteKind.KV_AFFINITY, "kv"), 7)
    seen = load.with_inflight(D)
    assert (seen.num_running, seen.inflight_requests, seen.decode_load) == (1, 1, 1)
    assert (
        load.with_inflight(WorkerLoad(worker_id="d9", role="decode", address="x")).inflight_requests
        == 0
    )


def test_prefix_key_is_the_hash_of_block_affinity_blocks_or_the_last_full_block() -> None:
    hashes = [11, 22, 33, 44]
    assert prefix_key(hashes, 2) == 22
    assert prefix_key(hashes, 4) == 44
    assert prefix_key(hashes, 16) == 44  # shorter prompt: its last full block
    assert prefix_key([], 16) is None  # under one block: no key
