"""A stream survives its only decode worker (issue 46): `tandem up` with one prefill and one
decode worker, real processes. The decode worker is SIGKILLed while streams are in flight; the
router holds each client's stream open (`--stream-hold-s`), `tandem up`'s supervision restarts
the worker, and the router re-prefills prompt + the tokens streamed so far on the new
incarnation (another registry epoch: a new worker, though it has the old one's name) and
resumes. Greedy streams end token-identical to an uninterrupted run, seeded ones on the same
sampled stream; no client sees an error."""

from __future__ import annotations

import os
import random
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from tandem.engine.sampling import SamplingParams
from tandem.services.up import Cluster
from tests.services.conftest import up_cluster
from tests.services.streams import run_streams
from tests.services.test_moe_up import reference_engine
from tests.services.workers import assert_all_free

MAX_TOKENS = 160


@pytest.fixture(scope="module")
def cluster(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with up_cluster(
        tiny_model_dir, tmp_path_factory.mktemp("run"), restart_backoff_s=0.1,
        restart_max_backoff_s=0.2, disagg_min_uncached_tokens=0,
    ) as c:  # fmt: skip
        yield c


def test_streams_resume_when_their_only_decode_worker_dies(
    cluster: Cluster, tiny_model_dir: Path
) -> None:
    rng = random.Random(46)
    prompts = [rng.choices(range(5, 500), k=rng.randint(40, 90)) for _ in range(4)]
    seeds = [None, None, 7, 8]
    clean = run_streams(cluster.router_address, prompts, seeds, MAX_TOKENS)
    [decode] = [c for c in cluster.children if c.name == "decode-0"]
    old_pid = decode.proc.pid
    interrupted = run_streams(
        cluster.router_address, prompts, seeds, MAX_TOKENS, lambda: os.kill(old_pid, signal.SIGKILL)
    )
    [decode] = [c for c in cluster.children if c.name == "decode-0"]
    assert decode.proc.pid != old_pid  # restarted by supervision
    reference = reference_engine(tiny_model_dir)
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    want = [c.token_ids for c in reference.generate(prompts[:2], greedy)]
    for i, (got, before) in enumerate(zip(interrupted, clean, strict=True)):
        assert got.finish_reason == "length" and len(got.token_ids) == MAX_TOKENS
        assert got.migrations == 1, got.recoveries  # resumed once, on the new incarnation
        assert any("holding the stream" in r for r in got.recoveries), got.recoveries
        assert got.token_ids == before.token_ids, f"stream {i} diverged"
        if seeds[i] is None:
            assert got.token_ids == want[i]
    assert_all_free(cluster)
