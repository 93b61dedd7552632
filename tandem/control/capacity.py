"""How many workers one host holds: the limit of the local actuator (`tandem up
--autoscale`, every worker on this machine). Pure: the service measures, this decides.

The rule, two limits and the smaller wins:

  cores   one worker per core. A worker's engine thread computes flat out while it has
          work, so two workers on one core each run at half speed: adding the second
          adds no capacity, only contention (and both miss their latency targets). A
          2-core host holds the starting 1 prefill + 1 decode worker and no more.
  memory  a new worker needs what the largest running worker peaked at (its VmHWM: the
          weights are streamed in at ~1.1x their size, above the steady RSS) times
          RSS_HEADROOM, because a KV cache that is allocated but not yet written is not
          resident until requests fill it. New workers must fit into the memory available
          now (MemAvailable, or less under a cgroup limit) less MEM_RESERVE_BYTES for the
          router, Redis and the page cache. The running workers' own memory is already
          taken out of what is available, so it is not counted again.

  max_workers = min(cores, num_workers + floor((available - reserve) / (peak * headroom)))

No worker measured yet (no peak known): no room to add. The limit never asks for fewer
workers than run: a host that already runs more than it holds (a user's --num-prefill) is
not shrunk, it only gets no more (`room` is 0).

  e.g. 2 cores, 20 GiB available, 1.4 GiB peak, 2 running:
       cores 2; memory 2 + floor((20 - 1) / 1.75) = 12  ->  holds 2, room 0
"""

from __future__ import annotations

import math
from typing import NamedTuple

MEM_RESERVE_BYTES = 1 << 30  # 1 GiB kept free: the router, Redis, the page cache
RSS_HEADROOM = 1.25  # a new worker is planned at 1.25x the largest peak RSS measured


class HostCapacity(NamedTuple):
    """The most workers a host holds, and how that was derived."""

    max_workers: int  # most worker processes (all roles) the host holds
    num_workers: int  # worker processes running now: starting and draining ones included
    why: str

    @property
    def room(self) -> int:
        """Workers that may still be added (0 when the host is full or over)."""
        return max(0, self.max_workers - self.num_workers)


def _gib(num_bytes: float) -> str:
    if num_bytes < 1 << 30:
        return f"{num_bytes / (1 << 20):.0f} MiB"
    return f"{num_bytes / (1 << 30):.1f} GiB"


def host_capacity(
    cores: int,
    mem_available_bytes: int,
    worker_peak_bytes: int | None,
    num_workers: int,
    reserve_bytes: int = MEM_RESERVE_BYTES,
    headroom: float = RSS_HEADROOM,
) -> HostCapacity:
    """The most workers this host holds (module docstring: one per core, and new ones
    within the available memory less the reserve).

    Args:
        cores: CPUs the workers may run on (affinity, capped by a cgroup quota).
        mem_available_bytes: memory available now, with the running workers resident.
        worker_peak_bytes: the largest peak RSS of a running worker; None: none measured.
        num_workers: worker processes running now (starting and draining ones included).

    Raises:
        ValueError: cores < 1, a negative count or size, or headroom < 1.
    """
    if cores < 1:
        raise ValueError(f"cores must be >= 1, got {cores}")
    if num_workers < 0 or mem_available_bytes < 0 or reserve_bytes < 0:
        raise ValueError(
            f"need num_workers, mem_available_bytes, reserve_bytes >= 0, got {num_workers}, "
            f"{mem_available_bytes}, {reserve_bytes}"
        )
    if worker_peak_bytes is not None and worker_peak_bytes <= 0:
        raise ValueError(f"worker_peak_bytes must be > 0 or None, got {worker_peak_bytes}")
    if headroom < 1:
        raise ValueError(f"headroom must be >= 1, got {headroom}")
    by_cores = f"{cores} cores, one worker per core"
    if worker_peak_bytes is None:
        why = f"{by_cores}; no worker's memory measured yet, so none is added"
        return HostCapacity(min(cores, num_workers), num_workers, why)
    per_worker = worker_peak_bytes * headroom
    spare = max(0, mem_available_bytes - reserve_bytes)
    more = math.floor(spare / per_worker)
    max_workers = min(cores, num_workers + more)
    why = (
        f"{by_cores}; {_gib(mem_available_bytes)} available less {_gib(reserve_bytes)} "
        f"reserve fits {more} more of {_gib(per_worker)} ({_gib(worker_peak_bytes)} peak "
        f"RSS x {headroom:g})"
    )
    return HostCapacity(max_workers, num_workers, why)


def describe(capacity: HostCapacity) -> str:
    """One line for logs and `tandem ctl status`."""
    room = f"room for {capacity.room} more" if capacity.room else "no room to add"
    return (
        f"host holds {capacity.max_workers} workers, {capacity.num_workers} running, {room} "
        f"({capacity.why})"
    )
