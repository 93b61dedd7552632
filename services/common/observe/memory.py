"""A worker's memory as metrics: its resident set, what the C allocator holds, and the size of
every structure that grows with traffic against its bound (`tandem.engine.footprint`).

    tandem_worker_resident_memory_bytes{role}       VmRSS of this process
    tandem_worker_heap_bytes{role, state}           glibc's malloc: in_use, and free (held by
                                                    the allocator, not returned to the OS:
                                                    fragmentation shows here first)
    tandem_worker_state_entries{role, structure}    entries now
    tandem_worker_state_bound{role, structure}      a bounded cache's bound (per-request
                                                    structures have none: 0 when idle)

Read at scrape time, never on the engine's step path.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Callable, Iterator
from typing import NamedTuple

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from tandem.engine.footprint import StateSize

_PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")


class HeapStats(NamedTuple):
    in_use_bytes: int
    free_bytes: int


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd",
            "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost",
        )
    ]  # fmt: skip


def _glibc_mallinfo2() -> Callable[[], _MallInfo2] | None:
    # The C library this process already runs (dlopen(NULL)): no search, no subprocess.
    fn = getattr(ctypes.CDLL(None), "mallinfo2", None)  # None: not glibc, or before 2.33
    if fn is None:
        return None
    fn.restype = _MallInfo2
    fn.argtypes = []
    return fn


_MALLINFO2 = _glibc_mallinfo2()


def resident_bytes() -> int:
    """Resident set size of this process, from /proc; 0 where unreadable."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * _PAGE_BYTES
    except (OSError, ValueError, IndexError):
        return 0


def heap_stats() -> HeapStats | None:
    """glibc malloc's bytes in use (small chunks and mmapped ones) and free (held in its
    arenas); None with another C library."""
    if _MALLINFO2 is None:
        return None
    info = _MALLINFO2()
    return HeapStats(info.uordblks + info.hblkhd, info.fordblks)


class MemoryCollector(Collector):
    """The gauges of the module docstring for one worker; `footprint` names its structures."""

    def __init__(self, role: str, footprint: Callable[[], dict[str, StateSize]]) -> None:
        self.role = role
        self._footprint = footprint

    def describe(self) -> Iterator[Metric]:
        return iter(self._families())

    def collect(self) -> Iterator[Metric]:
        return iter(self._families(self._footprint(), resident_bytes(), heap_stats()))

    def _families(
        self,
        sizes: dict[str, StateSize] | None = None,
        rss: int = 0,
        heap: HeapStats | None = None,
    ) -> list[Metric]:
        role = [self.role]
        resident = GaugeMetricFamily(
            "tandem_worker_resident_memory_bytes", "Resident memory of the worker process.",
            labels=["role"],
        )  # fmt: skip
        heap_bytes = GaugeMetricFamily(
            "tandem_worker_heap_bytes",
            "C allocator (glibc malloc) bytes in use, and free but held by the process.",
            labels=["role", "state"],
        )
        entries = GaugeMetricFamily(
            "tandem_worker_state_entries",
            "Entries of a structure that grows with traffic (per-request ones are 0 when idle).",
            labels=["role", "structure"],
        )
        bounds = GaugeMetricFamily(
            "tandem_worker_state_bound", "Most entries a bounded structure may hold.",
            labels=["role", "structure"],
        )  # fmt: skip
        if sizes is not None:
            resident.add_metric(role, rss)
            if heap is not None:
                heap_bytes.add_metric([self.role, "in_use"], heap.in_use_bytes)
                heap_bytes.add_metric([self.role, "free"], heap.free_bytes)
            for name, size in sorted(sizes.items()):
                entries.add_metric([self.role, name], size.entries)
                if size.bound is not None:
                    bounds.add_metric([self.role, name], size.bound)
        return [resident, heap_bytes, entries, bounds]
