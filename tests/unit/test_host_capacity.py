"""How many workers a host holds: the pure rule (tandem.control.capacity) with exact counts,
and the measuring side (services/controller/host.py) on /proc and cgroup trees written here."""

from __future__ import annotations

from pathlib import Path

import pytest

from tandem.control.capacity import (
    MEM_RESERVE_BYTES,
    RSS_HEADROOM,
    HostCapacity,
    describe,
    host_capacity,
)
from tandem.services.controller.host import (
    HostMeter,
    cgroup_available,
    host_cores,
    mem_available,
    parse_cpu_quota,
    parse_kib_field,
    parse_own_cgroups,
    peak_rss,
)

GIB = 1 << 30
MIB = 1 << 20


@pytest.mark.parametrize(
    ("cores", "available", "peak", "running", "max_workers", "room"),
    [
        # The box: 2 cores, plenty of memory, 1 prefill + 1 decode running.
        (2, 20 * GIB, 1400 * MIB, 2, 2, 0),
        # A free core: one more.
        (3, 20 * GIB, 1400 * MIB, 2, 3, 1),
        # Memory binds: (4 GiB - 1 GiB reserve) / (1 GiB * 1.25) = 2.4 -> 2 more.
        (16, 4 * GIB, GIB, 2, 4, 2),
        # Exactly two new workers' worth after the reserve: both fit.
        (16, MEM_RESERVE_BYTES + int(2 * GIB * RSS_HEADROOM), GIB, 1, 3, 2),
        # Less than the reserve available: none.
        (16, GIB // 2, GIB, 2, 2, 0),
        # Already more than one per core: not shrunk, no room.
        (2, 20 * GIB, GIB, 4, 2, 0),
        # No worker measured yet: nothing added.
        (8, 20 * GIB, None, 2, 2, 0),
        (8, 20 * GIB, None, 0, 0, 0),
    ],
)
def test_host_capacity_counts(
    cores: int, available: int, peak: int | None, running: int, max_workers: int, room: int
) -> None:
    capacity = host_capacity(cores, available, peak, running)
    assert (capacity.max_workers, capacity.num_workers, capacity.room) == (
        max_workers,
        running,
        room,
    )


def test_host_capacity_says_how() -> None:
    capacity = host_capacity(2, 20 * GIB, 1400 * MIB, 2)
    assert capacity.why == (
        "2 cores, one worker per core; 20.0 GiB available less 1.0 GiB reserve fits 11 more "
        "of 1.7 GiB (1.4 GiB peak RSS x 1.25)"
    )
    assert describe(capacity) == f"host holds 2 workers, 2 running, no room to add ({capacity.why})"
    unknown = host_capacity(4, GIB, None, 1)
    assert (
        unknown.why
        == "4 cores, one worker per core; no worker's memory measured yet, so none is added"
    )
    assert (
        describe(HostCapacity(3, 1, "x")) == "host holds 3 workers, 1 running, room for 2 more (x)"
    )


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((0, GIB, GIB, 1), "cores must be >= 1"),
        ((2, GIB, GIB, -1), "need num_workers"),
        ((2, -1, GIB, 1), "need num_workers"),
        ((2, GIB, 0, 1), "worker_peak_bytes must be > 0"),
    ],
)
def test_host_capacity_rejects_nonsense(args: tuple[int, int, int, int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        host_capacity(*args)
    with pytest.raises(ValueError, match="headroom"):
        host_capacity(2, GIB, GIB, 1, headroom=0.5)


# -- measuring --------------------------------------------------------------------------------

MEMINFO = "MemTotal:       24576000 kB\nMemFree:         1000000 kB\nMemAvailable:   20971520 kB\n"


def test_parsers() -> None:
    assert parse_kib_field(MEMINFO, "MemAvailable") == 20 * GIB
    assert parse_kib_field(MEMINFO, "Missing") is None
    assert parse_kib_field("VmHWM:\t 1433600 kB\nVmRSS:\t 1000 kB\n", "VmHWM") == 1400 * MIB
    assert parse_cpu_quota("max 100000\n", None, None) is None
    assert parse_cpu_quota("250000 100000\n", None, None) == 2
    assert parse_cpu_quota("50000 100000", None, None) == 1  # half a core: still one worker
    assert parse_cpu_quota(None, "-1\n", "100000\n") is None
    assert parse_cpu_quota(None, "300000\n", "100000\n") == 3
    assert parse_cpu_quota(None, None, None) is None
    assert cgroup_available("max\n", "123", None) is None
    assert cgroup_available("9223372036854771712\n", "123", None) is None  # v1: no limit
    assert cgroup_available(str(8 * GIB), str(6 * GIB), GIB) == 3 * GIB
    assert cgroup_available(str(GIB), str(2 * GIB), None) == 0
    assert parse_own_cgroups("4:memory:/a/b\n2:cpu,cpuacct:/\n0::/c\n1:name=systemd:/\n") == {
        "memory": "/a/b",
        "cpu": "/",
        "cpuacct": "/",
        "": "/c",
        "systemd": "/",
    }


def _write(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_cgroup_v2_limits_cap_cores_and_memory(tmp_path: Path) -> None:
    proc, cgroup = tmp_path / "proc", tmp_path / "cgroup"
    _write(proc, {"meminfo": MEMINFO, "self/cgroup": "0::/job\n"})
    _write(cgroup, {
        "job/cpu.max": "100000 100000\n",
        "job/memory.max": f"{6 * GIB}\n",
        "job/memory.current": f"{4 * GIB}\n",
        "job/memory.stat": f"anon 1\ninactive_file {GIB}\n",
    })  # fmt: skip
    assert host_cores(proc, cgroup) == 1
    assert mem_available(proc, cgroup) == 3 * GIB  # 6 - 4 + 1 inactive, under MemAvailable


def test_cgroup_v1_limits_of_the_own_cgroup(tmp_path: Path) -> None:
    proc, cgroup = tmp_path / "proc", tmp_path / "cgroup"
    _write(proc, {"meminfo": MEMINFO, "self/cgroup": "4:memory:/job\n1:cpu:/\n"})
    _write(cgroup, {
        "memory/memory.limit_in_bytes": "9223372036854771712\n",  # the root: none
        "memory/memory.usage_in_bytes": f"{GIB}\n",
        "memory/job/memory.limit_in_bytes": f"{10 * GIB}\n",
        "memory/job/memory.usage_in_bytes": f"{9 * GIB}\n",
        "memory/job/memory.stat": "total_inactive_file 0\n",
        "cpu/cpu.cfs_quota_us": "-1\n",
        "cpu/cpu.cfs_period_us": "100000\n",
    })  # fmt: skip
    assert mem_available(proc, cgroup) == GIB
    assert host_cores(proc, cgroup) >= 1  # no quota: the affinity mask


def test_no_cgroup_files_leave_meminfo(tmp_path: Path) -> None:
    proc = tmp_path / "proc"
    _write(proc, {"meminfo": MEMINFO})
    assert mem_available(proc, tmp_path / "none") == 20 * GIB


def test_meter_keeps_the_largest_worker_peak(tmp_path: Path) -> None:
    proc = tmp_path / "proc"
    _write(proc, {
        "meminfo": MEMINFO,
        "11/status": "Name:\tpython\nVmHWM:\t 1048576 kB\nVmRSS:\t 900000 kB\n",
        "12/status": "Name:\tpython\nVmRSS:\t 2097152 kB\n",  # no VmHWM: its RSS
    })  # fmt: skip
    assert peak_rss(11, proc) == GIB and peak_rss(12, proc) == 2 * GIB
    assert peak_rss(13, proc) is None  # gone
    meter = HostMeter(cores=4, proc=proc, cgroup=tmp_path / "none")
    # (20 GiB - 1 GiB) / (2 GiB * 1.25) = 7.6: 7 more, but 4 cores; pid 13 is not counted.
    assert meter.measure([11, 12, 13]) == host_capacity(4, 20 * GIB, 2 * GIB, 2)
    (proc / "12" / "status").unlink()  # the big one exits: its peak is remembered
    assert meter.measure([11]).why == host_capacity(4, 20 * GIB, 2 * GIB, 1).why
    assert meter.worker_peak_bytes == 2 * GIB
