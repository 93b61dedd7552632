"""The soak's report: a markdown summary and a plot of one `bench_soak.py` result (its JSON
dict): KV blocks in use per worker and RSS per process over time, request outcomes by kind,
and the TTFT of each streamed request over the run."""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))  # siblings import by name
from report import machine_summary, pyplot, verdict
from soak_memory import trough_trend


def _ms(x: Any) -> str:
    return "-" if not isinstance(x, int | float) else f"{x * 1e3:.0f}"


def _bound(x: Any) -> str:
    if x is None:
        return "-"
    if x == "inf":
        return "> largest bucket"
    return f"<= {x * 1e3:g} ms"


def _hist(h: dict[str, Any] | None) -> str:
    """p50 / p99 bucket bounds of a histogram summary, and its count."""
    if h is None:
        return "not available"
    return f"{_bound(h['p50_bound_s'])} / {_bound(h['p99_bound_s'])} ({h['count']:.0f})"


def _na(x: Any) -> str:
    if x is None:
        return "not available"
    if isinstance(x, dict):
        shown = ", ".join(f"{k}: {v:g}" for k, v in sorted(x.items()) if v)
        return shown or "0"
    return str(x)


def markdown(r: dict[str, Any], stem: str, plotted: bool, results: str) -> str:
    """The summary; `results`: the results folder as the reader should see it."""
    s, m, mach = r["setup"], r["metrics"], r["machine"]
    where = machine_summary(mach, shared=False)
    lines = [
        f"### Soak: {r['mode']}",
        "",
        f"`.venv/bin/{r['command']}` ({where}). `tandem up`: {s['num_prefill']} prefill + "
        f"{s['num_decode']} decode worker(s){', autoscale' if s['autoscale'] else ''}, model "
        f"{s['model']}{'' if s['real_model'] else ' (random weights)'}, KV cache "
        f"{s['kv_cache_bytes'] / 2**20:.0f} MiB per worker, transport {s['transport']}. "
        f"{s['clients']} closed-loop clients for {s['duration_s']:g} s (seed {s['seed']}); "
        f"lease_ttl_s {s['lease_ttl_s']:g}, max_queue_delay_s "
        f"{_na(s['max_queue_delay_s'])}; RSS from {s['rss_source']}. Run directory "
        f"`{s.get('run_dir', '?')}`; results `{results}/{stem}.json`.",
        "",
        "| check | result | measured | target |",
        "|---|---|---|---|",
    ]
    for c in r["checks"]:
        result = verdict(c["passed"], fail="**FAIL**")
        lines.append(f"| {c['name']} | {result} | {c['measured']} | {c['target']} |")
    outcomes = sorted({o for by in r["outcomes"].values() for o in by})
    lines += [
        "",
        "| kind | requests | " + " | ".join(outcomes) + " | TTFT p50 / p99 (ms) "
        "| total p50 / p99 (ms) |",
        "|---|---|" + "---|" * len(outcomes) + "---|---|",
    ]
    for kind, by in sorted(r["outcomes"].items()):
        lat = r["latency"].get(kind, {})
        t, e = lat.get("ttft_s", {}), lat.get("total_s", {})
        lines.append(
            f"| {kind} | {sum(by.values())} | "
            + " | ".join(str(by.get(o, 0)) for o in outcomes)
            + f" | {_ms(t.get('p50'))} / {_ms(t.get('p99'))} "
            f"| {_ms(e.get('p50'))} / {_ms(e.get('p99'))} |"
        )
    art = m["abort_round_trip"]
    est, act = m["queue_delay_estimate"], m["queue_delay_actual"]
    lines += [
        "",
        "Router and worker metrics over the run (differences of two scrapes):",
        "",
        f"- ejections by reason: {_na(m['ejections_by_reason'])}; router log: "
        + ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in r["router_log"].items()),
        f"- worker aborts by outcome (router): {_na(m['worker_aborts_by_outcome'])}; abort "
        "round trip p50 / p99: " + "; ".join(f"{role} {_hist(h)}" for role, h in art.items()),
        f"- admission refusals by reason: {_na(m['admission_refusals_by_reason'])}; queue "
        "delay p50 / p99, estimated: " + f"{_hist(est)}, actual: {_hist(act)}",
        f"- workers: aborts {_na(m['worker_aborts'])}; KV blocks reaped "
        f"{_na(m['worker_kv_blocks_reaped'])}; KV audit violations "
        f"{_na(m['worker_kv_audit_violations'])}",
        f"- router requests by outcome: {_na(m['router_requests_by_outcome'])}",
    ]
    if s["autoscale"]:
        lines.append(f"- controller decisions by role: {_na(m['controller_decisions'])}")
    lines += _structures(r)
    lines.append("")
    if plotted:
        lines += [f"![soak]({results}/{stem}.png)", ""]
    else:
        lines += ["(no plot: matplotlib is not installed)", ""]
    return "\n".join(lines)


def _structures(r: dict[str, Any]) -> list[str]:
    """Per worker, its bounded structures and glibc heap at the end of warm-up and at the end
    of the traffic (issue 38; samples without them, from older builds, give nothing)."""
    during = [x for x in r["samples"] if x["t_s"] <= r.get("traffic_end_s", math.inf)]
    first = next((x for x in during if x["t_s"] >= r["setup"]["warmup_s"]), None)
    if first is None or not during[-1].get("state_entries"):
        return []
    last = during[-1]
    out = []
    for name in sorted(last["state_entries"]):
        a, b = first.get("state_entries", {}).get(name, {}), last["state_entries"][name]
        held = {k: int(v) for k, v in b.items() if k in ("onednn_row_counts", "grammar_cache")}
        was = {k: int(a.get(k, 0)) for k in held}
        ha, hb = first.get("heap_bytes", {}).get(name, {}), last.get("heap_bytes", {}).get(name, {})
        heap = (
            f"; heap in use / free {ha.get('in_use', 0) / 2**20:.0f} / "
            f"{ha.get('free', 0) / 2**20:.0f} -> {hb.get('in_use', 0) / 2**20:.0f} / "
            f"{hb.get('free', 0) / 2**20:.0f} MiB"
            if hb
            else ""
        )
        out.append(f"- {name} after warm-up -> end: bounded structures {was} -> {held}{heap}")
    return out


def plot(r: dict[str, Any], path: Path) -> bool:
    """Write the plot; False (and nothing written) without matplotlib."""
    plt = pyplot()
    if plt is None:
        return False

    samples = r["samples"]
    ts = [x["t_s"] for x in samples]
    fig, axes = plt.subplots(2, 2, figsize=(14, 8.5))
    ax = axes[0][0]
    for name in sorted({n for x in samples for n in x["kv_blocks_used"]}):
        pts = [
            (x["t_s"], x["kv_blocks_used"][name]) for x in samples if name in x["kv_blocks_used"]
        ]
        ax.plot([p[0] for p in pts], [p[1] for p in pts], ".-", label=name)
    _traffic_lines(ax, r)
    ax.set_ylabel("KV blocks in use")
    ax.set_title("KV blocks in use per worker")
    ax.legend(fontsize=8)
    ax = axes[0][1]
    warmup_s = r["setup"]["warmup_s"]
    traffic_end_s = r.get("traffic_end_s", math.inf)
    for name in sorted({n for x in samples for n in x["rss_bytes"]}):
        pts = [(x["t_s"], x["rss_bytes"][name] / 2**20) for x in samples if name in x["rss_bytes"]]
        (line,) = ax.plot([p[0] for p in pts], [p[1] for p in pts], ".-", ms=2, label=name)
        trend = trough_trend([p for p in pts if p[0] <= traffic_end_s], warmup_s)
        if trend is not None:
            ts_ = [t for t, _ in trend.troughs]
            ax.plot(ts_, [v for _, v in trend.troughs], "x", color=line.get_color())
            ax.plot(
                [ts_[0], ts_[-1]],
                [trend.start_bytes, trend.end_bytes],
                "--",
                color=line.get_color(),
                lw=1,
            )
    _traffic_lines(ax, r)
    ax.axvline(warmup_s, color="grey", ls=":", lw=1)
    ax.set_ylabel("RSS (MiB, with children)")
    ax.set_title("Resident memory per process (x: troughs, dashed: their trend)")
    ax.legend(fontsize=8)
    ax = axes[1][0]
    kinds = sorted(r["outcomes"])
    outcomes = sorted({o for by in r["outcomes"].values() for o in by})
    left = [0] * len(kinds)
    for o in outcomes:
        counts = [r["outcomes"][k].get(o, 0) for k in kinds]
        ax.barh(kinds, counts, left=left, label=o, color=_color(o))
        left = [a + b for a, b in zip(left, counts, strict=True)]
    ax.set_xlabel("requests")
    ax.set_title("Outcomes by kind")
    ax.legend(fontsize=8)
    ax = axes[1][1]
    for kind in sorted({x["kind"] for x in r["records"]}):
        pts = [
            (x["start_s"], x["ttft_s"])
            for x in r["records"]
            if x["kind"] == kind and x["ttft_s"] is not None
        ]
        if pts:
            ax.plot([p[0] for p in pts], [p[1] for p in pts], ".", ms=3, label=f"{kind} TTFT")
    refused = [(x["start_s"], x["total_s"]) for x in r["records"] if x["status"] == 429]
    if refused:
        ax.plot(
            [p[0] for p in refused],
            [p[1] for p in refused],
            "x",
            color="red",
            ms=3,
            label="send -> 429",
        )
    limit = r["setup"]["max_queue_delay_s"]
    if limit is not None:
        ax.axhline(limit, color="red", ls="--", lw=1, label=f"max_queue_delay_s {limit:g}")
    ax.set_xlabel("request sent at (s)")
    ax.set_ylabel("seconds")
    ax.set_title("TTFT of streamed requests")
    ax.legend(fontsize=8)
    right = max([*ts, r["traffic_end_s"] + r["drain_timeout_s"]]) + 1
    for a in (axes[0][0], axes[0][1]):
        a.set_xlabel("time since the traffic began (s; dashed: traffic end, + lease_ttl_s)")
        a.set_xlim(left=0, right=right)
    checks = r["checks"]
    failed = sum(c["passed"] is False for c in checks)
    fig.suptitle(
        f"Soak {r['mode']}: {r['setup']['model']}, {r['setup']['clients']} clients, "
        f"{len(checks) - failed} of {len(checks)} checks not failed"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def _color(outcome: str) -> str:
    """Green: done; blue: our disconnect; orange: a 4xx; purple: 429; red: 5xx or error."""
    if outcome in ("completed", "disconnected"):
        return "tab:green" if outcome == "completed" else "tab:blue"
    if outcome == "http_429":
        return "tab:purple"
    if outcome.startswith("http_4"):
        return "tab:orange"
    return "black" if outcome == "unfinished" else "tab:red"


def _traffic_lines(ax: Any, r: dict[str, Any]) -> None:
    end = r["traffic_end_s"]
    ax.axvline(end, color="black", ls="--", lw=1)
    ax.axvline(end + r["drain_timeout_s"], color="black", ls=":", lw=1)
