"""A sliding-window model's hand-off moves each KV table's live blocks only -- a full table's
every page, a sliding table's window -- in a typed section naming the layout, and a decode
worker never decodes from pages that do not match it (issue 42): real processes, real Redis,
signed hand-offs, gpt-oss (sliding and full layers in tables of their own).

A handle without sections (an owner whose blocks hold every layer), one of another layout,
one sending every sliding block instead of the window, or one a block short is declined
before anything is read -- even under a valid signature -- its lease released, and the
prompt prefilled again: the answer is still the single engine's."""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest

from tandem.engine.engine import LLMEngine
from tandem.model.config import ModelConfig
from tandem.services.common.redis.server import RedisServer
from tandem.services.common.rpc import convert
from tandem.transfer import KVHandoff
from tests.services.test_forged_handoff import decode, greedy, prefill, stats
from tests.services.test_hybrid_handoff import resigned
from tests.services.test_moe_up import moe_model, reference_engine
from tests.services.workers import signed_pair

BLOCK = 16  # the workers' block size (tests/services/workers.py)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return moe_model(tmp_path_factory.mktemp("gpt-oss"), "gpt-oss")


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


def prompt(seed: int) -> list[int]:
    return random.Random(seed).choices(range(5, 512), k=70)  # 4 blocks of 16 and a partial


def test_the_window_travels_with_the_full_pages(cluster, reference, model_dir) -> None:  # type: ignore[no-untyped-def]
    layout = ModelConfig.from_dir(model_dir).kv_layout
    p = prompt(1)
    first = prefill(cluster, "w1", p)
    [pages] = first.kv.sections
    assert pages.kind == "attention" and layout.describe() in pages.format
    live = layout.live_blocks(len(p), BLOCK)  # full: 5 blocks; window 6: the last block
    assert [len(r) for r in live] == [5, 1, 1]
    assert pages.num_blocks == len(first.kv.block_ids) == 7  # of the 15 the prompt filled
    tokens, complete = decode(cluster, "w1", p, first)
    assert tokens == greedy(reference, p)
    assert complete.kv_transfer_bytes == 7 * first.kv.block_bytes and not complete.recomputed
    assert stats(cluster, cluster.prefill).num_pinned_requests == 0  # lease confirmed


def _no_sections(h: KVHandoff) -> KVHandoff:
    return dataclasses.replace(h, sections=())


def _another_layout(h: KVHandoff) -> KVHandoff:
    [pages] = h.sections
    return dataclasses.replace(h, sections=(dataclasses.replace(pages, format="float32"),))


def _every_sliding_block(h: KVHandoff) -> KVHandoff:
    """Each sliding table's every block, not its window (ids padded: refused unread)."""
    [pages] = h.sections
    ids = h.remote.block_ids + h.remote.block_ids[:8]
    more = dataclasses.replace(pages, num_blocks=pages.num_blocks + 8)
    return dataclasses.replace(
        h, remote=dataclasses.replace(h.remote, block_ids=ids), sections=(more,)
    )


def _a_block_short(h: KVHandoff) -> KVHandoff:
    [pages] = h.sections
    short = dataclasses.replace(pages, num_blocks=pages.num_blocks - 1)
    ids = h.remote.block_ids[:-1]
    return dataclasses.replace(
        h, remote=dataclasses.replace(h.remote, block_ids=ids), sections=(short,)
    )


ALTERATIONS: dict[str, Callable[[KVHandoff], KVHandoff]] = {
    "unsectioned": _no_sections,
    "another_layout": _another_layout,
    "every_sliding_block": _every_sliding_block,
    "a_block_short": _a_block_short,
}


@pytest.mark.parametrize("name", ALTERATIONS)
def test_pages_not_of_this_layout_are_prefilled_again(cluster, reference, name) -> None:  # type: ignore[no-untyped-def]
    p = prompt(2 + list(ALTERATIONS).index(name))
    rid = f"bad-{name}"
    first = prefill(cluster, rid, p)
    bad = resigned(cluster, rid, p, ALTERATIONS[name](convert.handoff_from_proto(first.kv)))
    tokens, complete = decode(cluster, rid, p, first, bad)
    assert tokens == greedy(reference, p)
    assert complete.recomputed and complete.kv_transfer_bytes == 0
    assert stats(cluster, cluster.prefill).num_pinned_requests == 0
    d = stats(cluster, cluster.decode)
    assert d.num_running == 0 and d.num_waiting == 0
