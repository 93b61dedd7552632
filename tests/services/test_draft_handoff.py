"""A draft model's KV travels through the hand-off (issue 45): real processes, real Redis,
signed hand-offs.

The peers' failure this closes: the draft's KV silently not transferred, so the decode
worker prefilled the draft again for every request (vLLM #54926), and workers of mismatched
speculative configurations failing at the handshake (vLLM #48221). Here the prefill worker
prefills the draft and packs its KV into the hand-off's `draft_kv` section, signed with the
rest; the decode worker drafts from its first step with no draft prefill (its counter stays
0). A section tampered with is refused: unsigned, as forged; re-signed (a buggy owner holding
the secret) but missing, cut short or of another draft, before a byte is read, and the prompt
is prefilled again. Workers whose draft models differ refuse each other's hand-offs with the
reason, never decode from them."""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import grpc
import pytest

from tandem.engine.engine import LLMEngine
from tandem.services.common.redis.server import RedisServer
from tandem.services.common.rpc import convert
from tandem.services.common.security import AuthConfig, derive_key, internal_metadata, load_secret
from tandem.services.up.processes import free_port
from tandem.transfer import KVHandoff
from tandem.v1 import worker_pb2 as wpb
from tandem.v1 import worker_pb2_grpc as wgrpc
from tandem.weights.tiny import get_preset, make_tiny_model
from tests.services.test_forged_handoff import SAMPLING, decode, greedy, prefill, stats
from tests.services.test_hybrid_handoff import resigned as hybrid_resigned
from tests.services.test_metrics_cluster import samples, scrape, value
from tests.services.test_moe_up import reference_engine
from tests.services.workers import signed_worker_args

DRAFT = ("--speculative", "draft", "--speculative-adaptive", "false",
         "--num-speculative-tokens", "3")  # fmt: skip
# worker id -> (role, draft model: "draft" the one-layer model, "target" the target itself)
WORKERS = {
    "prefill-0": ("prefill", "draft"),
    "decode-0": ("decode", "draft"),
    "prefill-self": ("prefill", "target"),
    "decode-plain": ("decode", None),
}


@pytest.fixture(scope="module")
def cluster(
    tiny_model_dir: Path,
    redis_server: RedisServer,
    procs: SimpleNamespace,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[SimpleNamespace]:
    small = dataclasses.replace(get_preset("tiny"), num_hidden_layers=1)
    drafts = {
        "draft": make_tiny_model(tmp_path_factory.mktemp("draft"), preset=small, seed=1),
        "target": tiny_model_dir,
    }
    secret_file, common = signed_worker_args(redis_server.url, tmp_path_factory.mktemp("secret"))
    started, channels, stubs, metrics = [], [], {}, {}
    try:
        for name, (role, draft) in WORKERS.items():
            port = free_port("127.0.0.1")
            flags = (*DRAFT, "--draft-model", str(drafts[draft])) if draft else ()
            proc, address = procs.worker(
                role, tiny_model_dir, redis_server.url, name, *common, *flags,
                "--metrics-port", str(port),
            )  # fmt: skip
            started.append(proc)
            channels.append(grpc.insecure_channel(address))
            stub = wgrpc.PrefillWorkerStub if role == "prefill" else wgrpc.DecodeWorkerStub
            stubs[name] = stub(channels[-1])
            metrics[name] = f"127.0.0.1:{port}"
        yield SimpleNamespace(
            key=derive_key(load_secret(secret_file), "kv-handoff"),
            metadata=internal_metadata(AuthConfig(cluster_secret_file=str(secret_file))),
            stubs=stubs,
            metrics=metrics,
            model_id=tiny_model_dir.name,
            prefill=stubs["prefill-0"],
            decode=stubs["decode-0"],
        )
    finally:
        for channel in channels:
            channel.close()
        procs.stop(*started)


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path) -> LLMEngine:
    return reference_engine(tiny_model_dir)


def pair(c: SimpleNamespace, prefill_id: str, decode_id: str) -> SimpleNamespace:
    """The cluster with `prefill_id` and `decode_id` as its prefill and decode stubs."""
    return SimpleNamespace(
        **{**vars(c), "prefill": c.stubs[prefill_id], "decode": c.stubs[decode_id]}
    )


def resigned(c: SimpleNamespace, rid: str, p: list[int], handoff: KVHandoff) -> wpb.KvHandle:
    return hybrid_resigned(c, rid, p, handoff, c.model_id)


def spec_counts(c: SimpleNamespace, worker: str) -> dict[str, float]:
    found = samples(scrape(c.metrics[worker]))
    names = ("draft_prefill_tokens", "draft_handoff_tokens", "proposed_tokens")
    return {n: value(found, f"tandem_worker_spec_{n}_total", proposer="draft") for n in names}


def prompt(seed: int) -> list[int]:
    return random.Random(seed).choices(range(5, 512), k=45)  # 2 full blocks and a partial


def test_the_draft_kv_travels_and_decode_never_prefills_the_draft(cluster, reference) -> None:  # type: ignore[no-untyped-def]
    before = spec_counts(cluster, "decode-0")
    p = prompt(1)
    first = prefill(cluster, "d1", p)
    kinds = [(s.kind, s.num_blocks) for s in first.kv.sections]
    assert [k for k, _ in kinds] == ["attention", "draft_kv"]
    assert kinds[0][1] == 3 and len(first.kv.block_ids) == sum(n for _, n in kinds)
    tokens, complete = decode(cluster, "d1", p, first)
    assert tokens == greedy(reference, p)
    assert complete.kv_transfer_bytes > 0 and not complete.recomputed
    after = spec_counts(cluster, "decode-0")
    assert after["draft_prefill_tokens"] == 0  # never a draft prefill on the decode worker
    assert after["draft_handoff_tokens"] - before["draft_handoff_tokens"] == len(p)
    assert after["proposed_tokens"] > before["proposed_tokens"]  # it drafted
    assert spec_counts(cluster, "prefill-0")["draft_prefill_tokens"] >= len(p)
    assert stats(cluster, cluster.prefill).num_pinned_requests == 0  # lease confirmed
    d = stats(cluster, cluster.decode)
    assert d.num_free_blocks == d.num_blocks


def _drop(h: KVHandoff) -> KVHandoff:
    pages = h.sections[0]
    remote = dataclasses.replace(h.remote, block_ids=h.remote.block_ids[: pages.num_blocks])
    return dataclasses.replace(h, remote=remote, sections=(pages,))


def _cut(h: KVHandoff) -> KVHandoff:
    pages, draft = h.sections
    remote = dataclasses.replace(h.remote, block_ids=h.remote.block_ids[:-1])
    short = dataclasses.replace(draft, num_blocks=draft.num_blocks - 1)
    return dataclasses.replace(h, remote=remote, sections=(pages, short))


def _other_draft(h: KVHandoff) -> KVHandoff:
    pages, draft = h.sections
    fields = draft.format.split()
    fields[1] = "0" * len(fields[1])  # another checkpoint's fingerprint
    return dataclasses.replace(
        h, sections=(pages, dataclasses.replace(draft, format=" ".join(fields)))
    )


ALTERED = {"missing": _drop, "truncated": _cut, "another_draft": _other_draft}
REASONS = {
    "missing": "the draft_kv section is missing",
    "truncated": "the draft_kv section has",
    "another_draft": "the draft_kv section is 'draft.v1 0000",
}


def decode_reporting(c: SimpleNamespace, rid: str, p: list[int], first, kv) -> str:  # type: ignore[no-untyped-def]
    """Decode with `report_kv_failure`: the reason the decode worker refused `kv`."""
    request = wpb.DecodeRequest(request_id=rid, prompt_token_ids=p, sampling=SAMPLING,
                                report_kv_failure=True)  # fmt: skip
    request.output_token_ids.append(first.first_token_id)
    request.kv.CopyFrom(kv)
    events = list(c.decode.Decode(request, metadata=c.metadata, timeout=60))
    assert [e.WhichOneof("kind") for e in events] == ["kv_failed"]
    reason: str = events[0].kv_failed.reason
    return reason


@pytest.mark.parametrize("name", ALTERED)
def test_a_tampered_draft_section_is_refused(cluster, reference, name) -> None:  # type: ignore[no-untyped-def]
    p = prompt(10 + list(ALTERED).index(name))
    rid = f"bad-{name}"
    first = prefill(cluster, rid, p)
    handoff = convert.handoff_from_proto(first.kv)
    # unsigned: the signature covers every section field
    forged = convert.handoff_to_proto(ALTERED[name](handoff))
    with pytest.raises(grpc.RpcError) as err:
        decode(cluster, rid, p, first, forged)
    assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    # re-signed, as a buggy owner holding the secret would send it: declined unread, the
    # lease released, the reason reported; without report_kv_failure, prefilled again here
    bad = resigned(cluster, rid, p, ALTERED[name](handoff))
    assert REASONS[name] in decode_reporting(cluster, rid, p, first, bad)
    assert stats(cluster, cluster.prefill).num_pinned_requests == 0
    again = prefill(cluster, rid, p)
    bad = resigned(cluster, rid, p, ALTERED[name](convert.handoff_from_proto(again.kv)))
    tokens, complete = decode(cluster, rid, p, again, bad)
    assert tokens == greedy(reference, p)
    assert complete.recomputed and complete.kv_transfer_bytes == 0
    d = stats(cluster, cluster.decode)
    assert d.num_running == 0 and d.num_waiting == 0 and d.num_free_blocks == d.num_blocks


@pytest.mark.parametrize(
    ("prefill_id", "decode_id", "reason"),
    [
        ("prefill-0", "decode-plain", "drafts without that draft model"),
        ("prefill-self", "decode-0", "the draft_kv section is 'draft.v1 "),
    ],
)
def test_workers_with_different_draft_models_refuse_each_others_handoffs(
    cluster, reference, prefill_id, decode_id, reason
) -> None:  # type: ignore[no-untyped-def]
    c = pair(cluster, prefill_id, decode_id)
    p = prompt(30 + len(prefill_id + decode_id))
    first = prefill(c, "mix", p)
    assert reason in decode_reporting(c, "mix", p, first, first.kv)
    assert stats(c, c.prefill).num_pinned_requests == 0
    first = prefill(c, "mix2", p)
    tokens, complete = decode(c, "mix2", p, first)  # refused, prefilled again: still right
    assert tokens == greedy(reference, p) and complete.recomputed
