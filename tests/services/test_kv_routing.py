"""KV-aware placement with real workers, a real Redis index, and Redis dying mid-run."""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tandem.client import TandemClient, TandemError
from tandem.engine.prefix_hash import hash_blocks
from tandem.routing.policy import home_rank
from tandem.services.common.redis.server import RedisServer
from tandem.weights.tiny import make_tiny_model


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("kv") / "tiny", preset="tiny")


@pytest.fixture
def redis_private() -> Iterator[RedisServer]:
    with RedisServer(port=0) as server:
        yield server


def until(predicate, timeout_s: float = 30.0, what: str = "condition"):
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"{what} never reached"
        time.sleep(0.2)


def test_shared_prefix_follows_the_cache_and_survives_redis_dying(procs, model_dir, redis_private):
    worker, router, stop = procs.worker, procs.router, procs.stop
    url = redis_private.url
    started = [
        worker("prefill", model_dir, url, "p0")[0],
        worker("prefill", model_dir, url, "p1")[0],
        worker("decode", model_dir, url, "d0")[0],
    ]
    # Always disaggregate, so the prefill worker's cache affinity is what is tested (with the
    # default threshold the decode worker, which holds the pulled prefix too, would prefill).
    rtr, address = router(model_dir, url, "--disagg-min-uncached-tokens", "0")
    started.append(rtr)
    rng = random.Random(0)
    prefix = rng.choices(range(5, 512), k=160)  # 10 blocks of 16

    def ask(client: TandemClient, suffix_len: int = 8):
        prompt = prefix + rng.choices(range(5, 512), k=suffix_len)
        return client.generate(prompt, max_tokens=2, temperature=0.0)

    try:
        with TandemClient(address, timeout_s=60) as client:
            until(lambda: _ok(client), what="router ready")
            first = ask(client)
            assert first.disaggregated and first.route_cached_tokens == 0
            # once the prefill worker's events reach the index, the prefix routes to it
            second = until(
                lambda: (r := ask(client)).route_cached_tokens >= 160 and r,
                what="cache-aware placement",
            )
            assert second.prefill_worker == first.prefill_worker
            assert second.cached_prompt_tokens >= 160  # the worker really reused the blocks
            assert "kv:" in second.route_reason

            redis_private.kill()
            # no request fails while the index and registry are down: load-only placement
            degraded = [ask(client) for _ in range(3)]
            assert all(r.completion_tokens == 2 for r in degraded)
            assert all(r.index_degraded and r.route_cached_tokens == 0 for r in degraded)

            redis_private.restart()
            # workers re-register and resync their caches; routing is KV-aware again
            again = until(
                lambda: (r := ask(client)).route_cached_tokens >= 160 and r,
                timeout_s=60,
                what="KV-aware routing after Redis came back",
            )
            assert not again.index_degraded
            assert again.prefill_worker == first.prefill_worker
    finally:
        stop(*started)


def test_decode_worker_holding_the_prefix_prefills_the_tail_itself(procs, model_dir, redis_url):
    """Conditional disaggregation on *uncached* tokens: once the decode worker has pulled a
    prompt's KV, a request sharing that prefix with a short new tail is prefilled on the decode
    worker, from its cache, with no prefill hop or transfer; outputs stay exact."""
    worker, router, stop = procs.worker, procs.router, procs.stop
    started = [
        worker("prefill", model_dir, redis_url, "p0")[0],
        worker("decode", model_dir, redis_url, "d0")[0],
    ]
    rtr, address = router(model_dir, redis_url)  # default: --disagg-min-uncached-tokens 64
    started.append(rtr)
    rng = random.Random(1)
    prefix = rng.choices(range(5, 512), k=320)  # 20 blocks of 16
    try:
        with TandemClient(address, timeout_s=60) as client:
            until(lambda: _ok(client), what="router ready")
            first = client.generate(prefix + [7, 8, 9], max_tokens=4, temperature=0.0)
            assert first.disaggregated and first.prefill_worker == "p0"
            tail = rng.choices(range(5, 512), k=20)

            def on_decode():
                r = client.generate(prefix + tail, max_tokens=4, temperature=0.0)
                return r if not r.disaggregated else None

            local = until(on_decode, what="the decode worker's cache to reach the index")
            assert local.decode_worker == "d0"
            assert local.route_cached_tokens >= 320
            assert local.cached_prompt_tokens >= 320  # prefilled from d0's own cache
            assert "prefill on d0" in local.route_reason
            # A different long prompt still goes to the prefill worker.
            other = client.generate(rng.choices(range(5, 512), k=200), max_tokens=2)
            assert other.disaggregated and other.cached_prompt_tokens == 0
    finally:
        stop(*started)

    # The same prompt on a single engine gives the same tokens.
    from tandem.config import EngineConfig
    from tandem.engine import LLMEngine, SamplingParams

    engine = LLMEngine(EngineConfig(model_dir=str(model_dir), dtype="float32"))
    [ref] = engine.generate([prefix + tail], SamplingParams(max_tokens=4, temperature=0.0))
    assert local.token_ids == ref.token_ids


def _ok(client: TandemClient) -> bool:
    try:
        return client.generate([5, 6, 7], max_tokens=1).completion_tokens == 1
    except TandemError:
        return False


def test_two_routers_see_the_same_index_and_workers(procs, model_dir, redis_private):
    worker, router, stop = procs.worker, procs.router, procs.stop
    url = redis_private.url
    started = [
        worker("prefill", model_dir, url, "p0")[0],
        worker("prefill", model_dir, url, "p1")[0],
        worker("decode", model_dir, url, "d0")[0],
    ]
    r1, a1 = router(model_dir, url, "--disagg-min-uncached-tokens", "0")
    r2, a2 = router(model_dir, url, "--disagg-min-uncached-tokens", "0")
    started += [r1, r2]
    rng = random.Random(1)
    prefix = rng.choices(range(5, 512), k=96)
    try:
        with TandemClient(a1, timeout_s=60) as c1, TandemClient(a2, timeout_s=60) as c2:
            until(lambda: _ok(c1) and _ok(c2), what="routers ready")
            # router 1 places the first request; its prefill worker now holds the prefix
            first = c1.generate(prefix + [7, 8], max_tokens=1, temperature=0.0)
            # router 2 never saw that request, yet it routes the prefix to the same worker
            second = until(
                lambda: (
                    (r := c2.generate(prefix + [9], max_tokens=1)).route_cached_tokens >= 96 and r
                ),
                what="router 2 sees router 1's placement in the index",
            )
            assert second.prefill_worker == first.prefill_worker
            # A prompt nobody caches goes to its home prefill worker, the same one whichever
            # router places it: rendezvous hashing of the chained hash of its first 16 blocks.
            # The rule applies when the workers' reported loads are equal: a request
            # placed before the last one's load report cleared goes to the less loaded
            # worker instead, so wait out two heartbeats (0.5 s) between requests, and
            # count the placements the rule made (every one of them must be home).
            homed = 0
            for i in range(16):
                time.sleep(1.2)
                prompt = rng.choices(range(5, 512), k=320)
                key = hash_blocks(prompt, 16, (model_dir.name,))[15]
                home = max(("p0", "p1"), key=lambda w: home_rank(key, w))
                r = (c1 if i % 2 else c2).generate(prompt, max_tokens=1)
                if "prefix home" in r.route_reason:  # the two workers' loads were equal
                    assert r.prefill_worker == home, r.route_reason
                    homed += 1
                if homed == 4:
                    break
            assert homed == 4
            # and both routers know the same workers (a request for each lands on d0)
            assert {
                c1.generate([5, 6], max_tokens=1).decode_worker,
                c2.generate([5, 6], max_tokens=1).decode_worker,
            } == {"d0"}
    finally:
        stop(*started)
