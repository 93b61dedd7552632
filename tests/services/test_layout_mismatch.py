"""A misconfigured pair (prefill in float32, decode in bfloat16) never decodes on KV it would
misread: the hand-off is refused with FAILED_PRECONDITION naming the differing fields, which
the router passes to the client, and neither worker keeps a block. Real processes, NIXL."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from tandem.v1 import router_pb2 as rpb
from tandem.v1 import router_pb2_grpc as rgrpc
from tandem.v1 import worker_pb2 as wpb
from tandem.v1 import worker_pb2_grpc as wgrpc
from tests.services.processes import worker_pair
from tests.services.workers import wait_all_free


@pytest.fixture(scope="module")
def cluster(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:  # type: ignore[type-arg]
    logs = tmp_path_factory.mktemp("logs")
    with worker_pair(
        tiny_model_dir, logs, ("--dtype", "float32"), ("--dtype", "bfloat16")
    ) as addresses:
        yield {**addresses, "logs": logs}


def _stats(address: str, stub_cls: type) -> wpb.WorkerStats:
    with grpc.insecure_channel(address) as channel:
        stats: wpb.WorkerStats = stub_cls(channel).GetStats(wpb.GetStatsRequest(), timeout=10)
    return stats


def _assert_all_free(cluster: dict) -> None:  # type: ignore[type-arg]
    """Both workers' blocks are all free, nothing pinned or queued."""
    wait_all_free(
        lambda: [
            _stats(cluster["prefill"], wgrpc.PrefillWorkerStub),
            _stats(cluster["decode"], wgrpc.DecodeWorkerStub),
        ]
    )


def _generate(router: str, prompt: list[int]) -> tuple[list[rpb.GenerateResponse], grpc.RpcError]:
    """Every message of a Generate stream that must fail, and the status it failed with.
    (The raw stub: the router reports the error twice, as a last `error` message carrying
    the code and as the call's status, and both are checked.)"""
    request = rpb.GenerateRequest(
        token_ids=rpb.TokenIds(ids=prompt),
        sampling=rpb.SamplingParams(max_tokens=4, ignore_eos=True),
    )
    messages: list[rpb.GenerateResponse] = []
    with grpc.insecure_channel(router) as channel:
        with pytest.raises(grpc.RpcError) as err:
            for msg in rgrpc.RouterStub(channel).Generate(request, timeout=30):
                messages.append(msg)
    return messages, err.value


def test_dtype_mismatch_is_failed_precondition_and_frees_every_block(cluster) -> None:  # type: ignore[no-untyped-def]
    prompt = list(range(5, 105))  # 100 tokens: 7 blocks to hand off
    for _ in range(2):  # a misconfiguration fails every time: nothing is recomputed around it
        messages, status = _generate(cluster["router"], prompt)
        assert status.code() == grpc.StatusCode.FAILED_PRECONDITION  # type: ignore[attr-defined]
        message = status.details()  # type: ignore[attr-defined]
        assert "dtype: handle has float32, this worker bfloat16" in message
        assert "'prefill-0'" in message and "'decode-0'" in message
        # Token 1 came from the prefill worker; then the decode worker refused the KV.
        kinds = [m.WhichOneof("kind") for m in messages]
        assert kinds == ["chunk", "error"]
        error = messages[-1].error
        assert error.code == grpc.StatusCode.FAILED_PRECONDITION.value[0]
        assert error.message == message
        _assert_all_free(cluster)
    # The Python client reports the in-stream error with its real status, so callers can
    # tell a misconfiguration (FAILED_PRECONDITION: do not retry) from a failure.
    from tandem.client import TandemClient, TandemError

    with TandemClient(cluster["router"]) as client, pytest.raises(TandemError) as err:
        client.generate(prompt, max_tokens=4, ignore_eos=True)
    assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION
    _assert_all_free(cluster)
    # The operator's side of it: the decode worker logs which pair disagrees, and how.
    log = (cluster["logs"] / "decode.log").read_text()
    assert "KV hand-off from prefill-0 refused: KV layout mismatch: dtype" in log
