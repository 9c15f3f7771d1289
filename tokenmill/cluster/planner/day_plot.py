"""The plot of a simulated day (`tokenmill plan simulate --plot`)."""

from __future__ import annotations

from pathlib import Path

from tokenmill.cluster.planner.sim_result import SimResult
from tokenmill.cluster.planner.traffic import Traffic
from tokenmill.extras import require


def plot_day(traffic: Traffic, results: list[SimResult], path: Path, title: str) -> None:
    """Three panels over the day: arrivals, workers launched (with the planner's decisions) and the
    share of requests within the SLO per 15 minutes, one line per simulated fleet."""
    require("bench", "the day's plot (tokenmill plan simulate --plot)")
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on servers
    import matplotlib.pyplot as plt
    import numpy as np

    hours = 3600.0
    # Clock hours where the traffic has them (the daily curve from its start hour), else hours from 0.
    clock = traffic.clock_start_s
    x0 = clock or 0.0
    fig, (ax_r, ax_w, ax_a) = plt.subplots(
        3, 1, figsize=(10, 8.5), sharex=True, gridspec_kw={"height_ratios": [1, 1.4, 0.9]}
    )
    centres, rates = traffic.rate(300.0)
    ax_r.plot((x0 + centres) / hours, rates, color="0.3", lw=1, label="arrivals (5-min mean)")
    if traffic.rate_fn is not None:
        x = np.linspace(0, traffic.duration_s, 2000)
        ax_r.plot((x0 + x) / hours, traffic.rate_fn(x), color="tab:red", lw=0.8, alpha=0.6, label="rate")
    ax_r.set_ylabel("requests/s")
    ax_r.legend(fontsize=8, loc="upper left")
    ax_r.grid(alpha=0.3)
    ax_r.set_title(title, fontsize=9)

    colors = ["0.2", "tab:blue", "tab:orange", "tab:green", "tab:purple"]
    bin_s = 900.0
    edges = np.arange(0.0, traffic.duration_s + bin_s, bin_s)
    which = np.clip(np.searchsorted(edges, traffic.t, side="right") - 1, 0, len(edges) - 2)
    for i, r in enumerate(results):
        color = colors[i % len(colors)]
        tl = r.timeline
        ts = [(x0 + p[0]) / hours for p in tl]
        total = [p[1] + p[2] + p[3] for p in tl]  # every launched worker costs GPU time
        serving = [p[1] for p in tl]
        label = f"{r.name}: {r.gpu_hours:.0f} GPU-h, {100 * r.attainment:.2f}% SLO"
        static = not r.decisions and r.decide_calls == 0
        ax_w.step(ts, total, where="post", color=color, lw=1.3, ls="--" if static else "-", label=label)
        if r.decisions:
            ax_w.step(ts, serving, where="post", color=color, lw=0.6, ls=":", alpha=0.8)
            ups = [((x0 + d.time) / hours, d.target) for d in r.decisions if d.delta > 0]
            downs = [((x0 + d.time) / hours, d.target) for d in r.decisions if d.delta < 0]
            if ups:
                ax_w.scatter(*zip(*ups, strict=True), marker="^", s=14, color=color, zorder=3)
            if downs:
                ax_w.scatter(*zip(*downs, strict=True), marker="v", s=14, color=color, zorder=3)
        ok = r.met()
        hits = np.bincount(which, weights=ok.astype(float), minlength=len(edges) - 1)
        counts = np.bincount(which, minlength=len(edges) - 1)
        with np.errstate(invalid="ignore", divide="ignore"):
            share = 100 * hits / counts
        ax_a.plot((x0 + edges[:-1] + bin_s / 2) / hours, share, color=color, lw=1, label=r.name)
    ax_w.set_ylabel("workers (launched)")
    ax_w.legend(
        fontsize=8, loc="upper left", title="^ v planner decisions; dotted: serving", title_fontsize=7
    )
    ax_w.grid(alpha=0.3)
    ax_a.set_ylabel("SLO met, % (15 min)")
    ax_a.set_xlabel("hour of the day" if clock is not None else "hours")
    ax_a.grid(alpha=0.3)
    lo = np.nanmin([np.nanmin(line.get_ydata()) for line in ax_a.get_lines()] + [99.0])
    ax_a.set_ylim(max(0.0, lo - 1), 100.5)
    ax_a.legend(fontsize=8, loc="lower left")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
