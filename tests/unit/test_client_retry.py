"""tandem.client retry: the pure policy (tandem.client_retry) and its bookkeeping, exactly, on
a fake clock; then the retry loop of both clients against a real gRPC server (a test double
of the router) over a socket."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator

import grpc
import pytest

from tandem.client import (
    RETRY_AFTER_KEY,
    AsyncTandemClient,
    Result,
    Retry,
    TandemClient,
    TandemError,
)
from tandem.client_convert import apply_response, status_error
from tandem.client_retry import Attempts
from tandem.services.common.rpc import errors
from tandem.v1 import router_pb2 as rpb
from tandem.v1 import router_pb2_grpc as rgrpc

# -- pure parts ----------------------------------------------------------------------------


def test_backoff_grows_by_the_multiplier_up_to_the_cap() -> None:
    retry = Retry(initial_backoff_s=0.125, max_backoff_s=1.0, multiplier=2.0, jitter=0.0)
    assert [retry.delay_s(n) for n in range(2, 8)] == [0.125, 0.25, 0.5, 1.0, 1.0, 1.0]


def test_jitter_scales_the_backoff_within_the_fraction() -> None:
    retry = Retry(initial_backoff_s=0.5, max_backoff_s=8.0, jitter=0.5)
    assert retry.delay_s(2, u=0.0) == 0.25
    assert retry.delay_s(2, u=0.5) == 0.5
    assert retry.delay_s(2, u=1.0) == 0.75
    assert retry.delay_s(3, u=0.0) == 0.5


def test_the_cap_applies_after_jitter() -> None:
    retry = Retry(initial_backoff_s=8.0, max_backoff_s=8.0, jitter=0.5)
    assert retry.delay_s(2, u=1.0) == 8.0
    assert retry.delay_s(2, u=0.0) == 4.0


def test_a_longer_server_hint_wins_and_is_capped_too() -> None:
    retry = Retry(initial_backoff_s=0.5, max_backoff_s=8.0, jitter=0.5)
    assert retry.delay_s(2, retry_after_s=2.0, u=0.5) == 2.0  # hint longer than backoff
    assert retry.delay_s(2, retry_after_s=0.25, u=0.5) == 0.5  # backoff longer than hint
    assert retry.delay_s(2, retry_after_s=0.6, u=1.0) == 0.75  # jittered backoff longer
    assert retry.delay_s(2, retry_after_s=100.0) == 8.0  # a hint never exceeds the cap
    assert retry.delay_s(2, retry_after_s=0.0) == 0.5


@pytest.mark.parametrize(("attempt", "u"), [(1, 0.5), (0, 0.5), (2, -0.1), (2, 1.5)])
def test_delay_rejects_attempts_before_the_first_retry_and_u_outside_0_1(
    attempt: int, u: float
) -> None:
    with pytest.raises(ValueError):
        Retry().delay_s(attempt, u=u)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"max_attempts": 0},
        {"initial_backoff_s": -1.0},
        {"initial_backoff_s": 2.0, "max_backoff_s": 1.0},
        {"multiplier": 0.5},
        {"jitter": -0.1},
        {"jitter": 1.5},
    ],
)
def test_invalid_retry_configs_raise(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        Retry(**kwargs)  # type: ignore[arg-type]


def test_retries_only_listed_codes_and_only_below_max_attempts() -> None:
    retry = Retry(max_attempts=3)
    assert retry.codes == (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED)
    unavailable = TandemError(grpc.StatusCode.UNAVAILABLE, "down")
    full = TandemError(grpc.StatusCode.RESOURCE_EXHAUSTED, "full")
    bad = TandemError(grpc.StatusCode.INVALID_ARGUMENT, "bad")
    assert retry.retries(unavailable, 1) and retry.retries(full, 2)
    assert not retry.retries(unavailable, 3)
    assert not retry.retries(bad, 1)
    assert not Retry(max_attempts=1).retries(unavailable, 1)


def test_attempts_draw_jitter_from_the_injected_source_and_pass_the_hint() -> None:
    draws = iter([0.0, 1.0])
    retry = Retry(initial_backoff_s=0.5, max_backoff_s=8.0, jitter=0.5, rng=lambda: next(draws))
    attempts = Attempts(retry, timeout_s=None)
    full = TandemError(grpc.StatusCode.RESOURCE_EXHAUSTED, "full")
    assert attempts.next_delay_s(full) == 0.25  # before attempt 2, u = 0
    assert attempts.next_delay_s(full) == 1.5  # before attempt 3, u = 1
    assert attempts.next_delay_s(full) is None  # max_attempts 3 reached
    hinted = Attempts(Retry(initial_backoff_s=0.5, jitter=0.0), timeout_s=None)
    assert hinted.next_delay_s(TandemError(grpc.StatusCode.UNAVAILABLE, "x", 3.0)) == 3.0


def test_no_retry_without_a_retry_config_or_past_the_deadline() -> None:
    down = TandemError(grpc.StatusCode.UNAVAILABLE, "down")
    assert Attempts(None, timeout_s=None).next_delay_s(down) is None
    # A wait that would end after the call's timeout is not taken.
    assert Attempts(Retry(initial_backoff_s=1.0, jitter=0.0), 0.5).next_delay_s(down) is None


def _fails(code: grpc.StatusCode, retry_after_s: float | None = None) -> TandemError:
    return TandemError(code, "failed", retry_after_s)


def _no_draw() -> float:
    raise AssertionError("the jitter was drawn for a call that is not retried")


UNAVAILABLE = grpc.StatusCode.UNAVAILABLE
# u = 0.5 is a jitter factor of exactly 1: the policy's waits are the bare backoff.
STEADY = Retry(max_attempts=6, initial_backoff_s=0.125, max_backoff_s=1.0, rng=lambda: 0.5)


def test_policy_retries_exactly_unavailable_and_resource_exhausted_by_default() -> None:
    retried = {
        code for code in grpc.StatusCode if STEADY.next_delay_s(1, _fails(code), None) is not None
    }
    assert retried == {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED}
    only_aborted = Retry(codes=(grpc.StatusCode.ABORTED,), jitter=0.0)
    assert only_aborted.next_delay_s(1, _fails(grpc.StatusCode.ABORTED), None) == 0.1
    assert only_aborted.next_delay_s(1, _fails(UNAVAILABLE), None) is None


def test_policy_backoff_sequence_until_attempts_run_out() -> None:
    delays = [STEADY.next_delay_s(n, _fails(UNAVAILABLE), None) for n in range(1, 7)]
    # Waits before attempts 2..6, doubling up to the cap; attempt 6 failing is the last.
    assert delays == [0.125, 0.25, 0.5, 1.0, 1.0, None]


def test_policy_server_hint_longer_than_the_backoff_wins_up_to_the_cap() -> None:
    assert STEADY.next_delay_s(1, _fails(UNAVAILABLE, 0.75), None) == 0.75
    assert STEADY.next_delay_s(3, _fails(UNAVAILABLE, 0.25), None) == 0.5
    assert STEADY.next_delay_s(1, _fails(UNAVAILABLE, 30.0), None) == 1.0


def test_policy_deadline_cut_off_is_a_wait_that_does_not_end_before_it() -> None:
    down = _fails(UNAVAILABLE)
    assert STEADY.next_delay_s(3, down, None) == 0.5  # no timeout
    assert STEADY.next_delay_s(3, down, 0.75) == 0.5
    assert STEADY.next_delay_s(3, down, 0.5) is None  # would end exactly at the deadline
    assert STEADY.next_delay_s(3, down, 0.25) is None
    assert STEADY.next_delay_s(3, down, 0.0) is None
    # The wait cut off is the one the server's hint made longer.
    assert STEADY.next_delay_s(1, _fails(UNAVAILABLE, 0.75), 0.5) is None


def test_policy_never_retries_a_stream_that_delivered_a_chunk_nor_draws_for_it() -> None:
    retry = Retry(max_attempts=6, rng=_no_draw)
    assert retry.next_delay_s(1, _fails(UNAVAILABLE), None, delivered=True) is None
    assert retry.next_delay_s(1, _fails(grpc.StatusCode.INTERNAL), None) is None
    assert retry.next_delay_s(6, _fails(UNAVAILABLE), None) is None


def test_policy_draws_the_jitter_once_per_retry_even_one_the_deadline_cuts() -> None:
    draws: list[float] = []

    def rng() -> float:
        draws.append(1.0)
        return 1.0

    retry = Retry(initial_backoff_s=0.5, max_backoff_s=8.0, jitter=0.5, rng=rng)
    assert retry.next_delay_s(1, _fails(UNAVAILABLE), None) == 0.75  # 0.5 * 1.5
    assert retry.next_delay_s(1, _fails(UNAVAILABLE), 0.75) is None
    assert draws == [1.0, 1.0]


class FakeClock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_attempts_count_and_cut_off_on_the_injected_clock() -> None:
    clock = FakeClock(100.0)
    attempts = Attempts(STEADY, timeout_s=1.0, clock=clock)
    assert (attempts.number, attempts.deadline, attempts.timeout_s()) == (1, 101.0, 1.0)
    clock.now = 100.25
    assert attempts.timeout_s() == 0.75
    assert attempts.next_delay_s(_fails(UNAVAILABLE)) == 0.125  # 0.75 s left
    assert attempts.number == 2
    clock.now = 100.5
    assert attempts.next_delay_s(_fails(UNAVAILABLE)) == 0.25  # 0.5 s left
    assert attempts.number == 3
    clock.now = 100.75
    assert attempts.next_delay_s(_fails(UNAVAILABLE)) is None  # 0.5 s wait, 0.25 s left
    assert attempts.number == 3  # no attempt 4
    clock.now = 102.0
    assert attempts.timeout_s() == 0.0  # past the deadline: never negative


def test_attempts_without_timeout_or_retry() -> None:
    clock = FakeClock(5.0)
    attempts = Attempts(STEADY, timeout_s=None, clock=clock)
    assert (attempts.deadline, attempts.timeout_s()) == (None, None)
    waits = [attempts.next_delay_s(_fails(UNAVAILABLE)) for _ in range(6)]
    assert waits == [0.125, 0.25, 0.5, 1.0, 1.0, None]
    assert attempts.number == 6
    never = Attempts(None, timeout_s=1.0, clock=clock)
    assert never.next_delay_s(_fails(UNAVAILABLE)) is None
    assert (never.number, never.timeout_s()) == (1, 1.0)


def test_attempts_pass_delivered_through() -> None:
    attempts = Attempts(Retry(rng=_no_draw), timeout_s=None, clock=FakeClock(0.0))
    assert attempts.next_delay_s(_fails(UNAVAILABLE), delivered=True) is None
    assert attempts.number == 1


def test_in_stream_error_carries_its_retry_after() -> None:
    def error(retry_after_ms: int) -> rpb.GenerateResponse:
        code = grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]
        e = rpb.Error(code=code, message="full", retry_after_ms=retry_after_ms)
        return rpb.GenerateResponse(request_id="r", error=e)

    with pytest.raises(TandemError) as err:
        apply_response(Result(), error(250))
    assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert (err.value.message, err.value.retry_after_s) == ("full", 0.25)
    with pytest.raises(TandemError) as err:
        apply_response(Result(), error(0))
    assert err.value.retry_after_s is None


class FakeRpcError(grpc.aio.AioRpcError):
    def __init__(self, code: grpc.StatusCode, trailers: tuple[tuple[str, str], ...]) -> None:
        super().__init__(code, grpc.aio.Metadata(), grpc.aio.Metadata(*trailers), "details")


def test_status_error_reads_the_trailer() -> None:
    code = grpc.StatusCode.UNAVAILABLE
    assert RETRY_AFTER_KEY == errors.RETRY_AFTER_KEY
    assert status_error(FakeRpcError(code, ((RETRY_AFTER_KEY, "1500"),))).retry_after_s == 1.5
    assert status_error(FakeRpcError(code, ((RETRY_AFTER_KEY, "soon"),))).retry_after_s is None
    got = status_error(FakeRpcError(code, ()))
    assert (got.code, got.message, got.retry_after_s) == (code, "details", None)


# -- the retry loop over real gRPC ---------------------------------------------------------

HINT_MS = 20
FAST = Retry(max_attempts=3, initial_backoff_s=0.01, max_backoff_s=0.1, jitter=0.0)


class RouterDouble(rgrpc.RouterServicer):
    """Test double of tandem.v1.Router: its first `failures` Generate (and Tokenize) calls fail
    with `code` and a pushback hint in the trailer, and also as an in-stream Error first when
    `in_stream_error` (what the real router does); later calls stream chunks 5, 6, 7. With
    `fail_after_first_chunk`, every Generate call sends chunk 5 and then fails."""

    def __init__(
        self,
        failures: int = 0,
        code: grpc.StatusCode = grpc.StatusCode.RESOURCE_EXHAUSTED,
        in_stream_error: bool = True,
        fail_after_first_chunk: bool = False,
    ) -> None:
        self.failures = failures
        self.code = code
        self.in_stream_error = in_stream_error
        self.fail_after_first_chunk = fail_after_first_chunk
        self.generate_calls = 0
        self.tokenize_calls = 0

    async def _fail(self, context: grpc.aio.ServicerContext) -> None:
        await context.abort(self.code, "router full", ((RETRY_AFTER_KEY, str(HINT_MS)),))

    async def Generate(
        self, request: rpb.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[rpb.GenerateResponse]:
        self.generate_calls += 1
        if self.generate_calls <= self.failures:
            if self.in_stream_error:
                e = rpb.Error(
                    code=self.code.value[0], message="router full", retry_after_ms=HINT_MS
                )
                yield rpb.GenerateResponse(request_id="r", error=e)
            await self._fail(context)
        for token in (5, 6, 7):
            yield rpb.GenerateResponse(
                request_id="r", chunk=rpb.Chunk(token_ids=[token], text=f"<{token}>")
            )
            if self.fail_after_first_chunk:
                await context.abort(grpc.StatusCode.UNAVAILABLE, "worker failed; retry")
        complete = rpb.Complete(finish_reason=rpb.FINISH_REASON_STOP)
        yield rpb.GenerateResponse(request_id="r", complete=complete)

    async def Tokenize(
        self, request: rpb.TokenizeRequest, context: grpc.aio.ServicerContext
    ) -> rpb.TokenizeResponse:
        self.tokenize_calls += 1
        if self.tokenize_calls <= self.failures:
            await self._fail(context)
        return rpb.TokenizeResponse(token_ids=[1, 2])


class ServerThread:
    """A grpc.aio server for `servicer` on its own thread and event loop, so that the
    blocking client can call it from the test's thread."""

    def __init__(self, servicer: RouterDouble) -> None:
        self.servicer = servicer
        self.address = ""
        self._started = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._serve()), daemon=True)

    async def _serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        server = grpc.aio.server()
        rgrpc.add_RouterServicer_to_server(self.servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        self.address = f"127.0.0.1:{port}"
        self._started.set()
        await self._stop.wait()
        await server.stop(0)

    def __enter__(self) -> ServerThread:
        self._thread.start()
        assert self._started.wait(30), "test server did not start"
        return self

    def __exit__(self, *exc: object) -> None:
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(30)


def test_sync_generate_retries_until_the_stream_starts() -> None:
    with ServerThread(RouterDouble(failures=2)) as server:
        with TandemClient(server.address, retry=FAST) as client:
            result = client.generate("hi")
    assert server.servicer.generate_calls == 3
    assert (result.token_ids, result.text, result.finish_reason) == ([5, 6, 7], "<5><6><7>", "stop")


def test_async_stream_retries_until_the_stream_starts() -> None:
    async def main(address: str) -> list[list[int]]:
        async with AsyncTandemClient(address, retry=FAST) as client:
            return [c.token_ids async for c in client.stream("hi")]

    with ServerThread(RouterDouble(failures=2, in_stream_error=False)) as server:
        chunks = asyncio.run(main(server.address))
    assert server.servicer.generate_calls == 3
    assert chunks == [[5], [6], [7]]


@pytest.mark.parametrize("in_stream_error", [True, False])
def test_without_retry_the_first_error_surfaces_with_its_hint(in_stream_error: bool) -> None:
    with ServerThread(RouterDouble(failures=2, in_stream_error=in_stream_error)) as server:
        with TandemClient(server.address) as client, pytest.raises(TandemError) as err:
            client.generate("hi")
    assert server.servicer.generate_calls == 1
    assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert (err.value.message, err.value.retry_after_s) == ("router full", HINT_MS / 1e3)


def test_the_last_error_surfaces_once_attempts_run_out() -> None:
    with ServerThread(RouterDouble(failures=5)) as server:
        with TandemClient(server.address, retry=FAST) as client, pytest.raises(TandemError) as err:
            client.generate("hi")
    assert server.servicer.generate_calls == FAST.max_attempts
    assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_codes_not_listed_are_not_retried() -> None:
    double = RouterDouble(failures=1, code=grpc.StatusCode.INVALID_ARGUMENT)
    with ServerThread(double) as server:
        with TandemClient(server.address, retry=FAST) as client, pytest.raises(TandemError) as err:
            client.generate("hi")
    assert server.servicer.generate_calls == 1
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT


def test_a_stream_that_fails_after_its_first_chunk_is_never_retried() -> None:
    async def main(address: str, got: list[list[int]]) -> None:
        async with AsyncTandemClient(address, retry=FAST) as client:
            async for chunk in client.stream("hi"):
                got.append(chunk.token_ids)

    with ServerThread(RouterDouble(fail_after_first_chunk=True)) as server:
        sync_got: list[list[int]] = []
        with TandemClient(server.address, retry=FAST) as client, pytest.raises(TandemError) as err:
            for chunk in client.stream("hi"):
                sync_got.append(chunk.token_ids)
        assert err.value.code == grpc.StatusCode.UNAVAILABLE
        async_got: list[list[int]] = []
        with pytest.raises(TandemError) as err:
            asyncio.run(main(server.address, async_got))
        assert err.value.code == grpc.StatusCode.UNAVAILABLE
    assert server.servicer.generate_calls == 2  # one per client: neither retried
    assert sync_got == async_got == [[5]]


def test_unary_calls_are_retried_too() -> None:
    async def main(address: str) -> list[int]:
        async with AsyncTandemClient(address, retry=FAST) as client:
            return await client.tokenize("hi")

    with ServerThread(RouterDouble(failures=1, code=grpc.StatusCode.UNAVAILABLE)) as server:
        with TandemClient(server.address, retry=FAST) as client:
            assert client.tokenize("hi") == [1, 2]
        assert server.servicer.tokenize_calls == 2
        server.servicer.tokenize_calls = 0
        assert asyncio.run(main(server.address)) == [1, 2]
        assert server.servicer.tokenize_calls == 2
