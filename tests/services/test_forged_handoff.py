"""A decode worker pulls only KV that a registered prefill worker signed for this very request:
real processes, real Redis, real NIXL.

The attack this closes: a caller reaching a worker port took a genuine KV handle for its own
prompt Q and sent it with a Decode for prompt P; the decode worker read Q's KV, cached it
under P's hashes, and every later user's answer to P came from Q. Each forged or altered
handle below is refused with PERMISSION_DENIED before anything is reserved, read or dialled
(the decode worker's blocks stay free, and the prefill worker's lease stays unconfirmed),
and a later genuine request for P still gets the single engine's greedy output.
"""

from __future__ import annotations

import dataclasses
import random
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import grpc
import pytest

from tandem.client import TandemClient
from tandem.config import CacheConfig, EngineConfig
from tandem.engine.engine import LLMEngine
from tandem.engine.prefix_hash import hash_keys
from tandem.engine.sampling import SamplingParams
from tandem.services.common.redis.server import RedisServer
from tandem.services.common.rpc import convert, errors
from tandem.services.common.security import AuthConfig, derive_key, internal_metadata, load_secret
from tandem.transfer import prompt_hashes, sign_handoff
from tandem.v1 import router_pb2 as rpb
from tandem.v1 import worker_pb2 as wpb
from tandem.v1 import worker_pb2_grpc as wgrpc
from tests.services.conftest import KV_BYTES
from tests.services.workers import decode_result, prefill_result, signed_worker_args

MAX_TOKENS = 8
SAMPLING = rpb.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
DENIED = grpc.StatusCode.PERMISSION_DENIED


@pytest.fixture(scope="module")
def cluster(
    tiny_model_dir: Path,
    redis_server: RedisServer,
    procs: SimpleNamespace,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[SimpleNamespace]:
    """A registered prefill and decode worker sharing a cluster secret, plus a prefill worker
    with the same secret that is not in the registry (a signer the decode must not trust)."""
    secret_file, common = signed_worker_args(redis_server.url, tmp_path_factory.mktemp("secret"))
    started: list[subprocess.Popen[str]] = []
    try:
        prefill, prefill_address = procs.worker(
            "prefill", tiny_model_dir, redis_server.url, "prefill-0", *common
        )
        started.append(prefill)
        decode, decode_address = procs.worker(
            "decode", tiny_model_dir, redis_server.url, "decode-0", *common
        )
        started.append(decode)
        rogue, rogue_address = procs.spawn(
            "tandem.services.prefill", "--model-dir", str(tiny_model_dir), "--worker-id", "rogue-0",
            "--kv-cache-bytes", str(KV_BYTES), *common,
        )  # fmt: skip
        started.append(rogue)
        channels = [grpc.insecure_channel(a) for a in (prefill_address, decode_address)]
        channels.append(grpc.insecure_channel(rogue_address))
        yield SimpleNamespace(
            redis_url=redis_server.url,
            secret_file=secret_file,
            metadata=internal_metadata(AuthConfig(cluster_secret_file=str(secret_file))),
            prefill=wgrpc.PrefillWorkerStub(channels[0]),
            decode=wgrpc.DecodeWorkerStub(channels[1]),
            rogue=wgrpc.PrefillWorkerStub(channels[2]),
        )
        for channel in channels:
            channel.close()
    finally:
        procs.stop(*started)


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path) -> LLMEngine:
    """The single-process engine on the same weights."""
    return LLMEngine(
        EngineConfig(
            model_dir=str(tiny_model_dir),
            dtype="float32",
            cache=CacheConfig(kv_cache_bytes=KV_BYTES),
        )
    )


def greedy(reference: LLMEngine, prompt: list[int]) -> list[int]:
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    [out] = reference.generate([prompt], params)
    return out.token_ids


def prompts(seed: int) -> tuple[list[int], list[int]]:
    """Two different 40-token prompts (two blocks of 16 and a partial one): the victim's P
    and the attacker's Q."""
    rng = random.Random(seed)
    return rng.choices(range(5, 512), k=40), rng.choices(range(5, 512), k=40)


def prefill(
    c: SimpleNamespace,
    rid: str,
    prompt: list[int],
    salt: str = "",
    stub: wgrpc.PrefillWorkerStub | None = None,
) -> wpb.PrefillResponse:
    request = wpb.PrefillRequest(
        request_id=rid, prompt_token_ids=prompt, sampling=SAMPLING, cache_salt=salt
    )
    resp = prefill_result((stub or c.prefill).Prefill(request, metadata=c.metadata, timeout=60))
    assert resp.HasField("kv") and not resp.finished
    return resp


def decode(
    c: SimpleNamespace,
    rid: str,
    prompt: list[int],
    first: wpb.PrefillResponse | None = None,
    kv: wpb.KvHandle | None = None,
    salt: str = "",
) -> tuple[list[int], wpb.DecodeComplete]:
    """Decode `prompt`: with token 1 and a handle, or (neither) prefilling locally."""
    request = wpb.DecodeRequest(
        request_id=rid, prompt_token_ids=prompt, sampling=SAMPLING, cache_salt=salt
    )
    head: list[int] = []
    if first is not None:
        request.output_token_ids.append(first.first_token_id)
        request.kv.CopyFrom(first.kv if kv is None else kv)
        head.append(first.first_token_id)
    tokens, complete = decode_result(c.decode.Decode(request, metadata=c.metadata, timeout=60))
    return head + tokens, complete


def stats(
    c: SimpleNamespace, stub: wgrpc.PrefillWorkerStub | wgrpc.DecodeWorkerStub
) -> wpb.WorkerStats:
    result: wpb.WorkerStats = stub.GetStats(wpb.GetStatsRequest(), metadata=c.metadata)
    return result


def assert_refused_unread(
    c: SimpleNamespace,
    rid: str,
    prompt: list[int],
    first: wpb.PrefillResponse,
    kv: wpb.KvHandle,
    salt: str = "",
    owner: wgrpc.PrefillWorkerStub | None = None,
) -> str:
    """Decode with `kv` is PERMISSION_DENIED; the decode worker reserved nothing, and the
    handle's owner (`owner`, default the registered prefill worker) still pins the blocks:
    its lease was never confirmed, so nobody dialled it."""
    owner = owner or c.prefill
    pinned = stats(c, owner).num_pinned_requests
    with pytest.raises(grpc.RpcError) as err:
        decode(c, rid, prompt, first, kv, salt)
    assert err.value.code() == DENIED, err.value.details()
    d = stats(c, c.decode)
    assert d.num_free_blocks == d.num_blocks and d.num_running == 0 and d.num_waiting == 0
    assert stats(c, owner).num_pinned_requests == pinned
    details: str = err.value.details()
    return details


def release(c: SimpleNamespace, rid: str, stub: wgrpc.PrefillWorkerStub | None = None) -> None:
    """Free a refused handle's blocks on its owner (as the router's abort would), and wait
    until the owner has applied it (an abort is queued for the worker's next step), so the
    next test's pin counts start from a settled worker."""
    stub = stub or c.prefill
    before = stats(c, stub).num_pinned_requests
    assert stub.Abort(rpb.AbortRequest(request_id=rid), metadata=c.metadata).found
    deadline = time.monotonic() + 30
    while stats(c, stub).num_pinned_requests >= before:
        assert time.monotonic() < deadline, f"abort of {rid} never applied"
        time.sleep(0.02)


# -- genuine hand-offs ---------------------------------------------------------------------


def test_genuine_signed_handoff_is_pulled_and_matches_the_engine(cluster, reference) -> None:
    p, _ = prompts(1)
    first = prefill(cluster, "g1", p)
    assert len(first.kv.signature) == 32
    tokens, complete = decode(cluster, "g1", p, first)
    assert tokens == greedy(reference, p)
    assert complete.kv_transfer_bytes > 0 and not complete.recomputed
    assert stats(cluster, cluster.prefill).num_pinned_requests == 0  # the lease was confirmed
    # With a cache salt: signed and checked under the tenant's hashes.
    first = prefill(cluster, "g2", p, salt="tenant-a")
    tokens, complete = decode(cluster, "g2", p, first, salt="tenant-a")
    assert tokens == greedy(reference, p) and not complete.recomputed


# -- forged hand-offs ----------------------------------------------------------------------


def test_handle_for_another_prompt_is_refused_and_does_not_poison_the_cache(
    cluster, reference
) -> None:
    """The reported attack: Q's genuine handle sent with prompt P."""
    p, q = prompts(2)
    first = prefill(cluster, "atk", q)
    message = assert_refused_unread(cluster, "atk", p, first, first.kv)
    assert message.startswith("KV hand-off signature invalid (does not match for request 'atk'")
    release(cluster, "atk")
    # A later user's P, prefilled by the decode worker itself: nothing of P is cached there
    # (the forged KV never landed), and the answer is P's own.
    tokens, complete = decode(cluster, "victim", p)
    assert complete.num_cached_tokens == 0
    assert tokens == greedy(reference, p)


def test_handle_replayed_under_another_request_id_or_salt_is_refused(cluster) -> None:
    p, _ = prompts(3)
    first = prefill(cluster, "r3", p)
    assert_refused_unread(cluster, "r3-other", p, first, first.kv)
    assert_refused_unread(cluster, "r3", p, first, first.kv, salt="tenant-b")
    release(cluster, "r3")


@pytest.mark.parametrize(
    "alter",
    [
        pytest.param(lambda kv: kv.block_ids.__setitem__(0, kv.block_ids[0] + 1), id="block_id"),
        pytest.param(lambda kv: kv.block_ids.append(kv.block_ids[-1]), id="extra_block"),
        pytest.param(lambda kv: setattr(kv, "base_addr", kv.base_addr + 4096), id="base_addr"),
        pytest.param(lambda kv: setattr(kv, "num_tokens", kv.num_tokens - 1), id="num_tokens"),
        pytest.param(lambda kv: setattr(kv, "agent_name", "prefill-9"), id="agent_name"),
        pytest.param(lambda kv: setattr(kv, "agent_metadata", b"x"), id="agent_metadata"),
        pytest.param(lambda kv: kv.lease.__setattr__("epoch", kv.lease.epoch + 1), id="epoch"),
        pytest.param(
            lambda kv: setattr(kv, "signature", bytes([kv.signature[0] ^ 1]) + kv.signature[1:]),
            id="signature_flipped",
        ),
        pytest.param(lambda kv: kv.ClearField("signature"), id="signature_missing"),
    ],
)
def test_altered_handle_is_refused_before_any_read(cluster, alter, request) -> None:
    # One request id per case: an abort is applied on the worker's next step, so a case
    # reusing the previous case's id could meet it still registered.
    rid = f"alt-{request.node.callspec.id}"
    p, _ = prompts(4)
    first = prefill(cluster, rid, p)
    kv = wpb.KvHandle()
    kv.CopyFrom(first.kv)
    alter(kv)
    message = assert_refused_unread(cluster, rid, p, first, kv)
    assert message.startswith("KV hand-off signature invalid")
    release(cluster, rid)


def test_handle_naming_another_address_is_refused_without_dialling_it(cluster) -> None:
    """The decode worker never connects to an address a caller names."""
    p, _ = prompts(5)
    first = prefill(cluster, "addr", p)
    with socket.socket() as trap:
        trap.bind(("127.0.0.1", 0))
        trap.listen()
        trap.settimeout(0.5)
        kv = wpb.KvHandle()
        kv.CopyFrom(first.kv)
        kv.prefill_address = f"127.0.0.1:{trap.getsockname()[1]}"
        assert_refused_unread(cluster, "addr", p, first, kv)
        with pytest.raises(TimeoutError):
            trap.accept()
    release(cluster, "addr")


def test_signed_by_an_unregistered_prefill_worker_is_refused(cluster) -> None:
    """A valid signature is not enough: the owner must be a prefill worker the registry
    knows, at that address and incarnation."""
    p, _ = prompts(6)
    first = prefill(cluster, "rogue", p, stub=cluster.rogue)
    message = assert_refused_unread(cluster, "rogue", p, first, first.kv, owner=cluster.rogue)
    assert "'rogue-0'" in message and "is not a registered prefill worker" in message
    release(cluster, "rogue", stub=cluster.rogue)


def test_handle_from_another_incarnation_is_refused(cluster, tiny_model_dir) -> None:
    """Same worker id and address, another epoch: even correctly signed (the test holds the
    secret, as a peer that kept it, or an old incarnation's handle, would), the owner is not
    the registered incarnation."""
    p, _ = prompts(7)
    first = prefill(cluster, "epoch", p)
    handoff = convert.handoff_from_proto(first.kv)
    key = derive_key(load_secret(cluster.secret_file), "kv-handoff")
    moved = dataclasses.replace(handoff, epoch=handoff.epoch - 1)
    hashes = prompt_hashes(p, handoff.block_size, hash_keys(tiny_model_dir.name))
    moved = dataclasses.replace(moved, signature=sign_handoff(key, "epoch", hashes, moved))
    message = assert_refused_unread(cluster, "epoch", p, first, convert.handoff_to_proto(moved))
    assert "(epoch " in message and "is not a registered prefill worker" in message
    release(cluster, "epoch")


# -- through a router ----------------------------------------------------------------------


def test_router_request_after_forged_handles_matches_the_engine(
    cluster, procs, reference, tiny_model_dir
) -> None:
    """A normal client's P through a real router, after Q's handle was forged for P."""
    p, q = prompts(8)
    first = prefill(cluster, "atk8", q)
    assert_refused_unread(cluster, "atk8", p, first, first.kv)
    release(cluster, "atk8")
    router, address = procs.router(
        tiny_model_dir, cluster.redis_url,
        "--cluster-secret-file", str(cluster.secret_file),
        "--disagg-min-uncached-tokens", "0",
    )  # fmt: skip
    try:
        with TandemClient(address) as client:
            got = client.generate(p, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
        assert got.token_ids == greedy(reference, p)
        assert got.disaggregated
    finally:
        procs.stop(router)


def test_router_passes_permission_denied_to_the_client() -> None:
    """A refused hand-off is the request's outcome, not a worker fault: no retry elsewhere."""
    exc = grpc.aio.AioRpcError(
        DENIED, grpc.aio.Metadata(), grpc.aio.Metadata(), details="KV hand-off signature invalid"
    )
    err = errors.from_worker(exc)
    assert (err.code, err.message) == (DENIED, "KV hand-off signature invalid")
