"""Reaching the workers of a `tandem up` cluster from a test: stubs carrying the cluster key
its processes require, the check that a cluster holds nothing after its requests, and the
check that it answers greedy prompts as the single engine does."""

from __future__ import annotations

import asyncio
import contextlib
import random
import secrets
import time
from collections.abc import AsyncIterable, Callable, Iterable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import grpc
import redis

from tandem.client import AsyncTandemClient
from tandem.engine.engine import LLMEngine
from tandem.engine.sampling import SamplingParams
from tandem.services.common.security import AuthConfig, internal_metadata
from tandem.services.up import Cluster
from tandem.v1 import worker_pb2 as wpb
from tandem.v1 import worker_pb2_grpc as wgrpc


def signed_worker_args(redis_url: str, secret_dir: Path) -> tuple[Path, tuple[str, ...]]:
    """For a test's own workers on `redis_url` (emptied first: no other test's registrations
    or leases): a fresh cluster secret's file in `secret_dir`, and the flags giving the
    workers that secret and leases that outlive a slow test."""
    client = redis.Redis.from_url(redis_url)
    client.flushall()
    client.close()
    secret_file = secret_dir / "cluster.secret"
    secret_file.write_text(secrets.token_hex(32))
    return secret_file, ("--cluster-secret-file", str(secret_file), "--lease-ttl-s", "120")


@contextlib.contextmanager
def signed_pair(
    model_dir: Path, redis_url: str, procs: Any, secret_dir: Path
) -> Iterator[SimpleNamespace]:
    """A prefill and a decode worker over `model_dir` sharing a fresh cluster secret (real
    processes on `redis_url`): their stubs, the call metadata, and the hand-off key, with
    which a test signs a handle as an owner holding the secret would."""
    from tandem.services.common.security import derive_key, load_secret

    secret_file, common = signed_worker_args(redis_url, secret_dir)
    started: list[Any] = []
    try:
        prefill, prefill_address = procs.worker(
            "prefill", model_dir, redis_url, "prefill-0", *common
        )
        started.append(prefill)
        decode, decode_address = procs.worker("decode", model_dir, redis_url, "decode-0", *common)
        started.append(decode)
        channels = [grpc.insecure_channel(a) for a in (prefill_address, decode_address)]
        yield SimpleNamespace(
            key=derive_key(load_secret(secret_file), "kv-handoff"),
            metadata=internal_metadata(AuthConfig(cluster_secret_file=str(secret_file))),
            prefill=wgrpc.PrefillWorkerStub(channels[0]),
            decode=wgrpc.DecodeWorkerStub(channels[1]),
        )
        for channel in channels:
            channel.close()
    finally:
        procs.stop(*started)


def prefill_result(events: Iterable[wpb.PrefillEvent]) -> wpb.PrefillResponse:
    """The result of a Prefill stream (its progress messages skipped)."""
    for event in events:
        if event.WhichOneof("kind") == "result":
            return event.result
    raise AssertionError("the Prefill stream ended without a result")


async def aprefill_result(events: AsyncIterable[wpb.PrefillEvent]) -> wpb.PrefillResponse:
    async for event in events:
        if event.WhichOneof("kind") == "result":
            return event.result
    raise AssertionError("the Prefill stream ended without a result")


class _ClusterKey(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    """Adds the cluster key `tandem up` gave its processes: workers refuse calls without."""

    def __init__(self, cluster: Cluster) -> None:
        auth = AuthConfig(cluster_secret_file=str(cluster.cluster_secret_file))
        self.metadata = internal_metadata(auth)

    def _details(self, details):  # type: ignore[no-untyped-def]
        return details._replace(metadata=[*(details.metadata or ()), *self.metadata])

    def intercept_unary_unary(self, continuation, details, request):  # type: ignore[no-untyped-def]
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation, details, request):  # type: ignore[no-untyped-def]
        return continuation(self._details(details), request)


def worker_stub(cluster: Cluster, role: str):
    line = next(c.ready_line for c in cluster.children if c.name == f"{role}-0")
    address = line.split()[-1]
    channel = grpc.intercept_channel(grpc.insecure_channel(address), _ClusterKey(cluster))
    stub_cls = wgrpc.PrefillWorkerStub if role == "prefill" else wgrpc.DecodeWorkerStub
    return stub_cls(channel), address


def decode_result(
    events: Iterable[wpb.DecodeResponse],
) -> tuple[list[int], wpb.DecodeComplete]:
    """The tokens a Decode stream sent and its completion; a `kv_failed` message fails."""
    tokens: list[int] = []
    complete = None
    for msg in events:
        kind = msg.WhichOneof("kind")
        assert kind != "kv_failed", msg
        if kind == "chunk":
            tokens += msg.chunk.token_ids
        else:
            complete = msg.complete
    assert complete is not None
    return tokens, complete


def assert_all_free(cluster: Cluster) -> None:
    """Every block of both workers of a `tandem up` cluster is free, nothing is pinned,
    running or queued."""
    wait_all_free(
        lambda: [
            worker_stub(cluster, r)[0].GetStats(wpb.GetStatsRequest())
            for r in ("prefill", "decode")
        ]
    )


def wait_all_free(read_stats: Callable[[], list[wpb.WorkerStats]], timeout_s: float = 5) -> None:
    """Until the workers `read_stats` reads hold no block, lease or request (allowing a
    moment for aborts that race with the end of the client's call); else fail with them."""
    deadline = time.monotonic() + timeout_s
    while True:
        stats = read_stats()
        ok = all(s.num_free_blocks == s.num_blocks and s.num_pinned_requests == 0 for s in stats)
        ok = ok and all(s.num_running == 0 and s.num_waiting == 0 for s in stats)
        if ok or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert ok, stats
    # The strict KV audit (on in tests) found no accounting error and reaped nothing.
    assert all(s.num_audit_violations == 0 and s.num_reaped_blocks == 0 for s in stats), stats


def assert_answers_as_the_single_engine(
    cluster: Cluster,
    reference: LLMEngine,
    *,
    seed: int,
    num_prompts: int,
    max_prompt_len: int,
    max_tokens: int,
) -> list[Any]:
    """Random token prompts (1 to max_prompt_len tokens, 1 to max_tokens new each) sent at
    once through the cluster's router, greedy: each answer is the single engine's. Returns
    the client's results (for checks of how they were routed)."""
    rng = random.Random(seed)
    cases = [
        (rng.choices(range(5, 512), k=rng.randint(1, max_prompt_len)), rng.randint(1, max_tokens))
        for _ in range(num_prompts)
    ]
    expected = reference.generate(
        [p for p, _ in cases],
        SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
    )

    async def run() -> list[Any]:
        async with AsyncTandemClient(cluster.router_address) as client:
            return await asyncio.gather(
                *(client.generate(p, max_tokens=n, temperature=0.0, ignore_eos=True)
                  for p, n in cases)
            )  # fmt: skip

    results = asyncio.run(run())
    for (prompt, n), got, want in zip(cases, results, expected, strict=True):
        assert got.token_ids == want.token_ids[:n], f"prompt of {len(prompt)} tokens diverged"
        assert got.finish_reason == "length" and got.completion_tokens == n
    return results
