"""Draining a decode worker with streams in flight (issue 46): `tandem up` with one prefill and
two decode workers, real processes, real gRPC and NIXL. SIGTERM one decode worker while
streams decode on both: it stops each of its decoding streams between steps with the KV
pinned (the prompt and every output token but the last), hands it off to the router in the
stream (`DecodeResponse.moved`, signed for the request), and the router continues it on the
other decode worker, which pulls the KV -- nothing prefilled again. Every stream ends
token-identical to an uninterrupted run; the drained worker exits 0 once every moved stream's
KV has been pulled."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import pytest

from tandem.engine.sampling import SamplingParams
from tandem.services.up import Cluster
from tests.services.conftest import up_cluster
from tests.services.streams import run_streams
from tests.services.test_metrics_cluster import samples, scrape, value
from tests.services.test_moe_up import reference_engine

MAX_TOKENS = 200


@pytest.fixture(scope="module")
def cluster(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    with up_cluster(
        tiny_model_dir, tmp_path_factory.mktemp("run"), num_decode=2,
        disagg_min_uncached_tokens=0,
    ) as c:  # fmt: skip
        yield c


def terminate(cluster: Cluster, name: str) -> None:
    [child] = [c for c in cluster.children if c.name == name]
    child.proc.terminate()


def test_a_draining_decode_worker_moves_its_streams_with_their_kv(
    cluster: Cluster, tiny_model_dir: Path
) -> None:
    rng = random.Random(460)
    prompts = [rng.choices(range(5, 500), k=rng.randint(40, 90)) for _ in range(6)]
    seeds = [None, None, None, 5, 6, 7]
    address = cluster.router_address
    clean = run_streams(address, prompts, seeds, MAX_TOKENS)
    decodes = ("decode-0", "decode-1")
    before = {d: samples(scrape(cluster.metrics_addresses[d])) for d in decodes}
    chosen: list[str] = []

    def drain_the_busiest() -> None:
        """SIGTERM the decode worker running the most streams now (placement by prefix
        affinity may have put most on either)."""
        running = {d: value(samples(scrape(cluster.metrics_addresses[d])),
                            "tandem_worker_requests_running") for d in decodes}  # fmt: skip
        chosen.append(max(decodes, key=lambda d: running[d]))
        terminate(cluster, chosen[0])

    [d0, d1] = [next(c for c in cluster.children if c.name == d) for d in decodes]
    moved = run_streams(address, prompts, seeds, MAX_TOKENS, drain_the_busiest)
    drained_name = chosen[0]
    stay = next(d for d in decodes if d != drained_name)
    drained = d0 if drained_name == "decode-0" else d1
    assert drained.proc.wait(timeout=60) == 0  # every moved stream's KV pulled, then it left
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    want = [c.token_ids for c in reference_engine(tiny_model_dir).generate(prompts[:3], greedy)]
    num_moved = 0
    for i, (got, first) in enumerate(zip(moved, clean, strict=True)):
        assert got.finish_reason == "length" and got.token_ids == first.token_ids, i
        if seeds[i] is None:
            assert got.token_ids == want[i]
        if got.migrations:
            assert got.migrations == 1 and got.decode_worker == stay, got.recoveries
            # one step: the move; a pull that failed would add a kv_pull_failed one
            assert len(got.recoveries) == 1, got.recoveries
            assert f"decode_moved on {drained_name}" in got.recoveries[0], got.recoveries
            num_moved += 1
    assert num_moved > 0  # streams were decoding on the drained worker
    after = samples(scrape(cluster.metrics_addresses[stay]))
    # every moved stream's KV pulled by decode-0 (its transfers committed), none prefilled
    # again there (streams placed on decode-0 from the start may be prefix-cache hits there)
    committed = "tandem_worker_kv_transfers_total"
    pulled = value(after, committed, outcome="committed") - value(
        before[stay], committed, outcome="committed"
    )
    assert pulled >= num_moved
    recomputed = "tandem_worker_kv_recomputed_total"
    assert value(after, recomputed) == value(before[stay], recomputed)
