"""A Qwen3-Next hand-off carries its linear-attention state in a typed section, and a decode
worker never decodes from a hand-off that lacks any part of the request's state (issue 42):
real processes, real Redis, signed hand-offs.

The peers' failure this closes: a hybrid hand-off whose recurrent state was missing or stale
was decoded anyway and answered with zero errors (vLLM #52234, LMCache #2845). Here the handle
names its sections (the prompt's KV pages, then the state); a section missing, cut short or of
another format -- even under a valid signature, as a buggy or older owner holding the secret
would send -- is declined before anything is reserved, its lease released, and the prompt
prefilled again: the answer is still the single engine's."""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest

from tandem.engine.engine import LLMEngine
from tandem.engine.prefix_hash import hash_keys
from tandem.services.common.redis.server import RedisServer
from tandem.services.common.rpc import convert
from tandem.transfer import KVHandoff, prompt_hashes, sign_handoff
from tandem.transfer.sections import HandoffSection
from tandem.v1 import worker_pb2 as wpb
from tests.services.test_forged_handoff import SAMPLING, decode, greedy, prefill, stats
from tests.services.test_moe_up import moe_model, reference_engine
from tests.services.workers import signed_pair


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return moe_model(tmp_path_factory.mktemp("qwen3-next"), "qwen3-next")


@pytest.fixture(scope="module")
def cluster(
    model_dir: Path,
    redis_server: RedisServer,
    procs: SimpleNamespace,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[SimpleNamespace]:
    with signed_pair(model_dir, redis_server.url, procs, tmp_path_factory.mktemp("secret")) as c:
        yield c


@pytest.fixture(scope="module")
def reference(model_dir: Path) -> LLMEngine:
    return reference_engine(model_dir)


def resigned(
    c: SimpleNamespace, rid: str, prompt: list[int], handoff: KVHandoff, model_id: str = "model"
) -> wpb.KvHandle:
    """`handoff` signed with the cluster's key, as an owner holding the secret would."""
    hashes = prompt_hashes(prompt, handoff.block_size, hash_keys(model_id))
    signed = dataclasses.replace(handoff, signature=sign_handoff(c.key, rid, hashes, handoff))
    return convert.handoff_to_proto(signed)


def prompt(seed: int) -> list[int]:
    return random.Random(seed).choices(range(5, 512), k=45)  # 2 full blocks and a partial


def test_the_state_travels_with_the_pages(cluster, reference) -> None:  # type: ignore[no-untyped-def]
    p = prompt(1)
    first = prefill(cluster, "s1", p)
    sections = [(s.kind, s.num_blocks) for s in first.kv.sections]
    assert [k for k, _ in sections] == ["attention", "linear_state"]
    assert sections[0][1] == 3 and len(first.kv.block_ids) == sum(n for _, n in sections)
    tokens, complete = decode(cluster, "s1", p, first)
    assert tokens == greedy(reference, p)
    assert complete.kv_transfer_bytes > 0 and not complete.recomputed
    assert stats(cluster, cluster.prefill).num_pinned_requests == 0  # lease confirmed


def _drop_state(h: KVHandoff) -> KVHandoff:
    pages = h.sections[0]
    remote = dataclasses.replace(h.remote, block_ids=h.remote.block_ids[: pages.num_blocks])
    return dataclasses.replace(h, remote=remote, sections=(pages,))


def _cut_state(h: KVHandoff) -> KVHandoff:
    pages, state = h.sections
    remote = dataclasses.replace(h.remote, block_ids=h.remote.block_ids[:-1])
    short = dataclasses.replace(state, num_blocks=state.num_blocks - 1)
    return dataclasses.replace(h, remote=remote, sections=(pages, short))


def _relabel(h: KVHandoff) -> KVHandoff:
    pages, state = h.sections
    other = dataclasses.replace(
        state, format=state.format.replace("recurrent=float32", "recurrent=bfloat16")
    )
    return dataclasses.replace(h, sections=(pages, other))


def _no_sections(h: KVHandoff) -> KVHandoff:  # an owner before sections, pages only
    return dataclasses.replace(_drop_state(h), sections=())


ALTERATIONS: dict[str, Callable[[KVHandoff], KVHandoff]] = {
    "missing": _drop_state,
    "truncated": _cut_state,
    "another_format": _relabel,
    "unsectioned": _no_sections,
    "pages_as_state": lambda h: dataclasses.replace(
        h, sections=(h.sections[0], HandoffSection("linear_state", h.sections[1].format, 0, 0))
    ),
}


@pytest.mark.parametrize("name", ALTERATIONS)
def test_a_section_missing_truncated_or_of_another_format_is_prefilled_again(
    cluster, reference, name
) -> None:  # type: ignore[no-untyped-def]
    p = prompt(2 + list(ALTERATIONS).index(name))
    rid = f"bad-{name}"
    first = prefill(cluster, rid, p)
    bad = resigned(cluster, rid, p, ALTERATIONS[name](convert.handoff_from_proto(first.kv)))
    tokens, complete = decode(cluster, rid, p, first, bad)
    assert tokens == greedy(reference, p)
    assert complete.recomputed and complete.kv_transfer_bytes == 0
    # declined: the lease released at once, nothing left here
    assert stats(cluster, cluster.prefill).num_pinned_requests == 0
    d = stats(cluster, cluster.decode)
    assert d.num_running == 0 and d.num_waiting == 0


def test_with_report_kv_failure_the_router_is_told_why(cluster) -> None:  # type: ignore[no-untyped-def]
    p = prompt(20)
    first = prefill(cluster, "rep", p)
    bad = resigned(cluster, "rep", p, _cut_state(convert.handoff_from_proto(first.kv)))
    request = wpb.DecodeRequest(
        request_id="rep", prompt_token_ids=p, sampling=SAMPLING, report_kv_failure=True
    )
    request.output_token_ids.append(first.first_token_id)
    request.kv.CopyFrom(bad)
    events = list(cluster.decode.Decode(request, metadata=cluster.metadata))
    assert [e.WhichOneof("kind") for e in events] == ["kv_failed"]
    assert "the linear_state section has" in events[0].kv_failed.reason
    assert stats(cluster, cluster.prefill).num_pinned_requests == 0
