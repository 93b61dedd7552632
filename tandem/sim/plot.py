"""Plots of simulation runs (matplotlib, Agg backend; imported only when plotting)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from tandem.sim.results import SimResult
from tandem.types import Role


def plot_runs(
    runs: Sequence[SimResult], path: Path | str, title: str = "", bucket_s: float = 30.0
) -> Path:
    """Three panels over time for each run: workers per role (allocated: starting + live +
    draining), SLA attainment of the requests that arrived in each `bucket_s`, and the
    queues (prefill tokens, decode sequences waiting). Returns the path written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(3, 1, figsize=(10, 8.5), sharex=True)
    ax_rep, ax_sla, ax_q = axes
    styles = ["-", "--", ":", "-."]
    for i, run in enumerate(runs):
        style = styles[i % len(styles)]
        label = run.label or f"run {i}"
        ts = [p.t / 60 for p in run.series]
        for role, color in ((Role.PREFILL, "tab:blue"), (Role.DECODE, "tab:orange")):
            ax_rep.step(ts, [p.workers[role] for p in run.series], where="post", color=color,
                        linestyle=style, label=f"{label}: {role}")  # fmt: skip
        att = run.attainment_series(bucket_s)
        ax_sla.plot([(t + bucket_s / 2) / 60 for t, _, _ in att], [100 * a for _, a, _ in att],
                    linestyle=style, marker=".", label=label)  # fmt: skip
        ax_q.plot(ts, [p.queued_prefill_tokens / 1e3 for p in run.series], color="tab:blue",
                  linestyle=style, label=f"{label}: prefill queue (k tokens)")  # fmt: skip
        ax_q.plot(ts, [p.decode_waiting for p in run.series], color="tab:orange",
                  linestyle=style, label=f"{label}: decode waiting (seqs)")  # fmt: skip
    for run in runs[:1]:
        if run.warmup_s > 0:
            for ax in axes:
                ax.axvspan(0, run.warmup_s / 60, color="0.9", zorder=0)
    ax_rep.set_ylabel("workers")
    ax_rep.legend(fontsize=7, ncol=2, loc="upper right")
    ax_sla.set_ylabel(f"SLA met (%), per {bucket_s:.0f} s")
    ax_sla.set_ylim(-5, 105)
    ax_sla.legend(fontsize=7, loc="lower right")
    ax_q.set_ylabel("queue")
    ax_q.set_yscale("symlog", linthresh=1.0)
    ax_q.set_ylim(bottom=0)
    ax_q.legend(fontsize=7, ncol=2, loc="upper right")
    ax_q.set_xlabel("time (min); grey: warm-up, not measured")
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
