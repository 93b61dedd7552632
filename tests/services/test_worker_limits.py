"""A worker's own limits, called directly over gRPC: a queue bound with pushback, and request
ids that one call cannot take over from another."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from tandem.services.common.rpc.errors import RETRY_AFTER_KEY
from tandem.v1 import router_pb2 as rpb
from tandem.v1 import worker_pb2 as wpb
from tandem.v1 import worker_pb2_grpc as wgrpc


@pytest.fixture(scope="module")
def decode_worker(tiny_model_dir, procs):  # type: ignore[no-untyped-def]
    # One sequence at a time and room for two more: the rest must be refused.
    proc, address = procs.worker(
        "decode", tiny_model_dir, "", "limits-d0",
        "--max-num-seqs", "1", "--max-queued-requests", "2",
    )  # fmt: skip
    yield address
    procs.stop(proc)


def decode_request(request_id: str, max_tokens: int) -> wpb.DecodeRequest:
    return wpb.DecodeRequest(
        request_id=request_id,
        prompt_token_ids=[5, 6, 7, 8],
        sampling=rpb.SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
    )


async def _collect(stub: wgrpc.DecodeWorkerStub, req: wpb.DecodeRequest):  # type: ignore[no-untyped-def]
    tokens = []
    try:
        async for msg in stub.Decode(req, timeout=60):
            tokens.extend(msg.chunk.token_ids)
    except grpc.aio.AioRpcError as exc:
        return exc
    return tokens


def test_queue_limit_refuses_with_a_retry_hint_and_serves_the_admitted(decode_worker) -> None:
    """One long call holds the only running slot; of five more, two queue and three are
    refused. The holder is long enough (1500 tokens) that it cannot finish before the five
    arrive however loaded the machine is, so the split is exact, and cancelling it frees the
    slot for the queued two."""

    async def scenario():  # type: ignore[no-untyped-def]
        async with grpc.aio.insecure_channel(decode_worker) as ch:
            stub = wgrpc.DecodeWorkerStub(ch)
            holder = stub.Decode(decode_request("hold", 1500), timeout=120)
            await holder.read()  # it runs
            calls = [
                asyncio.ensure_future(_collect(stub, decode_request(f"q{i}", 16))) for i in range(5)
            ]
            refused = []
            pending = set(calls)
            while len(refused) < 3:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                refused.extend(task.result() for task in done)
            holder.cancel()
            served = await asyncio.gather(*pending)
            return refused, served

    refused, served = asyncio.run(scenario())
    assert len(refused) == 3 and len(served) == 2, (refused, served)
    assert all(t == served[0] and len(t) == 16 for t in served)
    for exc in refused:
        assert isinstance(exc, grpc.aio.AioRpcError), exc
        assert exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, exc
        assert "max_queued_requests" in exc.details()
        hint = dict(exc.trailing_metadata() or ())
        assert int(hint[RETRY_AFTER_KEY]) > 0


def test_duplicate_request_id_is_refused_and_the_first_call_is_untouched(decode_worker) -> None:
    async def scenario():  # type: ignore[no-untyped-def]
        async with grpc.aio.insecure_channel(decode_worker) as ch:
            stub = wgrpc.DecodeWorkerStub(ch)
            first = stub.Decode(decode_request("same", 200), timeout=60)
            head = await first.read()  # it runs
            second = await _collect(stub, decode_request("same", 4))
            tokens = list(head.chunk.token_ids)
            while (msg := await first.read()) is not grpc.aio.EOF:
                tokens.extend(msg.chunk.token_ids)
                if msg.WhichOneof("kind") == "complete":
                    reason = msg.complete.finish_reason
            return second, tokens, reason

    second, tokens, reason = asyncio.run(scenario())
    assert isinstance(second, grpc.aio.AioRpcError)
    assert second.code() == grpc.StatusCode.ALREADY_EXISTS
    assert "already running" in second.details()
    assert reason == rpb.FINISH_REASON_LENGTH and len(tokens) == 200
