"""`tandem ctl top` in a pseudo-terminal against a real controller process (with admin keys)
reading worker heartbeats and router timings from a real Redis: it draws the workers and the
last minute's latency, redraws in place about every second, and quits on `q`."""

from __future__ import annotations

import asyncio
import fcntl
import os
import pty
import re
import select
import struct
import sys
import termios
import time
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import grpc
import pytest

from tandem.control import RequestSample
from tandem.ctl import ENTER_SCREEN, HOME, LEAVE_SCREEN
from tandem.services.common.redis.registry import Registry, WorkerInfo
from tandem.services.common.redis.request_log import RequestLog
from tandem.v1 import admin_pb2 as apb
from tandem.v1 import admin_pb2_grpc as agrpc

MODEL = "m"
READER = "dashboards-read-key-0123456789"
ROWS, COLUMNS = 30, 120


@pytest.fixture
def controller(procs: SimpleNamespace, redis_url: str, tmp_path: Path) -> Iterator[str]:
    keys = tmp_path / "admin-keys"
    keys.write_text(f"ops-admin-key-0123456789 ops admin\n{READER} dashboards read\n")
    proc, address = procs.spawn(
        "tandem.services.controller", "--host", "127.0.0.1", "--port", "0", "--metrics-port", "0",
        "--redis-url", redis_url, "--model-id", MODEL, "--interval-s", "0.2",
        "--admin-keys-file", str(keys),
    )  # fmt: skip
    yield address
    procs.stop(proc)


def _status(address: str) -> apb.StatusResponse:
    with grpc.insecure_channel(address) as channel:
        return agrpc.AdminStub(channel).Status(
            apb.StatusRequest(), metadata=(("authorization", f"Bearer {READER}"),), timeout=5
        )


def _feed(redis_url: str, address: str) -> None:
    """Two workers heartbeating and, once the controller reads the request stream, ten
    finished requests."""

    async def body() -> None:
        registry = Registry(redis_url, ttl_s=60)
        for worker_id, role, running, free in (("p0", "prefill", 1, 96), ("d0", "decode", 3, 50)):
            await registry.register(
                WorkerInfo(
                    worker_id=worker_id,
                    role=role,
                    address=f"{worker_id}:1",
                    model=MODEL,
                    epoch=1,
                    num_blocks=128,
                    num_free_blocks=free,
                    num_running=running,
                    num_waiting=2,
                    step_ms=7.5,
                    tokens_per_s=300.0,
                )  # fmt: skip
            )
        await registry.close()
        # The controller's first read of the stream only marks its position.
        deadline = time.monotonic() + 10
        while not _status(address).workers:
            assert time.monotonic() < deadline, "the controller never saw the workers"
            await asyncio.sleep(0.1)
        log = RequestLog(redis_url, MODEL)
        for i in range(10):
            log.record(RequestSample(time.time(), 100.0 + 10 * i, 20.0, 64, 8))
        await log.flush()
        await log.stop()

    asyncio.run(body())


def _read(fd: int, until: float) -> bytes:
    """What the terminal shows until `until` (monotonic), or until the program exits."""
    out = b""
    while (left := until - time.monotonic()) > 0:
        ready, _, _ = select.select([fd], [], [], left)
        if not ready:
            break
        try:
            chunk = os.read(fd, 65536)
        except OSError:  # EIO: the child closed the terminal
            break
        if not chunk:
            break
        out += chunk
    return out


def test_ctl_top_in_a_terminal(controller: str, redis_url: str) -> None:
    _feed(redis_url, controller)
    env = {k: v for k, v in os.environ.items() if k not in ("COLUMNS", "LINES")}
    env["TANDEM_ADMIN_KEY"] = READER
    env["TERM"] = "xterm"
    pid, fd = pty.fork()
    if pid == 0:  # the child: `tandem ctl top` on the terminal's slave side
        argv = [sys.executable, "-m", "tandem.services.cli", "ctl", "--address", controller, "top"]
        os.execve(sys.executable, argv, env)
    try:
        fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", ROWS, COLUMNS, 0, 0))
        screen = b""
        deadline = time.monotonic() + 30
        # Wait for a few frames, the last ones showing the requests the routers timed.
        while screen.count(HOME.encode()) < 4 or b"last 60 s: 10 requests" not in screen:
            assert time.monotonic() < deadline, screen.decode(errors="replace")[-3000:]
            screen += _read(fd, time.monotonic() + 0.5)
        os.write(fd, b"q")
        exit_deadline = time.monotonic() + 10
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            assert time.monotonic() < exit_deadline, "`q` did not end tandem ctl top"
            screen += _read(fd, time.monotonic() + 0.2)
        pid = 0
    finally:
        if pid:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
        screen += _read(fd, time.monotonic() + 0.5)
        os.close(fd)
    assert os.waitstatus_to_exitcode(status) == 0

    text = screen.decode()
    assert text.startswith(ENTER_SCREEN) and text.endswith(LEAVE_SCREEN)
    frames = text.removeprefix(ENTER_SCREEN).removesuffix(LEAVE_SCREEN).split(HOME)[1:]
    assert len(frames) >= 4
    # Redrawn in place: every frame starts at the home position and fits the screen.
    for frame in frames:
        assert frame.count("\r\n") <= ROWS - 1
        assert all(len(line) <= COLUMNS for line in re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", frame)
                   .split("\r\n"))  # fmt: skip
    last = re.sub(r"\x1b\[[0-9;?]*[A-Za-z]", "", frames[-1]).split("\r\n")
    assert last[0].startswith(f"tandem ctl top  {controller}  ")
    assert "mode auto  actuator none" in last[0]
    assert last[1].startswith("P:D  current ")
    header = next(i for i, line in enumerate(last) if line.startswith("ROLE "))
    assert [line.split()[:4] for line in last[header + 1 : header + 3]] == [
        ["prefill", "p0", "2", "1"],
        ["decode", "d0", "2", "3"],
    ]
    assert "32/128 (25%)" in last[header + 1] and "78/128 (61%)" in last[header + 2]
    assert "last 60 s: 10 requests  TTFT p50 140 ms p90 180 ms  ITL p50 20 ms p90 20 ms" in last
    assert last[-1] == "q: quit"
