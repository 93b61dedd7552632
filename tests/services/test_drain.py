"""Draining a prefill worker with committed hand-offs pending (issue 46): real processes, real
Redis, signed hand-offs. On SIGTERM (a rolling upgrade, a scale-down, the pod's preStop) the
worker takes no new work at once, keeps serving the KV pulls of every hand-off it committed
until each is pulled or its lease lapses, then deregisters and exits 0. A decode worker that
pulls during the drain gets the blocks: nothing is prefilled again."""

from __future__ import annotations

import random
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import grpc
import pytest
import redis

from tandem.engine.engine import LLMEngine
from tandem.services.common.redis.server import RedisServer
from tandem.services.common.redis.worker_info import KEY_PREFIX
from tandem.services.common.security import AuthConfig, internal_metadata
from tandem.v1 import worker_pb2_grpc as wgrpc
from tests.services.test_forged_handoff import decode, greedy, prefill, stats
from tests.services.test_moe_up import reference_engine
from tests.services.workers import signed_worker_args

LEASE_TTL_S = 5.0  # how long an unpulled hand-off keeps a draining worker


@pytest.fixture
def pair(
    tiny_model_dir: Path,
    redis_server: RedisServer,
    procs: SimpleNamespace,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[SimpleNamespace]:
    """A prefill and a decode worker; the test drains the prefill one."""
    secret_file, common = signed_worker_args(redis_server.url, tmp_path_factory.mktemp("secret"))
    common = (*common, "--lease-ttl-s", str(LEASE_TTL_S))  # the later flag wins
    started, channels = [], []
    try:
        p, p_addr = procs.worker("prefill", tiny_model_dir, redis_server.url, "prefill-d", *common)
        started.append(p)
        d, d_addr = procs.worker("decode", tiny_model_dir, redis_server.url, "decode-d", *common)
        started.append(d)
        channels = [grpc.insecure_channel(a) for a in (p_addr, d_addr)]
        yield SimpleNamespace(
            metadata=internal_metadata(AuthConfig(cluster_secret_file=str(secret_file))),
            prefill=wgrpc.PrefillWorkerStub(channels[0]),
            decode=wgrpc.DecodeWorkerStub(channels[1]),
            prefill_proc=p,
            redis_url=redis_server.url,
        )
    finally:
        for channel in channels:
            channel.close()
        procs.stop(*started)


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path) -> LLMEngine:
    return reference_engine(tiny_model_dir)


def prompt(seed: int) -> list[int]:
    return random.Random(seed).choices(range(5, 512), k=45)


def registered(c: SimpleNamespace, worker_id: str) -> bool:
    client = redis.Redis.from_url(c.redis_url)
    try:
        return bool(client.exists(KEY_PREFIX + worker_id))
    finally:
        client.close()


def test_a_draining_prefill_worker_serves_its_pending_handoffs_then_exits(pair, reference):  # type: ignore[no-untyped-def]
    c = pair
    pending = {rid: prompt(i) for i, rid in enumerate(("h1", "h2"))}
    firsts = {rid: prefill(c, rid, p) for rid, p in pending.items()}
    assert stats(c, c.prefill).num_pinned_requests == 2
    c.prefill_proc.terminate()  # SIGTERM: drain
    deadline, n = time.monotonic() + 10, 0
    while True:  # new work is refused at once
        n += 1
        try:
            prefill(c, f"late-{n}", prompt(9))
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.UNAVAILABLE
            assert "draining" in (exc.details() or "")
            break
        assert time.monotonic() < deadline, "a draining worker kept taking prefills"
    for rid, p in pending.items():  # the committed hand-offs are pulled, not prefilled again
        tokens, complete = decode(c, rid, p, firsts[rid])
        assert tokens == greedy(reference, p)
        assert not complete.recomputed and complete.kv_transfer_bytes > 0
    # every lease confirmed (the "late" prefill, if it got in before the drain began, is
    # still pinned: its lease lapses within LEASE_TTL_S), then the worker leaves and exits 0
    assert c.prefill_proc.wait(timeout=LEASE_TTL_S + 15) == 0
    assert not registered(c, "prefill-d")


def test_a_drain_waits_for_an_unpulled_handoff_only_until_its_lease_lapses(pair):  # type: ignore[no-untyped-def]
    c = pair
    prefill(c, "never-pulled", prompt(20))
    t0 = time.monotonic()
    c.prefill_proc.terminate()
    time.sleep(1.0)
    assert c.prefill_proc.poll() is None  # still serving the pending hand-off's KV
    assert c.prefill_proc.wait(timeout=LEASE_TTL_S + 15) == 0
    assert time.monotonic() - t0 < LEASE_TTL_S + 10
