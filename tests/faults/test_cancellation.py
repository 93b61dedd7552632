"""Clients that disconnect while the prefill worker computes someone else's long prompt: every
block they held comes back, by the aborts themselves (the strict KV audit counts a reaped
orphan as a failure).

The leak this guards against (issue 26): an Abort reached the prefill worker during a
multi-second engine step; the worker revoked the request's lease, then queued the engine
abort behind the step under the router's 2 s deadline. The deadline cancelled the handler,
the queued abort was dropped with it, and the handed-off blocks stayed pinned with no lease
left to expire them: 423 of 512 blocks gone after ordinary streaming traffic.

Real processes over real gRPC and NIXL: Redis, one prefill and one decode worker, a router.
The model is random and mid-sized (about 3M parameters) so that an 8000-token prompt takes
seconds per step on one thread, like a long document on a real model.
"""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Iterator

import grpc
import pytest

from benchmarks.fleet import Fleet, wait_until
from tandem.client import AsyncTandemClient, TandemError
from tandem.v1 import router_pb2 as rpb
from tandem.v1 import worker_pb2 as wpb
from tandem.v1 import worker_pb2_grpc as wgrpc
from tandem.weights.tiny import make_tiny_model

LONG = 8000  # tokens: one prefill step of several seconds on one thread


@pytest.fixture(scope="module")
def slow_fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    model_dir = make_tiny_model(tmp_path_factory.mktemp("cancel") / "medium", preset="medium")
    fleet = Fleet(
        model_dir,
        tmp_path_factory.mktemp("cancel-fleet"),
        roles={"p0": "prefill", "d0": "decode"},
        routers={"r0": []},
        worker_args=(
            "--num-threads", "1",
            "--max-num-batched-tokens", "8192",
            "--max-model-len", "8192",
            "--kv-cache-bytes", str(160 << 20),
            # A frozen decode worker stays registered (placement still picks it), so the
            # hand-offs wait for a reader that does not come.
            "--registry-ttl-s", "60",
        ),
    )  # fmt: skip
    try:
        fleet.start()
        yield fleet
    finally:
        fleet.stop()


def _prompt(seed: int, n: int) -> list[int]:
    return [5 + (seed * 131 + i * 7) % 500 for i in range(n)]


async def _stream(address: str, prompt: list[int], first: asyncio.Event | None = None) -> None:
    """Stream until cancelled (the caller disconnects); `first` is set at the first chunk."""
    async with AsyncTandemClient(address, timeout_s=120) as client:
        try:
            async for _ in client.stream(prompt, max_tokens=64, temperature=0.0, ignore_eos=True):
                if first is not None:
                    first.set()
        except TandemError:
            pass  # the decode worker is frozen: its hop may fail; only the blocks matter


async def _disconnect_during_long_steps(fleet: Fleet) -> None:
    router = fleet.addresses["r0"]
    handed_off = [asyncio.Event() for _ in range(3)]
    # Short prompts reach the hand-off (token 1 streamed, KV pinned for the frozen decode
    # worker), then two long prompts keep the prefill engine in multi-second steps.
    short = [asyncio.create_task(_stream(router, _prompt(i, 300), handed_off[i])) for i in range(3)]
    await asyncio.wait_for(asyncio.gather(*(e.wait() for e in handed_off)), 60)
    long = [asyncio.create_task(_stream(router, _prompt(10 + i, LONG))) for i in range(2)]
    await asyncio.sleep(1.0)  # the first long step is under way
    # Disconnect the handed-off streams (their aborts meet a long step), then the long ones
    # mid-prefill.
    for task in short:
        task.cancel()
    await asyncio.sleep(3.0)
    for task in long:
        task.cancel()
    await asyncio.gather(*short, *long, return_exceptions=True)


def test_disconnects_during_long_prefill_steps_leak_no_block(slow_fleet: Fleet) -> None:
    fleet = slow_fleet
    fleet.kill("d0", signal.SIGSTOP)  # nobody confirms the leases: only aborts free them
    try:
        asyncio.run(asyncio.wait_for(_disconnect_during_long_steps(fleet), 120))
    finally:
        fleet.kill("d0", signal.SIGCONT)
    # The engine finishes the step it is in (a step is not interruptible), then the aborts.
    wait_until("the prefill worker is idle", lambda: _idle(fleet, "p0"), timeout_s=90)
    fleet.assert_clean()
    stats = fleet.stats("p0")
    assert stats.num_aborts >= 5  # each disconnected request was aborted on the prefill worker


def _idle(fleet: Fleet, name: str) -> bool:
    s = fleet.stats(name)
    return s.num_running == 0 and s.num_waiting == 0


def test_abort_and_stats_are_answered_while_a_long_step_runs(slow_fleet: Fleet) -> None:
    """The worker answers Abort and GetStats without waiting for its engine: during an
    8000-token step, both return inside 1 s (the router's abort deadline is 2 s)."""
    fleet = slow_fleet

    async def scenario() -> tuple[bool, int, int]:
        async with grpc.aio.insecure_channel(fleet.addresses["p0"]) as ch:
            stub = wgrpc.PrefillWorkerStub(ch)
            sampling = rpb.SamplingParams(max_tokens=4, temperature=0.0)
            request = wpb.PrefillRequest(
                request_id="long", prompt_token_ids=_prompt(99, LONG), sampling=sampling
            )
            call = stub.Prefill(request, timeout=120)
            await asyncio.sleep(1.5)  # queued, then in the step that computes the prompt
            stats = await stub.GetStats(wpb.GetStatsRequest(), timeout=1.0)
            nobody = await stub.Abort(rpb.AbortRequest(request_id="nobody"), timeout=1.0)
            long = await stub.Abort(rpb.AbortRequest(request_id="long"), timeout=1.0)
            codes = []
            try:
                async for _ in call:
                    pass
            except grpc.aio.AioRpcError as exc:
                codes.append(exc.code())
            return nobody.found or not long.found, stats.num_running + stats.num_waiting, len(codes)

    wrong, held, ended = asyncio.run(scenario())
    # Both calls came back inside 1 s (else DEADLINE_EXCEEDED raised above) while the engine
    # ran the long prompt; the aborted Prefill ended with an error status, not a result.
    assert not wrong and held == 1 and ended == 1
    wait_until("the prefill worker is idle", lambda: _idle(fleet, "p0"), timeout_s=90)
    fleet.assert_clean()
