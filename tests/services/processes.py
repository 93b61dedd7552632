"""Service processes for tests that read their logs: `python -m <module>` with stderr to a
file, started once its READY line names the bound address."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path


def spawn_logged(module: str, log: Path, *args: str) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", module, *args],
        stdout=subprocess.PIPE,
        stderr=log.open("w"),
        text=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()
    assert line.startswith("READY"), f"{module} failed to start: {log.read_text()[-2000:]}"
    return proc, line.split()[-1]
