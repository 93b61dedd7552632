"""Re-prefill end to end: every hand-off's lease lapses before the decode worker confirms it
(lease_ttl_s of a tenth of a millisecond), so the decode worker reports `kv_failed`, the
router prefills again on the other prefill worker, and when that one's hand-off lapses too,
the decode worker recomputes the prompt. The client gets the right tokens and the story."""

from __future__ import annotations

import pytest

from tandem.client import TandemClient
from tandem.config import CacheConfig, EngineConfig
from tandem.engine.engine import LLMEngine
from tandem.engine.sampling import SamplingParams
from tandem.v1 import worker_pb2 as wpb
from tandem.v1 import worker_pb2_grpc as wgrpc
from tests.services.conftest import KV_BYTES


@pytest.fixture(scope="module")
def lapsing_cluster(tiny_model_dir, redis_server, procs):  # type: ignore[no-untyped-def]
    import redis as redis_lib

    client = redis_lib.Redis.from_url(redis_server.url)
    client.flushall()
    client.close()
    url = redis_server.url
    started = [
        procs.worker("prefill", tiny_model_dir, url, f"lapse-p{i}", "--lease-ttl-s", "0.0001")
        for i in range(2)
    ]
    started.append(procs.worker("decode", tiny_model_dir, url, "lapse-d0"))
    router, address = procs.router(tiny_model_dir, url, "--disagg-min-uncached-tokens", "16")
    yield address, [a for _, a in started]
    procs.stop(router, *(p for p, _ in started))


def test_lapsed_handoffs_reprefill_then_recompute(lapsing_cluster, tiny_model_dir) -> None:
    import grpc

    address, worker_addresses = lapsing_cluster
    prompt = list(range(10, 110))
    with TandemClient(address, timeout_s=60) as client:
        result = client.generate(prompt, max_tokens=12, temperature=0.0, ignore_eos=True)
    engine = LLMEngine(
        EngineConfig(
            model_dir=str(tiny_model_dir),
            dtype="float32",
            cache=CacheConfig(kv_cache_bytes=KV_BYTES),
        )
    )
    [want] = engine.generate(
        [prompt], SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    )
    assert result.token_ids == want.token_ids
    assert result.reprefills == 1, result.recoveries
    assert len(result.recoveries) == 2, result.recoveries
    first, second = result.recoveries
    assert "kv_pull_failed" in first and "lapsed" in first and first.count("reprefill on") == 1
    assert "kv_pull_failed" in second and "recompute on decode lapse-d0" in second
    assert "no other healthy prefill worker" in second
    for a in worker_addresses:  # nothing pinned or held anywhere
        with grpc.insecure_channel(a) as ch:
            stub = (
                wgrpc.DecodeWorkerStub if a == worker_addresses[-1] else wgrpc.PrefillWorkerStub
            )(ch)
            s = stub.GetStats(wpb.GetStatsRequest(), timeout=5)
            assert s.num_pinned_requests == 0 and s.num_running == 0
