"""services/common/runtime/supervised.py: a child of `tandem up` dies with its supervisor,
set up by the child itself (no code between fork and exec)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time

import pytest

from tandem.services.common.runtime.supervised import SUPERVISOR_ENV

CHILD = (
    "from tandem.services.common.runtime.supervised import die_with_supervisor; "
    "die_with_supervisor(); print('ready', flush=True); import time; time.sleep(60)"
)


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie (dead, not yet reaped) counts as gone
        return f.read().split(")")[-1].split()[0] != "Z"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_supervised_child_dies_when_its_supervisor_is_killed() -> None:
    supervisor = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(f"""
            import os, subprocess, sys, time
            env = {{**os.environ, {SUPERVISOR_ENV!r}: str(os.getpid())}}
            child = subprocess.Popen([sys.executable, "-c", {CHILD!r}], env=env,
                                     stdout=subprocess.PIPE, text=True)
            child.stdout.readline()
            print(child.pid, flush=True)
            time.sleep(60)
        """)],
        stdout=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    assert supervisor.stdout is not None
    child = int(supervisor.stdout.readline())
    assert alive(child)
    supervisor.kill()
    supervisor.wait()
    deadline = time.monotonic() + 10
    while alive(child):
        assert time.monotonic() < deadline, "the child outlived its SIGKILLed supervisor"
        time.sleep(0.05)


def test_a_child_whose_supervisor_is_already_gone_exits() -> None:
    env = {**os.environ, SUPERVISOR_ENV: "1"}  # not its parent: it died and was reparented
    run = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, timeout=60)
    assert run.returncode == 1 and b"ready" not in run.stdout
    plain = subprocess.run(  # without the variable: not supervised, nothing happens
        [sys.executable, "-c", CHILD.replace("time.sleep(60)", "pass")],
        env={k: v for k, v in os.environ.items() if k != SUPERVISOR_ENV},
        capture_output=True,
        timeout=60,
    )
    assert plain.returncode == 0 and b"ready" in plain.stdout
