"""`tandem up`'s children as processes: how one is started (dying with its parent, in a
session of its own, stderr to its log), its ready line, free ports, private files, and the
wait until a router serves."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from tandem.services.common.runtime.supervised import SUPERVISOR_ENV


@dataclass(slots=True)
class Child:
    """One supervised process. A restart replaces `proc` (and `ready_line`) in place."""

    name: str
    proc: subprocess.Popen[str]
    log_path: Path
    module_args: list[str]  # `python -m` arguments, reused as they are by a restart
    ready_marker: str  # the stdout line containing this says the child is serving
    ready_line: str = ""
    metrics_address: str = ""  # host:port of its Prometheus /metrics; "" without one
    # Added to this process's environment, and reused by a restart: secrets go here, not
    # into module_args.
    env: dict[str, str] = field(default_factory=dict)


def popen(
    module_args: list[str],
    log_path: Path,
    mode: str,
    header: str = "",
    env: dict[str, str] | None = None,
) -> subprocess.Popen[str]:
    """`python -m module_args` with `env` added to ours, stdout piped (for the ready line),
    stderr to `log_path` (opened with `mode`: "w" for a first start, "a" for a restart,
    after `header`)."""
    with open(log_path, mode) as log_file:  # the child keeps its own descriptor
        log_file.write(header)
        log_file.flush()
        return subprocess.Popen(
            [sys.executable, "-m", *module_args],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=log_file,
            text=True,
            # Own session: a terminal's Ctrl-C reaches only `tandem up`, which stops the
            # children in order (and a child that got it too would look like a crash).
            start_new_session=True,
            # The child dies with this process (`die_with_supervisor`, at its start: code
            # between fork and exec in a threaded parent, a preexec_fn, can crash the child).
            env={
                **os.environ,
                **(env or {}),
                "PYTHONUNBUFFERED": "1",
                SUPERVISOR_ENV: str(os.getpid()),
            },  # fmt: skip
        )


def free_port(host: str) -> int:
    """A TCP port free on `host` now (the child binds it moments later)."""
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def write_private(path: Path, text: str) -> Path:
    """`text` (a secret) in a file only this user can read."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        os.fchmod(f.fileno(), 0o600)  # a file left by an earlier run keeps its mode otherwise
        f.write(text)
    return path


def read_until(stream: IO[str], marker: str, found: list[str]) -> None:
    for line in stream:
        if marker in line:
            found.append(line.strip())
            return


def wait_for_router(address: str, timeout_s: float = 60.0, api_key: str | None = None) -> None:
    """Until the router answers and at least one decode worker serves a request (sent with
    `api_key`; None: TandemClient's default, $TANDEM_API_KEY)."""
    from tandem.client import TandemClient, TandemError

    deadline = time.monotonic() + timeout_s
    with TandemClient(address, timeout_s=30, api_key=api_key) as client:
        while True:
            try:
                client.generate([5], max_tokens=1)
                return
            except TandemError as exc:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"router at {address} not ready: {exc}") from None
                time.sleep(0.2)


def say(message: str) -> None:
    """A line for the person running `tandem up` (stderr)."""
    print(message, file=sys.stderr, flush=True)
