"""The soak's verdict (issue 26): what one `bench_soak.py` run measured (`Run`), the router's
and workers' metrics over it (differences of the scrapes before and after the traffic), and the
pass/fail checks of the issue's "Done when". A metric family the build does not export gives
None ("not available"), never a pass or a fail."""

from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # siblings import by name
from soak_load import OK_OUTCOMES, Record
from soak_memory import WINDOWS, TroughTrend, trough_trend
from soak_metrics import Sample, Scrape, bucket_quantile, diff_buckets, is_worker

from tandem.types import Role

DRAIN_MARGIN_S = 2.0  # on top of lease_ttl_s: a poll interval and a scrape
ABORT_P99_MAX_S = 0.1
RSS_GROWTH_MAX = 0.02  # issue 38: growth of the RSS troughs' trend after warm-up
REFUSAL_P99_MAX_S = 1.0  # this benchmark's reading of "refused at once"


@dataclass(frozen=True, slots=True)
class Check:
    """One pass/fail line. passed None: not available (a metric this build does not export)."""

    name: str
    passed: bool | None
    measured: str
    target: str


@dataclass(slots=True)
class Run:
    """What one soak measured."""

    records: list[Record]
    samples: list[Sample]
    traffic_end_s: float
    drain_s: float | None  # traffic end -> every worker at 0 KV blocks; None: not within
    drain_timeout_s: float
    start: dict[str, Scrape]  # /metrics per child, just before the traffic
    end: dict[str, Scrape]  # ... after the drain and the README question
    readme: Record
    router_log: dict[str, int]
    decisions: list[dict[str, Any]] | None = None  # with autoscale: `tandem ctl explain`


# -- what the metrics say -------------------------------------------------------------------


def _counter_diff(run: Run, child: str, name: str, label: str) -> dict[str, float] | None:
    """Per value of `label`, how much counter `name` of `child` rose during the run; None when
    the child does not export it."""
    end = run.end.get(child)
    if end is None or not end.has(name):
        return None
    before = run.start.get(child, Scrape()).by_label(name, label)
    return {k: v - before.get(k, 0.0) for k, v in end.by_label(name, label).items()}


def _histogram(run: Run, child: str, name: str, **labels: str) -> dict[str, Any] | None:
    end = run.end.get(child)
    if end is None or not end.has(name):
        return None
    start = run.start.get(child, Scrape())
    buckets = diff_buckets(end.buckets(name, **labels), start.buckets(name, **labels))
    count = buckets[-1][1] if buckets else 0.0
    return {
        "count": count,
        "p50_bound_s": bucket_quantile(buckets, 0.5),
        "p99_bound_s": bucket_quantile(buckets, 0.99),
    }


def _workers_total(run: Run, name: str) -> dict[str, float] | None:
    """Per worker, how much counter `name` rose (None: no worker exports it)."""
    out = {}
    for child, page in run.end.items():
        if is_worker(child) and page.has(name):
            out[child] = page.total(name) - run.start.get(child, Scrape()).total(name)
    return out or None


def metrics_summary(run: Run) -> dict[str, Any]:
    """The router's and workers' issue-26 metrics over the run (None: not available)."""
    roles = {"prefill": {"role": "prefill"}, "decode": {"role": "decode"}, "all": {}}
    abort_hist = "tandem_router_worker_abort_seconds"
    return {
        "ejections_by_reason": _counter_diff(
            run, "router", "tandem_router_ejections_total", "reason"
        ),
        "worker_aborts_by_outcome": _counter_diff(
            run, "router", "tandem_router_worker_aborts_total", "outcome"
        ),
        "abort_round_trip": {
            k: _histogram(run, "router", abort_hist, **v) for k, v in roles.items()
        },
        "admission_refusals_by_reason": _counter_diff(
            run, "router", "tandem_router_admission_refusals_total", "reason"
        ),
        "queue_delay_estimate": _histogram(
            run, "router", "tandem_router_queue_delay_estimate_seconds"
        ),
        "queue_delay_actual": _histogram(run, "router", "tandem_router_queue_delay_seconds"),
        "router_requests_by_outcome": _counter_diff(
            run, "router", "tandem_router_requests_total", "outcome"
        ),
        "worker_aborts": _workers_total(run, "tandem_worker_aborts_total"),
        "worker_kv_blocks_reaped": _workers_total(run, "tandem_worker_kv_blocks_reaped_total"),
        "worker_kv_audit_violations": _workers_total(
            run, "tandem_worker_kv_audit_violations_total"
        ),
        "controller_decisions": _counter_diff(
            run, "controller", "tandem_controller_decisions_total", "role"
        ),
    }


# -- the checks -------------------------------------------------------------------------------


def _failures(records: list[Record]) -> str:
    counts: dict[str, int] = {}
    for r in records:
        counts[f"{r.kind} {r.outcome}"] = counts.get(f"{r.kind} {r.outcome}", 0) + 1
    return ", ".join(f"{k} x{v}" for k, v in sorted(counts.items()))


def quantile(values: list[float], q: float) -> float:
    if not values:
        return math.nan
    xs = sorted(values)
    return xs[min(len(xs) - 1, max(0, math.ceil(q * len(xs)) - 1))]


def checks(run: Run, m: dict[str, Any], setup: dict[str, Any]) -> list[Check]:
    """The checks of one run; `setup`: the run's setup as in the results (overload,
    autoscale, warmup_s, real_model, max_queue_delay_s, worker counts)."""
    out = []
    valid = [r for r in run.records if r.valid]
    invalid = [r for r in run.records if not r.valid]
    refused = [r for r in valid if r.status == 429]
    if setup["overload"]:  # refusals are the point; what was admitted must complete
        admitted = [r for r in valid if r.status != 429]
        bad = [r for r in admitted if r.outcome not in OK_OUTCOMES]
        out.append(
            Check(
                "admitted requests completed",
                not bad and bool(admitted),
                f"{len(admitted) - len(bad)} of {len(admitted)}"
                + (f"; {_failures(bad)}" if bad else ""),
                "all",
            )
        )
    else:
        bad = [r for r in valid if r.outcome not in OK_OUTCOMES]
        out.append(
            Check(
                "valid requests completed or ended by own disconnect",
                not bad,
                f"{len(valid) - len(bad)} of {len(valid)}" + (f"; {_failures(bad)}" if bad else ""),
                "all (no 5xx, no 429)",
            )
        )
    bad = [r for r in invalid if not r.ok]
    out.append(
        Check(
            "invalid requests refused with 4xx",
            not bad and bool(invalid),
            f"{len(invalid) - len(bad)} of {len(invalid)}" + (f"; {_failures(bad)}" if bad else ""),
            "all",
        )
    )
    ejections = m["ejections_by_reason"]
    out.append(
        Check(
            "no worker left rotation (router metric)",
            None if ejections is None else not any(ejections.values()),
            "not available"
            if ejections is None
            else (", ".join(f"{k} {v:.0f}" for k, v in ejections.items() if v) or "0"),
            "0 ejections",
        )
    )
    lg = run.router_log
    out.append(
        Check(
            "router log: no worker out of rotation, no failed hop",
            lg["out_of_rotation"] == 0 and lg["hop_failed"] == 0,
            f"out of rotation {lg['out_of_rotation']}, failed hops {lg['hop_failed']} (abort "
            f"failures {lg['abort_failed']}, other 'failed' warnings "
            f"{lg['other_failed_warnings']})",
            "0 and 0",
        )
    )
    p99 = (m["abort_round_trip"]["all"] or {}).get("p99_bound_s")
    hist = m["abort_round_trip"]["all"]
    out.append(
        Check(
            "abort round trip p99 < 100 ms",
            None if hist is None or p99 is None else p99 <= ABORT_P99_MAX_S,
            "not available"
            if hist is None
            else (
                "no aborts"
                if p99 is None
                else f"<= {p99 * 1e3:g} ms ({hist['count']:.0f} aborts; aborts by outcome "
                f"{m['worker_aborts_by_outcome']})"
            ),
            "p99 bucket bound <= 100 ms",
        )
    )
    last = run.samples[-1] if run.samples else None
    left = {k: v for k, v in (last.kv_blocks_used if last else {}).items() if v}
    out.append(
        Check(
            "every worker at 0 KV blocks within lease_ttl_s",
            run.drain_s is not None,
            f"after {run.drain_s:.1f} s"
            if run.drain_s is not None
            else f"not within {run.drain_timeout_s:g} s: still used {left}"
            + (f", unreadable {last.unreadable}" if last and last.unreadable else ""),
            f"<= lease_ttl_s + {DRAIN_MARGIN_S:g} s = {run.drain_timeout_s:g} s",
        )
    )
    out.append(_rss_check(run, setup["warmup_s"]))
    audits = m["worker_kv_audit_violations"]
    out.append(
        Check(
            "KV audit violations",
            None if audits is None else not any(audits.values()),
            "not available" if audits is None else str({k: int(v) for k, v in audits.items()}),
            "0 on every worker",
        )
    )
    readme = run.readme
    text = readme.text.strip().replace("\n", " ")[:80]
    if readme.outcome != "completed":
        out.append(
            Check(
                "README question answered",
                False,
                f"{readme.outcome} {readme.detail}",
                "completed, 'Paris'",
            )
        )
    elif setup["real_model"]:
        out.append(
            Check(
                "README question answered",
                "Paris" in readme.text,
                repr(text),
                "text contains 'Paris'",
            )
        )
    else:
        out.append(
            Check(
                "README question answered",
                None,
                "random model: text not checked (the request completed)",
                "text contains 'Paris'",
            )
        )
    if setup["overload"]:
        out += _overload_checks(refused, valid, setup)
    if setup["autoscale"]:
        out.append(_capacity_check(run, setup))
        out.append(explained_check(run.decisions))
    return out


def explained_check(decisions: list[dict[str, Any]] | None) -> Check:
    """Every decision the controller made gives each role a reason (the scale it chose or why
    it held), and every change it applied says why in its role's reason."""
    if decisions is None:
        return Check("every scaling decision explained", None, "no decisions read", "all")
    unexplained = [d for d in decisions if not all(d["reasons"].get(role) for role in Role)]
    changes = [d for d in decisions if d["target"] != d["current"]]
    last = decisions[-1]["reasons"] if decisions else {}
    return Check(
        "every scaling decision explained",
        bool(decisions) and not unexplained,
        f"{len(decisions) - len(unexplained)} of {len(decisions)} decisions ({len(changes)} "
        f"changes); last: {'; '.join(f'{k}: {v}' for k, v in sorted(last.items()))}",
        "a reason per role in every decision",
    )


def rss_trends(run: Run, warmup_s: float) -> dict[str, TroughTrend]:
    """Per process alive through the traffic (one pid): its trough trend after warm-up
    (soak_memory); left out where the run after warm-up is too short for one."""
    during = [s for s in run.samples if s.t_s <= run.traffic_end_s]
    trends: dict[str, TroughTrend] = {}
    for name in sorted({n for s in during for n in s.rss_bytes}):
        pids = {s.pids.get(name) for s in during if name in s.rss_bytes and s.t_s >= warmup_s}
        if len(pids) != 1:
            continue  # restarted (or gone) after warm-up: its trend spans two processes
        points = [(s.t_s, s.rss_bytes[name]) for s in during if name in s.rss_bytes]
        trend = trough_trend(points, warmup_s)
        if trend is not None:
            trends[name] = trend
    return trends


def _rss_check(run: Run, warmup_s: float) -> Check:
    name = "RSS troughs flat after warm-up"
    target = f"< {100 * RSS_GROWTH_MAX:g}% growth per process ({WINDOWS} windows' troughs)"
    trends = rss_trends(run, warmup_s)
    if not trends:
        return Check(name, None, f"run too short after a warm-up of {warmup_s:g} s", target)
    worst = max(trends, key=lambda k: trends[k].growth)
    w = trends[worst]
    per_hour = w.slope_bytes_per_s * 3600 / 2**20
    return Check(
        name,
        all(t.growth < RSS_GROWTH_MAX for t in trends.values()),
        f"worst {worst} {100 * w.growth:+.2f}% ({mib(w.start_bytes)} -> {mib(w.end_bytes)} "
        f"MiB fitted, t {w.troughs[0][0]:.0f} -> {w.troughs[-1][0]:.0f} s, {per_hour:+.0f} "
        "MiB/h); "
        + ", ".join(f"{k} {100 * t.growth:+.2f}%" for k, t in sorted(trends.items())),
        target,
    )


def _overload_checks(
    refused: list[Record], valid: list[Record], setup: dict[str, Any]
) -> list[Check]:
    latencies = [r.total_s for r in refused if r.total_s is not None]
    without = sum(r.retry_after is None for r in refused)
    admitted = [r.ttft_s for r in valid if r.outcome == "completed" and r.ttft_s is not None]
    limit = setup["max_queue_delay_s"]
    p99 = quantile(admitted, 0.99)
    return [
        Check("excess refused with 429", bool(refused), f"{len(refused)} of {len(valid)}", "> 0"),
        Check(
            "every 429 carried Retry-After",
            bool(refused) and not without,
            f"{len(refused) - without} of {len(refused)}",
            "all",
        ),
        Check(
            "refused at once (send -> 429 p99)",
            None if not latencies else quantile(latencies, 0.99) < REFUSAL_P99_MAX_S,
            "no refusals"
            if not latencies
            else f"p50 {quantile(latencies, 0.5) * 1e3:.0f} ms, p99 "
            f"{quantile(latencies, 0.99) * 1e3:.0f} ms",
            f"p99 < {REFUSAL_P99_MAX_S * 1e3:.0f} ms",
        ),
        Check(
            "admitted TTFT within max_queue_delay_s",
            None if limit is None or not admitted else p99 <= limit,
            f"p50 {quantile(admitted, 0.5):.2f} s, p99 {p99:.2f} s"
            + ("" if limit is not None else " (limit not available)"),
            f"p99 <= {limit:g} s" if limit is not None else "p99 <= the limit",
        ),
    ]


def _capacity_check(run: Run, setup: dict[str, Any]) -> Check:
    """The benchmark's reading of "within the host's capacity": never more workers than
    cores (or than it started with), and all processes' RSS under 90% of the host's memory."""
    peak_workers = max((sum(s.workers.values()) for s in run.samples), default=0)
    peak_rss = max((sum(s.rss_bytes.values()) for s in run.samples), default=0)
    cap_workers = max(os.cpu_count() or 1, setup["num_prefill"] + setup["num_decode"])
    mem = _mem_total_bytes()
    ok = peak_workers <= cap_workers and (mem is None or peak_rss <= 0.9 * mem)
    return Check(
        "worker count within the host's capacity",
        ok,
        f"peak {peak_workers} workers, peak RSS {mib(peak_rss)} MiB"
        + (f" of {mib(mem)} MiB" if mem else ""),
        f"<= {cap_workers} workers, RSS <= 90% of memory",
    )


def _mem_total_bytes() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def mib(n: float) -> str:
    return f"{n / 2**20:.0f}"
