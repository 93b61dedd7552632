"""FP8 KV cache over real worker processes (issue 28).

`tandem up --kv-cache-dtype fp8` serves the tiny model disaggregated (the registry advertises
both workers' KV format and the router pairs them), token-identical to the same request
prefilled on the decode worker itself and to an in-process engine with the same fp8 cache.
A pair whose KV formats differ (static lists: the router cannot know) is refused by the decode
worker before it reads a byte, FAILED_PRECONDITION naming the fields, with either transport.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from tandem.client import TandemClient
from tandem.engine.sampling import SamplingParams
from tandem.v1 import router_pb2 as rpb
from tandem.v1 import worker_pb2 as wpb
from tandem.v1 import worker_pb2_grpc as wgrpc
from tests.services.conftest import up_cluster
from tests.services.processes import worker_pair
from tests.services.test_layout_mismatch import _generate, _stats
from tests.services.workers import assert_all_free, wait_all_free, worker_stub

MAX_TOKENS = 16


def test_up_fp8_disaggregated_equals_colocated(
    tiny_model_dir: Path, tmp_path: Path, engine_factory
) -> None:  # type: ignore[no-untyped-def]
    rng = random.Random(28)
    prompts = [rng.choices(range(5, 512), k=n) for n in (70, 133)]
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    reference = engine_factory(tiny_model_dir, kv_cache_dtype="fp8")
    with up_cluster(
        tiny_model_dir, tmp_path, kv_cache_dtype="fp8", disagg_min_uncached_tokens=0
    ) as cluster:
        decode, _ = worker_stub(cluster, "decode")
        with TandemClient(cluster.router_address) as client:
            for i, prompt in enumerate(prompts):
                result = client.generate(
                    prompt, max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True
                )
                assert result.disaggregated and result.prefill_worker == "prefill-0"
                # The same prompt prefilled on the decode worker (another salt: none of the
                # blocks the hand-off left in its prefix cache are reused).
                colocated = []
                request = wpb.DecodeRequest(
                    request_id=f"colocated-{i}",
                    prompt_token_ids=prompt,
                    sampling=rpb.SamplingParams(
                        max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True
                    ),
                    cache_salt="colocated",
                )
                for msg in decode.Decode(request, timeout=60):
                    if msg.WhichOneof("kind") == "chunk":
                        colocated += msg.chunk.token_ids
                [want] = reference.generate([prompt], greedy)
                assert list(result.token_ids) == colocated == want.token_ids
        assert_all_free(cluster)


@pytest.fixture(scope="module", params=["nixl", "local"])
def mismatched(
    request: pytest.FixtureRequest, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, object]]:
    """A prefill worker with an fp8 cache, a decode worker with the model's float32 one, and
    a router that knows them only by address, over transport `request.param`."""
    transport = request.param
    logs = tmp_path_factory.mktemp(f"fp8-mismatch-{transport}")
    flags = ("--dtype", "float32", "--transport", transport, "--kv-cache-dtype")
    with worker_pair(tiny_model_dir, logs, (*flags, "fp8"), (*flags, "auto")) as addresses:
        yield {**addresses, "logs": logs}


def test_a_mismatched_kv_format_is_refused_before_any_read(mismatched) -> None:  # type: ignore[no-untyped-def]
    messages, status = _generate(str(mismatched["router"]), list(range(5, 75)))
    assert status.code() == grpc.StatusCode.FAILED_PRECONDITION  # type: ignore[attr-defined]
    message = status.details()  # type: ignore[attr-defined]
    assert "dtype: handle has float8_e4m3fn, this worker float32" in message
    assert "k_scales: handle has (1.0, 1.0), this worker ()" in message
    assert "v_scales: handle has" in message
    assert [m.WhichOneof("kind") for m in messages] == ["chunk", "error"]
    wait_all_free(
        lambda: [
            _stats(str(mismatched["prefill"]), wgrpc.PrefillWorkerStub),
            _stats(str(mismatched["decode"]), wgrpc.DecodeWorkerStub),
        ]
    )
    log = (Path(str(mismatched["logs"])) / "decode.log").read_text()
    assert "refused: KV layout mismatch: dtype" in log
    assert "KV read" not in log  # refused before the transport moved anything
