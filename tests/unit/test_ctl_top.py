"""`tandem ctl top`: the screen rendered from a StatusResponse (exact lines), and the redraw
loop driven by a fake controller and a pipe standing in for the keyboard."""

from __future__ import annotations

import io
import math
import os
import time
from collections.abc import Iterator

import grpc
import pytest

from tandem.ctl import CLEAR_BELOW, CLEAR_EOL, ENTER_SCREEN, HOME, LEAVE_SCREEN, render_top, top
from tandem.v1 import admin_pb2 as apb

NAN = math.nan
NOW = 1_700_000_003.25
CLOCK = time.strftime("%H:%M:%S", time.localtime(NOW))


def status() -> apb.StatusResponse:
    return apb.StatusResponse(
        mode="auto",
        actuator="kubernetes",
        roles=[
            apb.RoleStatus(
                role="prefill", current=1, desired=2, live=1, reason="TTFT p90 410 ms > 300 ms"
            ),
            apb.RoleStatus(role="decode", current=3, desired=3, live=2, draining=1, reason="ok"),
        ],
        workers=[
            apb.WorkerStatus(
                worker_id="prefill-0",
                role="prefill",
                num_running=2,
                num_waiting=5,
                num_blocks=256,
                num_free_blocks=64,
                step_ms=12.34,
                tokens_per_s=4096.4,
                kv_format="float8_e4m3fn/0011223344556677",
            ),
            apb.WorkerStatus(
                worker_id="decode-0",
                role="decode",
                num_running=17,
                num_blocks=1024,
                num_free_blocks=1024,
                step_ms=8.05,
                tokens_per_s=250,
                draining=True,
            ),
        ],
        recent=apb.LatencySummary(
            window_s=60,
            requests=42,
            ttft_p50_ms=120.4,
            ttft_p90_ms=340.6,
            itl_p50_ms=11.5,
            itl_p90_ms=20.2,
        ),  # fmt: skip
        observed_unix=NOW - 3.2,
    )


def test_render_top() -> None:
    assert render_top(status(), "10.0.0.7:50061", NOW) == [
        f"tandem ctl top  10.0.0.7:50061  {CLOCK}  mode auto  actuator kubernetes  "
        "observed 3 s ago",
        "P:D  current 1:3  wanted 2:3  live 1:2",
        "  prefill: TTFT p90 410 ms > 300 ms",
        "  decode: ok",
        "last 60 s: 42 requests  TTFT p50 120 ms p90 341 ms  ITL p50 12 ms p90 20 ms",
        "",
        "ROLE     WORKER                   WAITING RUNNING      KV USED/TOTAL      STEP    TOK/S"
        "  KV",
        "prefill  prefill-0                      5       2      192/256 (75%)   12.3 ms     4096  "
        "fp8/00112233",
        "decode   decode-0 [draining]            0      17        0/1024 (0%)    8.1 ms      250"
        "  -",
    ]


def test_render_top_with_kv_tiers() -> None:
    """A worker with KV tiers: a column of each tier's verified blocks and onload rate (prompt
    tokens per second brought back into the device cache), then the prompt tokens its tiers
    served since start; parts aligned across workers, "-" for a worker without tiers."""
    s = status()
    w = s.workers[0]
    w.host_tier_blocks, w.host_onload_tokens_per_s = 1_234, 120_540.0
    w.disk_tier_blocks, w.disk_onload_tokens_per_s = 3_400_000, 900.4
    w.tier_hit_tokens = 56_012
    s.workers[1].kv_format = "bfloat16"
    # a disk tier only, holding blocks but none served yet
    s.workers.add(
        worker_id="decode-1", role="decode", disk_tier_blocks=10, disk_onload_tokens_per_s=2_000.0
    )
    assert render_top(s, "10.0.0.7:50061", NOW)[6:] == [
        "ROLE     WORKER                   WAITING RUNNING      KV USED/TOTAL      STEP    TOK/S"
        "  KV            TIERS",
        "prefill  prefill-0                      5       2      192/256 (75%)   12.3 ms     4096  "
        "fp8/00112233  host 1.2k blk 120.5k/s  disk 3.4M blk 900/s  hits 56.0k",
        "decode   decode-0 [draining]            0      17        0/1024 (0%)    8.1 ms      250"
        "  bfloat16      -",
        "decode   decode-1                       0       0            0/0 (-)    0.0 ms        0"
        "  -                                     disk 10 blk 2.0k/s   hits 0",
    ]


def test_tier_parts_no_worker_shows_take_no_room() -> None:
    """Host tiers only (one still empty, its rate measured at start): no room kept for disk."""
    s = status()
    s.workers[0].host_onload_tokens_per_s = 50_000.0
    s.workers[1].host_tier_blocks = 7
    s.workers[1].host_onload_tokens_per_s = 999.0
    s.workers[1].tier_hit_tokens = 28
    assert [line[87:] for line in render_top(s, "a:1", NOW)[6:]] == [
        "  KV            TIERS",
        "  fp8/00112233  host 0 blk 50.0k/s  hits 0",
        "  -             host 7 blk 999/s    hits 28",
    ]


def test_render_top_before_any_observation() -> None:
    empty = apb.StatusResponse(
        mode="auto",
        actuator="none",
        recent=apb.LatencySummary(
            window_s=60, ttft_p50_ms=NAN, ttft_p90_ms=NAN, itl_p50_ms=NAN, itl_p90_ms=NAN
        ),
        last_error="observe: Redis down",
    )
    assert render_top(empty, "a:1", NOW) == [
        f"tandem ctl top  a:1  {CLOCK}  mode auto  actuator none  observed not yet",
        "P:D  current 0:0  wanted 0:0  live 0:0",
        "last 60 s: 0 requests  TTFT p50 n/a p90 n/a  ITL p50 n/a p90 n/a",
        "",
        "ROLE     WORKER                   WAITING RUNNING      KV USED/TOTAL      STEP    TOK/S"
        "  KV",
        "(no workers heartbeating)",
        "",
        "last error: observe: Redis down",
    ]


def test_long_worker_names_widen_the_column() -> None:
    s = status()
    del s.workers[1:]
    s.workers[0].worker_id = "tandem-prefill-5d8f7c9b4-x2x9z"
    s.workers[0].num_blocks = 0
    s.workers[0].num_free_blocks = 0
    header, row = render_top(s, "a:1", NOW)[-2:]
    assert header == (
        "ROLE     WORKER                         WAITING RUNNING      KV USED/TOTAL      STEP"
        "    TOK/S  KV"
    )
    assert row == (
        "prefill  tandem-prefill-5d8f7c9b4-x2x9z       5       2            0/0 (-)   12.3 ms"
        "     4096  fp8/00112233"
    )


class Unavailable(grpc.RpcError):
    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return "connection refused"


class Refused(Unavailable):
    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAUTHENTICATED


@pytest.fixture
def keyboard() -> Iterator[tuple[io.FileIO, int]]:
    """(the read end `top` polls, the write end a test types into)."""
    r, w = os.pipe()
    keys = io.FileIO(r, "r")
    try:
        yield keys, w
    finally:
        keys.close()
        os.close(w)


def test_top_redraws_in_place_until_q(
    keyboard: tuple[io.FileIO, int], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "60")
    monkeypatch.setenv("LINES", "8")
    keys, typing = keyboard
    replies: list[apb.StatusResponse | Exception] = [status(), Unavailable(), status()]

    def fetch() -> apb.StatusResponse:
        reply = replies.pop(0)
        if isinstance(reply, Exception):
            raise reply
        if not replies:
            os.write(typing, b"xq")  # the operator quits after the third frame
        return reply

    out = io.StringIO()
    assert top(fetch, "a:1", 0.01, out, keys, now=lambda: NOW) == 0
    assert replies == []
    text = out.getvalue()
    assert text.startswith(ENTER_SCREEN) and text.endswith(LEAVE_SCREEN)
    frames = text.removeprefix(ENTER_SCREEN).removesuffix(LEAVE_SCREEN).split(HOME)
    assert frames[0] == "" and len(frames) == 4
    first, unreachable, third = frames[1:]
    assert first == third
    # Each line cut to the terminal's 60 columns and cleared to its end; 7 lines (one row
    # is kept for the footer), then the rest of the screen cleared.
    expected = [line[:60] for line in render_top(status(), "a:1", NOW)[:7]]
    assert first == "".join(f"{line}{CLEAR_EOL}\n" for line in expected) + (
        f"q: quit{CLEAR_EOL}{CLEAR_BELOW}"
    )
    assert unreachable == (
        f"tandem ctl top  a:1{CLEAR_EOL}\n"
        f"cannot reach the controller: UNAVAILABLE: connection refused{CLEAR_EOL}\n"
        f"q: quit{CLEAR_EOL}{CLEAR_BELOW}"
    )


def test_top_stops_on_a_refused_key_and_restores_the_screen(
    keyboard: tuple[io.FileIO, int],
) -> None:
    def fetch() -> apb.StatusResponse:
        raise Refused()

    out = io.StringIO()
    with pytest.raises(Refused):
        top(fetch, "a:1", 0.01, out, keyboard[0])
    assert out.getvalue() == ENTER_SCREEN + LEAVE_SCREEN


def test_top_quits_when_the_keyboard_closes() -> None:
    r, w = os.pipe()
    calls = []

    def fetch() -> apb.StatusResponse:
        calls.append(1)
        if len(calls) == 2:
            os.close(w)  # EOF on the read end: the terminal went away
        return status()

    with io.FileIO(r, "r") as keys:
        assert top(fetch, "a:1", 0.01, io.StringIO(), keys, now=lambda: NOW) == 0
    assert len(calls) == 2
