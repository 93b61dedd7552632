"""Hand-offs between workers of different tensor-parallel sizes (issue 29): real processes,
real Redis, real NIXL. A prefill worker of TP=p hands a request to a decode worker of TP=d
(2 -> 1, 1 -> 2, 2 -> 2, and 2 -> 4 with each KV head replicated on 2 ranks): the handle
lists every prefill rank's cache and KV-head range, and each decode rank's cache gets its
heads from the prefill ranks holding them. Greedy output equals the single engine's in
float32, with prefix hits on the decode worker (it reads only what it lacks), chunked
prefill on the prefill workers and preemption on the decode worker (its few blocks cannot
hold concurrent requests as they grow: the preempted recompute their tokens there, and its
GetStats counts them); afterwards no block, lease or request is held anywhere. A handle
whose rank addresses or head ranges were altered is refused by the signature before
anything is reserved or read.
"""

from __future__ import annotations

import random
import subprocess
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import grpc
import pytest

from tandem.config import CacheConfig, EngineConfig
from tandem.engine.engine import LLMEngine
from tandem.engine.sampling import SamplingParams
from tandem.services.common.redis.server import RedisServer
from tandem.services.common.security import AuthConfig, internal_metadata
from tandem.v1 import router_pb2 as rpb
from tandem.v1 import worker_pb2 as wpb
from tandem.v1 import worker_pb2_grpc as wgrpc
from tests.services.conftest import KV_BYTES
from tests.services.workers import decode_result, prefill_result, signed_worker_args, wait_all_free

MAX_TOKENS = 8
SAMPLING = rpb.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
# Decode workers hold 8 blocks of 16 tokens (per rank): room for any one request here (at
# most 5 blocks) but not for two of the concurrent ones (30 prompt tokens + 40 generated: 5
# blocks each), so those preempt each other.
DECODE_BLOCKS = 8
CONCURRENT, CONCURRENT_TOKENS = 6, 40
# d4: 4 ranks over the tiny model's 2 KV heads, each head replicated on 2 ranks (GQA).
WORKERS = {
    "p1": ("prefill", 1),
    "p2": ("prefill", 2),
    "d1": ("decode", 1),
    "d2": ("decode", 2),
    "d4": ("decode", 4),
}


@pytest.fixture(scope="module")
def cluster(
    tiny_model_dir: Path,
    redis_server: RedisServer,
    procs: SimpleNamespace,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[SimpleNamespace]:
    secret_file, common = signed_worker_args(redis_server.url, tmp_path_factory.mktemp("secret"))
    started: list[subprocess.Popen[str]] = []
    channels: list[grpc.Channel] = []
    stubs: dict[str, object] = {}
    try:
        for name, (role, tp) in WORKERS.items():
            if role == "prefill":
                extra: tuple[str, ...] = ("--long-prefill-token-threshold", "24")
            else:  # a hand-off waits for blocks while the preempted take turns
                extra = ("--num-blocks", str(DECODE_BLOCKS), "--kv-wait-s", "60")
            proc, address = procs.worker(
                role, tiny_model_dir, redis_server.url, name, "--tp", str(tp), *common, *extra
            )
            started.append(proc)
            channels.append(grpc.insecure_channel(address))
            stub_cls = wgrpc.PrefillWorkerStub if role == "prefill" else wgrpc.DecodeWorkerStub
            stubs[name] = stub_cls(channels[-1])
        yield SimpleNamespace(
            metadata=internal_metadata(AuthConfig(cluster_secret_file=str(secret_file))),
            **stubs,
        )
    finally:
        for channel in channels:
            channel.close()
        procs.stop(*started)


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            str(tiny_model_dir), dtype="float32", cache=CacheConfig(kv_cache_bytes=KV_BYTES)
        )
    )


def greedy(reference: LLMEngine, prompt: list[int], max_tokens: int = MAX_TOKENS) -> list[int]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    [out] = reference.generate([prompt], params)
    return out.token_ids


def prefill(
    c: SimpleNamespace, name: str, rid: str, prompt: list[int],
    sampling: rpb.SamplingParams = SAMPLING,
) -> wpb.PrefillResponse:  # fmt: skip
    request = wpb.PrefillRequest(request_id=rid, prompt_token_ids=prompt, sampling=sampling)
    resp = prefill_result(getattr(c, name).Prefill(request, metadata=c.metadata, timeout=60))
    assert resp.HasField("kv") and not resp.finished
    return resp


def decode(
    c: SimpleNamespace, name: str, rid: str, prompt: list[int], first: wpb.PrefillResponse,
    kv: wpb.KvHandle | None = None, sampling: rpb.SamplingParams = SAMPLING,
) -> tuple[list[int], wpb.DecodeComplete]:  # fmt: skip
    request = wpb.DecodeRequest(request_id=rid, prompt_token_ids=prompt, sampling=sampling)
    request.output_token_ids.append(first.first_token_id)
    request.kv.CopyFrom(first.kv if kv is None else kv)
    tokens, complete = decode_result(
        getattr(c, name).Decode(request, metadata=c.metadata, timeout=60)
    )
    return [first.first_token_id, *tokens], complete


def assert_nothing_held(c: SimpleNamespace) -> None:
    wait_all_free(
        lambda: [
            getattr(c, n).GetStats(wpb.GetStatsRequest(), metadata=c.metadata) for n in WORKERS
        ]
    )


@pytest.mark.parametrize(("p", "d"), [("p2", "d1"), ("p1", "d2"), ("p2", "d2"), ("p2", "d4")])
def test_handoff_between_tp_sizes_matches_the_single_engine(
    cluster: SimpleNamespace, reference: LLMEngine, p: str, d: str
) -> None:
    rng = random.Random(f"{p}{d}")
    shared = rng.choices(range(5, 512), k=48)  # three blocks of 16 a second prompt reuses
    prompts = [
        shared + rng.choices(range(5, 512), k=9),
        shared + rng.choices(range(5, 512), k=21),  # a prefix hit on the decode worker
        rng.choices(range(5, 512), k=70),
        rng.choices(range(5, 512), k=5),  # one partial block
    ]
    num_ranks = WORKERS[p][1]
    for i, prompt in enumerate(prompts):
        rid = f"{p}-{d}-{i}"
        first = prefill(cluster, p, rid, prompt)
        assert len(first.kv.ranks) == (num_ranks if num_ranks > 1 else 0)
        tokens, complete = decode(cluster, d, rid, prompt, first)
        assert tokens == greedy(reference, prompt), f"prompt {i} ({len(prompt)} tokens)"
        assert not complete.recomputed and complete.kv_transfer_bytes > 0
        if i == 1:  # the decode worker read only what its cache lacked
            assert complete.num_cached_tokens == 48
    assert_nothing_held(cluster)

    # Concurrent requests whose growth the decode worker's blocks cannot hold: it preempts
    # (their blocks freed, their tokens recomputed there), and the answers stay the same.
    sampling = rpb.SamplingParams(max_tokens=CONCURRENT_TOKENS, temperature=0.0, ignore_eos=True)
    prompts = [rng.choices(range(5, 512), k=30) for _ in range(CONCURRENT)]
    firsts = [prefill(cluster, p, f"{p}-{d}-c{i}", q, sampling) for i, q in enumerate(prompts)]
    stub = getattr(cluster, d)
    before = stub.GetStats(wpb.GetStatsRequest(), metadata=cluster.metadata).num_preemptions
    with ThreadPoolExecutor(CONCURRENT) as pool:
        results = list(
            pool.map(
                lambda i: decode(
                    cluster, d, f"{p}-{d}-c{i}", prompts[i], firsts[i], sampling=sampling
                ),
                range(CONCURRENT),
            )
        )
    for i, (prompt, (tokens, complete)) in enumerate(zip(prompts, results, strict=True)):
        assert tokens == greedy(reference, prompt, CONCURRENT_TOKENS), f"concurrent {i}"
        assert not complete.recomputed  # the hand-off was used; preemption recomputed later
    after = stub.GetStats(wpb.GetStatsRequest(), metadata=cluster.metadata).num_preemptions
    assert after > before, "no request was preempted on the decode worker"
    assert_nothing_held(cluster)


def test_altered_rank_in_a_handle_is_refused_by_the_signature(
    cluster: SimpleNamespace, reference: LLMEngine
) -> None:
    prompt = random.Random(7).choices(range(5, 512), k=40)
    first = prefill(cluster, "p2", "forged", prompt)

    def swap_heads(kv: wpb.KvHandle) -> None:  # each rank's heads read as the other's
        kv.ranks[0].head_start, kv.ranks[1].head_start = 1, 0

    for alter in (
        swap_heads,
        lambda kv: setattr(kv.ranks[1], "base_addr", kv.ranks[1].base_addr + 4096),  # endpoint
        lambda kv: kv.ClearField("ranks"),  # read rank 0's cache as if it held every head
    ):
        kv = wpb.KvHandle()
        kv.CopyFrom(first.kv)
        alter(kv)
        with pytest.raises(grpc.RpcError) as err:
            decode(cluster, "d2", "forged", prompt, first, kv)
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED, err.value.details()
        d = cluster.d2.GetStats(wpb.GetStatsRequest(), metadata=cluster.metadata)
        assert d.num_free_blocks == d.num_blocks and d.num_running == 0
    # The genuine handle still works, and then nothing is held.
    tokens, _ = decode(cluster, "d2", "forged", prompt, first)
    assert tokens == greedy(reference, prompt)
    assert_nothing_held(cluster)
