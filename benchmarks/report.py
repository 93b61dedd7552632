"""What every benchmark script shares for its report: where results go, the machine a run was
on, the results JSON (written atomically), its section of BENCHMARKS.md, the linear-interpolation
percentile and the pass / FAIL word of a target.

The scripts run as `python benchmarks/<script>.py`, with this folder first on `sys.path`, so
they import it as `report`.
"""

from __future__ import annotations

import json
import math
import os
import platform
import re
import subprocess
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = REPO_ROOT / "benchmarks" / "results"
BENCHMARKS_MD = REPO_ROOT / "BENCHMARKS.md"


# -- where results go ----------------------------------------------------------------------


def result_path(results_dir: Path, name: str, suffix: str = "", ext: str = "json") -> Path:
    """`<results_dir>/<name><suffix>.<ext>`, e.g. `results/serving-quick.json`."""
    return Path(results_dir) / f"{name}{suffix}.{ext}"


def is_default_results_dir(results_dir: Path | str) -> bool:
    """Whether `results_dir` is benchmarks/results: only a run into it may rewrite its section
    of BENCHMARKS.md."""
    return Path(results_dir).resolve() == RESULTS_DIR


# -- the machine ---------------------------------------------------------------------------


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def _git_commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return ""


def machine_info(**extra: Any) -> dict[str, Any]:
    """Date, CPU, Python, platform, load average (the machine is shared: it says how much
    others were running) and git commit, plus a script's own `extra` fields."""
    return {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "cpu_count": os.cpu_count(),
        "cpu_model": _cpu_model(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "loadavg_1_5_15": list(os.getloadavg()),
        "git_commit": _git_commit(),
        **extra,
    }


def machine_summary(m: dict[str, Any], shared: bool = True) -> str:
    """One line for a report from a `machine_info()` dict: CPU, load, commit, date."""
    return (
        f"{m.get('cpu_model', '?')}, {m.get('cpu_count', '?')} CPUs, "
        f"{'shared, ' if shared else ''}load {m.get('loadavg_1_5_15', [0.0])[0]:.1f}; "
        f"commit {m.get('git_commit', '?')}, {m.get('date', '?')}"
    )


# -- writing -------------------------------------------------------------------------------


def median_ms(fn: Callable[[], object], reps: int) -> float:
    """`fn`'s median wall time in ms over `reps` calls after one untimed call (the upper of
    the two middle times for an even `reps`)."""
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2] * 1e3


def pyplot() -> Any | None:
    """matplotlib.pyplot on the Agg backend (no display on servers and CI); None without
    matplotlib (a benchmark then writes no plot and says so)."""
    try:
        import matplotlib
    except ImportError:
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def write_text(path: Path, text: str) -> None:
    """Write-then-rename, creating the parent folder: an interrupted run never leaves half a
    file behind (for a plot, or for the next run to read)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_json(path: Path, data: Any, *, indent: int) -> None:
    """`data` as JSON (`indent` as the script always wrote it) plus a newline, atomically."""
    write_text(path, json.dumps(data, indent=indent) + "\n")


def _heading(text: str, title: str) -> re.Match[str] | None:
    """The line of `text` that is the heading `title` (trailing blanks allowed)."""
    return re.search(rf"^{re.escape(title)}[ \t]*$", text, re.MULTILINE)


def write_markdown_section(path: Path, section: str, body: str, before: str | None = None) -> None:
    """Replace the section titled `section` (its heading line up to the next `## ` heading)
    in the markdown file at `path` by `body`, which starts with that heading, leaving every
    other section as it is. A section not there yet goes in front of the section titled
    `before` when that one is there, else at the end."""
    path = Path(path)
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    body = body.rstrip("\n") + "\n"
    found = _heading(text, section)
    if found is None:
        anchor = _heading(text, before) if before else None
        if anchor is None:
            new = text.rstrip("\n") + "\n\n" + body
        else:
            new = text[: anchor.start()] + body + "\n" + text[anchor.start() :]
    else:
        nxt = text.find("\n## ", found.end())
        tail = text[nxt + 1 :] if nxt >= 0 else ""
        new = text[: found.start()] + body + ("\n" + tail if tail else "")
    write_text(path, new)


# -- figures -------------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float:
    """The `q`-th percentile (0-100), by linear interpolation between closest ranks (numpy's
    default); nan when empty."""
    if not values:
        return math.nan
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def verdict(passed: bool | None, ok: str = "pass", fail: str = "FAIL", unknown: str = "n/a") -> str:
    """The word for a target's outcome: `ok`, `fail`, or `unknown` when not judged (None)."""
    if passed is None:
        return unknown
    return ok if passed else fail
