"""The fault matrix: each case breaks the fleet in one way while clients stream, then checks
that 0 outputs are wrong (greedy ids equal the single engine's), 0 blocks or leases leak, 0
clients hang (every call ends within the suite's bounded waits), every request that had a
healthy worker completed, and the rest ended with the exact status code.

Prompts are token ids (no tokenizer in the comparison); `ignore_eos` fixes every length.
"""

from __future__ import annotations

import asyncio
import random
import signal
import time
from collections.abc import Awaitable, Callable

import grpc
import pytest

from tandem.client import AsyncTandemClient, Result, TandemError
from tandem.engine.prefix_hash import hash_blocks
from tandem.routing.policy import home_rank, prefix_key
from tests.faults.conftest import MAX_INFLIGHT, WAIT_S, Fleet
from tests.services.workers import prefill_result

RNG = random.Random(14)
BLOCK = 16


def prompts(n: int, length: int) -> list[list[int]]:
    return [RNG.choices(range(5, 512), k=length) for _ in range(n)]


def homed_on(worker_id: str, model_id: str, n: int, length: int) -> list[list[int]]:
    """Prompts whose prefix home (the kv policy's tie-break) is `worker_id` among p0, p1."""
    out: list[list[int]] = []
    while len(out) < n:
        [p] = prompts(1, length)
        key = prefix_key(hash_blocks(p, BLOCK, (model_id,)), 16)
        assert key is not None
        if max(("p0", "p1"), key=lambda w: home_rank(key, w)) == worker_id:
            out.append(p)
    return out


async def generate(address: str, prompt: list[int], max_tokens: int, **kw) -> Result:  # type: ignore[no-untyped-def]
    async with AsyncTandemClient(address, timeout_s=WAIT_S) as client:
        return await client.generate(
            prompt, max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **kw
        )


async def stream_until(
    address: str, prompt: list[int], max_tokens: int, started: asyncio.Event, min_chunks: int
) -> Result:
    """Stream one request; set `started` once `min_chunks` chunks arrived."""
    result = Result()
    n = 0
    async with AsyncTandemClient(address, timeout_s=WAIT_S) as client:
        async for _ in client.stream(
            prompt, result=result, max_tokens=max_tokens, temperature=0.0, ignore_eos=True
        ):
            n += 1
            if n == min_chunks:
                started.set()
    return result


def run(coro: Awaitable[object]) -> object:
    return asyncio.run(asyncio.wait_for(coro, WAIT_S))  # type: ignore[arg-type]


def run_all(coros: list[Awaitable[Result]]) -> list[Result]:
    async def main() -> list[Result]:
        return list(await asyncio.gather(*coros))

    return asyncio.run(asyncio.wait_for(main(), WAIT_S))


def check_outputs(
    reference: Callable[[list[list[int]], int], list[list[int]]],
    cases: list[list[int]],
    results: list[Result],
    max_tokens: int,
) -> None:
    expected = reference(cases, max_tokens)
    for i, (got, want) in enumerate(zip(results, expected, strict=True)):
        assert got.finish_reason == "length", f"request {i}: {got.finish_reason}"
        assert got.token_ids == want, f"request {i} diverged ({got.recoveries})"


@pytest.fixture(autouse=True)
def clean_after(fleet: Fleet):  # type: ignore[no-untyped-def]
    yield
    for proc in fleet.procs.values():
        if proc.poll() is None:
            proc.send_signal(signal.SIGCONT)
    fleet.assert_clean()


def test_sigkill_prefill_mid_request_reprefills_on_the_other(fleet: Fleet, reference) -> None:
    model_id = fleet.model_dir.name
    cases = homed_on("p0", model_id, 4, 200)  # long: disaggregated, prefilled on p0

    async def scenario() -> list[Result]:
        fleet.kill("p0", signal.SIGSTOP)  # their Prefill calls are in flight and stuck...
        tasks = [asyncio.create_task(generate(fleet.addresses["r0"], p, 12)) for p in cases]
        await asyncio.sleep(0.3)
        fleet.kill("p0")  # ...when p0 dies
        return list(await asyncio.gather(*tasks))

    results = run(scenario())
    assert isinstance(results, list)
    check_outputs(reference, cases, results, 12)
    recovered = [r for r in results if r.reprefills or r.recoveries]
    assert recovered, "no request was on p0 when it died"
    for r in recovered:
        assert any("prefill_failed on p0" in line for line in r.recoveries), r.recoveries
        assert r.prefill_worker != "p0"
    fleet.restart("p0")


def test_handoff_to_dead_owner_reports_kv_failed_and_frees_blocks(fleet: Fleet) -> None:
    """The decode side of a failed hand-off: with report_kv_failure the decode worker ends
    the stream with kv_failed (the router prefills again elsewhere) and keeps nothing."""
    from tandem.v1 import router_pb2 as rpb
    from tandem.v1 import worker_pb2 as wpb
    from tandem.v1 import worker_pb2_grpc as wgrpc

    [prompt] = prompts(1, 100)
    sampling = rpb.SamplingParams(max_tokens=8, temperature=0.0)
    with grpc.insecure_channel(fleet.addresses["p1"]) as ch:
        prefill = wgrpc.PrefillWorkerStub(ch)
        resp = prefill_result(
            prefill.Prefill(
                wpb.PrefillRequest(request_id="kvf", prompt_token_ids=prompt, sampling=sampling),
                timeout=30,
            )
        )
        assert resp.HasField("kv")
        prefill.Abort(rpb.AbortRequest(request_id="kvf"), timeout=5)  # the lease is revoked
    with grpc.insecure_channel(fleet.addresses["d1"]) as ch:
        decode = wgrpc.DecodeWorkerStub(ch)
        msgs = list(
            decode.Decode(
                wpb.DecodeRequest(
                    request_id="kvf", prompt_token_ids=prompt, sampling=sampling,
                    output_token_ids=[resp.first_token_id], kv=resp.kv, report_kv_failure=True,
                ),
                timeout=30,
            )
        )  # fmt: skip
    assert [m.WhichOneof("kind") for m in msgs] == ["kv_failed"]
    assert "lease" in msgs[0].kv_failed.reason


def test_sigkill_decode_with_four_streams_migrates_them(fleet: Fleet, reference) -> None:
    cases = prompts(2, 8) + prompts(2, 120)  # colocated and disaggregated
    max_tokens = 400

    async def scenario() -> list[Result]:
        started = [asyncio.Event() for _ in cases]
        tasks = [
            asyncio.create_task(stream_until(fleet.addresses["r0"], p, max_tokens, e, 2))
            for p, e in zip(cases, started, strict=True)
        ]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), WAIT_S)
        fleet.kill("d0")
        return list(await asyncio.gather(*tasks))

    results = run(scenario())
    assert isinstance(results, list)
    check_outputs(reference, cases, results, max_tokens)
    migrated = [r for r in results if r.migrations]
    assert migrated, "no stream was on d0"  # the load policy spreads 4 streams over both
    for r in migrated:
        assert r.migrations == 1 and r.decode_worker == "d1", r.recoveries
        assert "decode_failed on d0" in r.recoveries[0]
    # New requests go straight to d1 (d0 is out of rotation), whether or not Redis saw it go.
    [after] = run_all([generate(fleet.addresses["r0"], prompts(1, 8)[0], 4)])
    assert after.decode_worker == "d1" and not after.migrations
    fleet.restart("d0")


def test_seeded_sampling_is_reproducible_across_a_migration(fleet: Fleet) -> None:
    [prompt] = prompts(1, 8)
    sampling = {"max_tokens": 300, "temperature": 0.9, "top_k": 50, "seed": 1234}

    async def sampled(started: asyncio.Event | None) -> Result:
        result = Result()
        async with AsyncTandemClient(fleet.addresses["r0"], timeout_s=WAIT_S) as client:
            async for _ in client.stream(prompt, result=result, ignore_eos=True, **sampling):
                if started is not None:
                    started.set()
        return result

    async def scenario() -> tuple[Result, str]:
        started = asyncio.Event()
        task = asyncio.create_task(sampled(started))
        await asyncio.wait_for(started.wait(), WAIT_S)
        [victim] = [n for n in ("d0", "d1") if fleet.stats(n).num_running]  # where it runs
        fleet.kill(victim)
        return await task, victim

    interrupted, victim = run(scenario())  # type: ignore[misc]
    fleet.restart(victim)
    clean = run(sampled(None))
    assert isinstance(clean, Result)
    assert interrupted.migrations == 1, interrupted.recoveries
    assert clean.migrations == 0
    assert interrupted.token_ids == clean.token_ids


def test_no_healthy_decode_worker_fails_fast_with_unavailable(fleet: Fleet) -> None:
    [prompt] = prompts(1, 8)

    async def scenario() -> tuple[TandemError | None, TandemError | None]:
        started = asyncio.Event()
        task = asyncio.create_task(stream_until(fleet.addresses["r0"], prompt, 2000, started, 1))
        await asyncio.wait_for(started.wait(), WAIT_S)
        fleet.kill("d0")
        fleet.kill("d1")
        mid_stream = after = None
        try:
            await task
        except TandemError as exc:
            mid_stream = exc
        try:
            await generate(fleet.addresses["r0"], prompt, 4)
        except TandemError as exc:
            after = exc
        return mid_stream, after

    mid_stream, after = run(scenario())  # type: ignore[misc]
    for exc in (mid_stream, after):
        assert exc is not None and exc.code == grpc.StatusCode.UNAVAILABLE, exc
    # r0 held the stream for its 2 s (--stream-hold-s) before giving up
    assert mid_stream is not None and mid_stream.message.endswith(
        "no other healthy decode worker after holding the stream 2.0s"
    ), mid_stream.message
    fleet.restart("d0")
    fleet.restart("d1")


def test_sigstop_decode_migrates_within_keepalive_and_recovers(fleet: Fleet, reference) -> None:
    cases = prompts(4, 8)
    max_tokens = 400
    stopped: list[bool] = []
    frozen_at: list[float] = []

    async def scenario() -> list[Result]:
        started = [asyncio.Event() for _ in cases]
        tasks = [
            asyncio.create_task(stream_until(fleet.addresses["r0"], p, max_tokens, e, 2))
            for p, e in zip(cases, started, strict=True)
        ]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), WAIT_S)
        fleet.kill("d1", signal.SIGSTOP)
        frozen_at.append(time.monotonic())
        results = list(await asyncio.gather(*tasks))
        # Finished while d1 is still frozen (it stays stopped ~10 s): nobody waited it out.
        stopped.append(fleet.procs["d1"].poll() is None)
        more = await asyncio.gather(
            *(generate(fleet.addresses["r0"], p, 16) for p in prompts(4, 8))
        )
        results.extend(more)
        return results

    loop_results = run(scenario())
    assert isinstance(loop_results, list)
    results, extra = loop_results[:4], loop_results[4:]
    check_outputs(reference, cases, results, max_tokens)
    assert all(r.decode_worker == "d0" for r in extra)
    assert any(r.migrations for r in results)
    for r in results:
        if r.migrations:
            assert "decode_failed on d1" in r.recoveries[0] and r.decode_worker == "d0"
    # d1 stays frozen ~10 s; requests keep coming (the breaker's probes reach d1 and fail
    # over) and every one of them is served.
    while time.monotonic() < frozen_at[0] + 10.0:
        [probe] = run_all([generate(fleet.addresses["r0"], prompts(1, 8)[0], 4)])
        assert probe.finish_reason == "length" and probe.decode_worker == "d0", probe.recoveries
        time.sleep(0.2)
    fleet.kill("d1", signal.SIGCONT)  # back; its abandoned requests free their blocks
    fleet.wait_registered("d1")
    # d1 serves again (through a fresh connection: the one keepalive closed may still be in
    # reconnect backoff). A thawed worker catching up on its backlog may still miss a
    # keepalive on a loaded machine; that request then migrates, so allow a few rounds.
    served_by_d1 = []
    for _ in range(5):
        after = run_all([generate(fleet.addresses["r0"], p, 64) for p in prompts(4, 8)])
        assert all(r.finish_reason == "length" for r in after)
        served_by_d1 = [r for r in after if r.decode_worker == "d1" and not r.recoveries]
        if served_by_d1:
            break
    assert served_by_d1, [(r.decode_worker, r.recoveries) for r in after]


def test_redis_killed_then_restarted(fleet: Fleet, reference) -> None:
    long_cases = prompts(3, 120)
    fleet.redis.kill()
    try:
        results = run_all([generate(fleet.addresses["r0"], p, 8) for p in long_cases])
        check_outputs(reference, long_cases, results, 8)
        # A prefill worker dies while Redis cannot tell anyone: the router finds out itself.
        fleet.kill("p1")
        more = prompts(4, 120)
        results = run_all([generate(fleet.addresses["r0"], p, 8) for p in more])
        check_outputs(reference, more, results, 8)
        assert all(r.index_degraded for r in results)
        assert all(r.prefill_worker in ("p0", "") for r in results), [
            (r.prefill_worker, r.recoveries) for r in results
        ]
    finally:
        fleet.redis.restart()
    fleet.restart("p1")
    fleet.wait_registered("p0", "p1", "d0", "d1")
    cases = prompts(2, 120)
    results = run_all([generate(fleet.addresses["r0"], p, 8) for p in cases])
    check_outputs(reference, cases, results, 8)


def test_overload_at_four_times_max_inflight_admits_exactly_the_limit(
    fleet: Fleet, reference
) -> None:
    cases = prompts(4 * MAX_INFLIGHT, 8)
    max_tokens = 1000  # the admitted run long after the whole burst has arrived

    async def burst() -> list[Result | TandemError]:
        async with AsyncTandemClient(fleet.addresses["r1"], timeout_s=WAIT_S) as client:

            async def one(p: list[int]) -> Result | TandemError:
                try:
                    return await client.generate(
                        p, max_tokens=max_tokens, temperature=0.0, ignore_eos=True
                    )
                except TandemError as exc:
                    return exc

            return list(await asyncio.gather(*(one(p) for p in cases)))

    outcomes = run(burst())
    assert isinstance(outcomes, list)
    ok = [(p, o) for p, o in zip(cases, outcomes, strict=True) if isinstance(o, Result)]
    refused = [o for o in outcomes if isinstance(o, TandemError)]
    assert len(ok) == MAX_INFLIGHT, f"{len(ok)} admitted with max_inflight {MAX_INFLIGHT}"
    assert all(e.code == grpc.StatusCode.RESOURCE_EXHAUSTED for e in refused), refused
    assert all("max_inflight" in e.message for e in refused)
    assert all(e.retry_after_s for e in refused)
    check_outputs(reference, [p for p, _ in ok], [o for _, o in ok], max_tokens)


def test_duplicate_request_id_across_two_routers(fleet: Fleet, reference) -> None:
    [prompt] = prompts(1, 8)

    async def scenario() -> tuple[Result, TandemError, TandemError, Result]:
        started = asyncio.Event()
        first = asyncio.create_task(
            _stream_with_id(fleet.addresses["r0"], prompt, 300, "dup-1", started)
        )
        await asyncio.wait_for(started.wait(), WAIT_S)
        errors = []
        for router in ("r1", "r0"):  # the other router, and the same one
            try:
                await generate(fleet.addresses[router], prompt, 4, request_id="dup-1")
            except TandemError as exc:
                errors.append(exc)
        done = await first
        reuse = await generate(fleet.addresses["r1"], prompt, 4, request_id="dup-1")
        return done, errors[0], errors[1], reuse

    out = run(scenario())
    assert isinstance(out, tuple)
    done, other_router, same_router, reuse = out
    assert other_router.code == grpc.StatusCode.ALREADY_EXISTS, other_router
    assert same_router.code == grpc.StatusCode.ALREADY_EXISTS, same_router
    check_outputs(reference, [prompt], [done], 300)  # the first call was not disturbed
    assert reuse.finish_reason == "length"  # the id is free again once it ended


async def _stream_with_id(
    address: str, prompt: list[int], max_tokens: int, request_id: str, started: asyncio.Event
) -> Result:
    result = Result()
    async with AsyncTandemClient(address, timeout_s=WAIT_S) as client:
        async for _ in client.stream(
            prompt, result=result, max_tokens=max_tokens, temperature=0.0, ignore_eos=True,
            request_id=request_id,
        ):  # fmt: skip
            started.set()
    return result


def test_one_mebibyte_prompt_beside_live_streams(fleet: Fleet, reference) -> None:
    cases = prompts(4, 8)
    max_tokens = 200

    async def scenario() -> tuple[list[Result], list[TandemError]]:
        started = [asyncio.Event() for _ in cases]
        tasks = [
            asyncio.create_task(stream_until(fleet.addresses["r0"], p, max_tokens, e, 1))
            for p, e in zip(cases, started, strict=True)
        ]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), WAIT_S)
        errors: list[TandemError] = []
        async with AsyncTandemClient(fleet.addresses["r0"], timeout_s=WAIT_S) as client:
            for _ in range(3):
                try:
                    await client.generate("x" * (1 << 20), max_tokens=4)
                except TandemError as exc:
                    errors.append(exc)
        return list(await asyncio.gather(*tasks)), errors

    out = run(scenario())
    assert isinstance(out, tuple)
    results, errors = out
    assert len(errors) == 3
    assert all(e.code == grpc.StatusCode.INVALID_ARGUMENT for e in errors)
    assert all("cannot fit the model's context" in e.message for e in errors), errors
    check_outputs(reference, cases, results, max_tokens)
