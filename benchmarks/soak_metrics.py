"""What the soak reads from a running `tandem up` cluster: Prometheus /metrics of the router
and every worker (`Cluster.metrics_addresses`), and the resident memory of every child process
(psutil if installed, else /proc/<pid>/status VmRSS), summed over the child and its own
children (Redis's wrapper runs the server as a child).

A metric family that a process does not export reads as absent (`Scrape.has`), never as 0:
the soak prints "not available" for it. Shared by `benchmarks/bench_soak.py` and
`tests/services/test_soak.py`.
"""

from __future__ import annotations

import math
import os
import time
import urllib.request
from collections.abc import Iterable
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prometheus_client.parser import text_string_to_metric_families

if TYPE_CHECKING:
    from tandem.services.up import Cluster

KV_USED = "tandem_worker_kv_blocks_used"
KV_CAPACITY = "tandem_worker_kv_blocks_capacity"
ROLES = ("prefill", "decode")

try:  # optional: /proc is read otherwise
    import psutil
except ImportError:  # pragma: no cover - depends on the environment
    psutil = None

RSS_SOURCE = "psutil" if psutil is not None else "/proc/<pid>/status VmRSS"

Labels = tuple[tuple[str, str], ...]


@dataclass(frozen=True, slots=True)
class Scrape:
    """One read of a /metrics page: family names (as the parser names them: a counter
    without `_total`) and every sample (name with its suffix, labels, value)."""

    families: frozenset[str] = frozenset()
    samples: tuple[tuple[str, Labels, float], ...] = ()

    @staticmethod
    def parse(text: str) -> Scrape:
        families, samples = set(), []
        for family in text_string_to_metric_families(text):
            families.add(family.name)
            for s in family.samples:
                samples.append((s.name, tuple(sorted(s.labels.items())), float(s.value)))
        return Scrape(frozenset(families), tuple(samples))

    def has(self, name: str) -> bool:
        """Whether the family of the metric `name` (a sample or family name) is exported."""
        base = name.removesuffix("_total")
        for suffix in ("_bucket", "_count", "_sum"):
            base = base.removesuffix(suffix)
        return name in self.families or base in self.families

    def select(self, name: str, **labels: str) -> Iterable[tuple[dict[str, str], float]]:
        for sample, sample_labels, value in self.samples:
            if sample != name:
                continue
            d = dict(sample_labels)
            if all(d.get(k) == v for k, v in labels.items()):
                yield d, value

    def total(self, name: str, **labels: str) -> float:
        """Sum of the samples `name` whose labels include `labels`."""
        return sum(v for _, v in self.select(name, **labels))

    def by_label(self, name: str, label: str, **labels: str) -> dict[str, float]:
        """Sum of the samples `name` per value of `label`."""
        out: dict[str, float] = {}
        for d, v in self.select(name, **labels):
            key = d.get(label, "")
            out[key] = out.get(key, 0.0) + v
        return out

    def buckets(self, histogram: str, **labels: str) -> list[tuple[float, float]]:
        """(upper bound, cumulative count) of a histogram, summed over the label sets that
        include `labels`, by bound ascending (+Inf last)."""
        acc: dict[float, float] = {}
        for d, v in self.select(histogram + "_bucket", **labels):
            le = float(d["le"])
            acc[le] = acc.get(le, 0.0) + v
        return sorted(acc.items())


def scrape(address: str, timeout_s: float = 5.0) -> Scrape | None:
    """GET http://address/metrics; None when it cannot be read (a process restarting)."""
    try:
        with urllib.request.urlopen(f"http://{address}/metrics", timeout=timeout_s) as response:
            return Scrape.parse(response.read().decode())
    except OSError:
        return None


def diff_buckets(
    end: list[tuple[float, float]], start: list[tuple[float, float]]
) -> list[tuple[float, float]]:
    """Bucket counts observed between two scrapes of one process (start may be empty)."""
    before = dict(start)
    return [(le, count - before.get(le, 0.0)) for le, count in end]


def bucket_quantile(buckets: list[tuple[float, float]], q: float) -> float | None:
    """The smallest bucket bound holding at least fraction `q` of the observations (inf when
    only +Inf does); None without observations."""
    if not buckets or buckets[-1][1] <= 0:
        return None
    need = q * buckets[-1][1]
    for le, count in buckets:
        if count >= need:
            return le
    return math.inf


# -- resident memory -----------------------------------------------------------------------


def rss_bytes(pid: int) -> int | None:
    """Resident memory of one process; None once it is gone."""
    if psutil is not None:
        try:
            return int(psutil.Process(pid).memory_info().rss)
        except psutil.Error:
            return None
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None  # a zombie has no VmRSS


def _parents() -> dict[int, int]:
    """pid -> parent pid of every process (from /proc)."""
    out = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            out[int(entry)] = int(stat.rsplit(")", 1)[1].split()[1])
    return out


def tree_rss_bytes(pids: dict[str, int]) -> dict[str, int]:
    """name -> RSS of that process plus its descendants, for the processes alive."""
    parents = _parents()
    children: dict[int, list[int]] = {}
    for pid, ppid in parents.items():
        children.setdefault(ppid, []).append(pid)
    out = {}
    for name, root in pids.items():
        total, alive, todo = 0, False, [root]
        while todo:
            pid = todo.pop()
            rss = rss_bytes(pid)
            if rss is not None:
                total += rss
                alive = alive or pid == root
            todo.extend(children.get(pid, ()))
        if alive:
            out[name] = total
    return out


def worker_lease_ttl_s() -> float:
    """The workers' lease_ttl_s: `tandem up` passes none, so their config's default."""
    from tandem.services.common.worker.config import WorkerConfig

    default = next(f.default for f in fields(WorkerConfig) if f.name == "lease_ttl_s")
    return float(default)  # type: ignore[arg-type]


# -- one look at the cluster ------------------------------------------------------------------


@dataclass(slots=True)
class Sample:
    """The cluster at `t_s` (seconds from the run's start). Workers by child name."""

    t_s: float
    kv_blocks_used: dict[str, float] = field(default_factory=dict)
    kv_blocks_capacity: dict[str, float] = field(default_factory=dict)
    workers: dict[str, int] = field(default_factory=dict)  # role -> running (tandem up's view)
    rss_bytes: dict[str, int] = field(default_factory=dict)  # child name -> bytes
    pids: dict[str, int] = field(default_factory=dict)
    unreadable: list[str] = field(default_factory=list)  # /metrics that did not answer
    # worker -> {structure: entries} (tandem_worker_state_entries) and {in_use, free} heap
    # bytes (tandem_worker_heap_bytes), where the worker exports them (issue 38)
    state_entries: dict[str, dict[str, float]] = field(default_factory=dict)
    heap_bytes: dict[str, dict[str, float]] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "t_s": round(self.t_s, 3),
            "kv_blocks_used": self.kv_blocks_used,
            "kv_blocks_capacity": self.kv_blocks_capacity,
            "workers": self.workers,
            "rss_bytes": self.rss_bytes,
            "pids": self.pids,
            "unreadable": self.unreadable,
            "state_entries": self.state_entries,
            "heap_bytes": self.heap_bytes,
        }


def is_worker(name: str) -> bool:
    return name.split("-", 1)[0] in ROLES


def child_pids(cluster: Cluster) -> dict[str, int]:
    """Child name -> pid of `tandem up`'s processes (redis, router, workers) now."""
    return {c.name: c.proc.pid for c in list(cluster.children) if c.proc.poll() is None}


def sample_cluster(cluster: Cluster, t_s: float) -> Sample:
    """KV blocks of every worker (its /metrics), workers per role, RSS of every child."""
    s = Sample(t_s, workers={role: cluster.count(role) for role in ROLES})
    for name, address in sorted(cluster.metrics_addresses.items()):
        if not is_worker(name):
            continue
        page = scrape(address)
        if page is None or not page.has(KV_USED):
            s.unreadable.append(name)
            continue
        s.kv_blocks_used[name] = page.total(KV_USED)
        s.kv_blocks_capacity[name] = page.total(KV_CAPACITY)
        entries = {lb["structure"]: v for lb, v in page.select("tandem_worker_state_entries")}
        if entries:
            s.state_entries[name] = entries
        heap = {lb["state"]: v for lb, v in page.select("tandem_worker_heap_bytes")}
        if heap:
            s.heap_bytes[name] = heap
    s.pids = child_pids(cluster)
    s.rss_bytes = tree_rss_bytes(s.pids)
    return s


def scrape_all(cluster: Cluster) -> dict[str, Scrape]:
    """Child name ("router", "prefill-0", ...) -> its /metrics now (those that answered)."""
    out = {}
    for name, address in sorted(cluster.metrics_addresses.items()):
        page = scrape(address)
        if page is not None:
            out[name] = page
    return out


def wait_kv_free(
    cluster: Cluster, timeout_s: float, t0: float, poll_s: float = 0.5
) -> tuple[float | None, list[Sample]]:
    """Poll until every worker reports 0 KV blocks in use (and every worker's /metrics
    answered), at most `timeout_s`. Returns (seconds it took, or None if it did not happen;
    the samples taken, `t_s` measured from `t0` on time.monotonic())."""
    start = time.monotonic()
    samples = []
    while True:
        s = sample_cluster(cluster, time.monotonic() - t0)
        samples.append(s)
        waited = time.monotonic() - start
        if s.kv_blocks_used and not s.unreadable and not any(s.kv_blocks_used.values()):
            return waited, samples
        if waited >= timeout_s:
            return None, samples
        time.sleep(poll_s)
