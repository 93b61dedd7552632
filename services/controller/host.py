"""This host's cores and memory, and its workers' peak memory, for the local actuator's
capacity rule (tandem.control.capacity). Reads /proc and the cgroup files; the parsers are
plain functions of the files' text.

  cgroup     this process's own cgroup (/proc/self/cgroup) and its hierarchy's root; the
             smaller limit of the two wins.
  cores      len(os.sched_getaffinity(0)), capped by a cgroup CPU quota: cgroup v2 cpu.max
             "<quota> <period>" ("max": none), v1 cpu.cfs_quota_us / cpu.cfs_period_us (-1:
             none); floor(quota / period), at least 1.
  available  /proc/meminfo MemAvailable, capped by a cgroup memory limit: v2 memory.max
             ("max": none) less memory.current, v1 memory.limit_in_bytes (a huge number:
             none) less memory.usage_in_bytes; the cgroup's inactive file pages
             (memory.stat inactive_file, v1 total_inactive_file) count as available, as
             the kernel reclaims them before it fails an allocation.
  worker     /proc/<pid>/status VmHWM (the peak RSS; VmRSS where a kernel lacks it).
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable
from pathlib import Path

from tandem.control.capacity import HostCapacity, host_capacity

# cgroup v1 writes "no limit" as the largest page-aligned 64-bit value.
_NO_LIMIT_BYTES = 1 << 62


def parse_kib_field(text: str, key: str) -> int | None:
    """Bytes of a "<key>:  <n> kB" line of /proc/meminfo or /proc/<pid>/status."""
    for line in text.splitlines():
        name, _, rest = line.partition(":")
        if name.strip() == key:
            words = rest.split()
            if words and words[0].isdigit():
                return int(words[0]) * 1024
    return None


def parse_cpu_quota(cpu_max: str | None, quota_us: str | None, period_us: str | None) -> int | None:
    """Whole cores a cgroup CPU quota allows (v2 cpu.max text, or v1 quota and period
    texts); None without a quota."""
    if cpu_max is not None:
        words = cpu_max.split()
        if len(words) != 2 or words[0] == "max":
            return None
        quota, period = float(words[0]), float(words[1])
    elif quota_us is not None and period_us is not None:
        quota, period = float(quota_us), float(period_us)
        if quota < 0:
            return None
    else:
        return None
    if not period > 0:
        return None
    return max(1, math.floor(quota / period))


def parse_stat_field(text: str, key: str) -> int | None:
    """A "<key> <n>" line of a cgroup memory.stat."""
    for line in text.splitlines():
        words = line.split()
        if len(words) == 2 and words[0] == key and words[1].isdigit():
            return int(words[1])
    return None


def cgroup_available(limit: str | None, usage: str | None, inactive_file: int | None) -> int | None:
    """Bytes a cgroup still lets its processes have: limit - usage + inactive file pages;
    None without a limit."""
    if limit is None or usage is None:
        return None
    limit = limit.strip()
    if limit == "max" or not limit.isdigit() or int(limit) >= _NO_LIMIT_BYTES:
        return None
    return max(0, int(limit) - int(usage.strip()) + (inactive_file or 0))


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


def parse_own_cgroups(text: str) -> dict[str, str]:
    """/proc/self/cgroup -> {controller: path}; "" names the cgroup v2 (unified) path."""
    found: dict[str, str] = {}
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        for name in controllers.split(",") if controllers else [""]:
            found[name.removeprefix("name=")] = path
    return found


def _cgroup_dirs(proc: Path, cgroup: Path, controller: str) -> list[Path]:
    """Where a controller's files are for this process: its own cgroup's directory (v2
    unified, then v1 `<controller>/`), and the hierarchy's root (in a container with a
    cgroup namespace, that is its own)."""
    own = parse_own_cgroups(_read(proc / "self" / "cgroup") or "")
    dirs = []
    for root, key in ((cgroup, ""), (cgroup / controller, controller)):
        path = own.get(key, "/").strip("/")
        dirs += [root / path, root] if path else [root]
    return [d for i, d in enumerate(dirs) if d.is_dir() and d not in dirs[:i]]


def host_cores(proc: Path = Path("/proc"), cgroup: Path = Path("/sys/fs/cgroup")) -> int:
    """CPUs this process may run on, capped by its cgroup's CPU quota."""
    cores = len(os.sched_getaffinity(0))
    for d in _cgroup_dirs(proc, cgroup, "cpu"):
        quota = parse_cpu_quota(
            _read(d / "cpu.max"), _read(d / "cpu.cfs_quota_us"), _read(d / "cpu.cfs_period_us")
        )
        if quota is not None:
            cores = min(cores, quota)
    return cores


def mem_available(proc: Path = Path("/proc"), cgroup: Path = Path("/sys/fs/cgroup")) -> int:
    """Bytes available for new processes: MemAvailable, capped by the cgroup's limit."""
    available = parse_kib_field(_read(proc / "meminfo") or "", "MemAvailable") or 0
    files = (
        ("memory.max", "memory.current", "inactive_file"),  # v2
        ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file"),  # v1
    )
    for d in _cgroup_dirs(proc, cgroup, "memory"):
        stat = _read(d / "memory.stat") or ""
        for limit, usage, inactive in files:
            capped = cgroup_available(
                _read(d / limit), _read(d / usage), parse_stat_field(stat, inactive)
            )
            if capped is not None:
                available = min(available, capped)
    return available


def peak_rss(pid: int, proc: Path = Path("/proc")) -> int | None:
    """A process's peak resident memory (VmHWM, else VmRSS); None once it is gone."""
    status = _read(proc / str(pid) / "status")
    if status is None:
        return None
    return parse_kib_field(status, "VmHWM") or parse_kib_field(status, "VmRSS")


class HostMeter:
    """Measures the host for `host_capacity`, remembering the largest worker peak seen (a
    worker that exits takes its figure with it; the next one will need as much).

    `cores` overrides the measured count (tests, or an operator who knows better)."""

    def __init__(
        self,
        cores: int | None = None,
        proc: Path = Path("/proc"),
        cgroup: Path = Path("/sys/fs/cgroup"),
    ) -> None:
        self._cores = cores
        self._proc = proc
        self._cgroup = cgroup
        self.worker_peak_bytes: int | None = None

    def measure(self, worker_pids: Iterable[int]) -> HostCapacity:
        """The capacity with these worker processes running (a pid already gone is not
        counted)."""
        running = 0
        for pid in worker_pids:
            peak = peak_rss(pid, self._proc)
            if peak is None:
                continue
            running += 1
            if (self.worker_peak_bytes or 0) < peak:
                self.worker_peak_bytes = peak
        cores = self._cores if self._cores is not None else host_cores(self._proc, self._cgroup)
        available = mem_available(self._proc, self._cgroup)
        return host_capacity(cores, available, self.worker_peak_bytes, running)
