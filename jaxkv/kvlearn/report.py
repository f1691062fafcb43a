"""Tables and plots of simulator results, as the command lines print and save them.

Tables have one line per row and columns that grow with their values (``format_columns``), so
wide values never run into their neighbours. Plots need matplotlib, imported when one is drawn.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

Column = tuple[str, int, Callable[[dict], str]]
"""(header, minimum width, cell text of a row); the first column is left-aligned."""


def format_columns(columns: Sequence[Column], rows: Sequence[dict], *, rule: bool = True) -> str:
    """A header, a rule (unless ``rule`` is false) and one line per row. Each column is as wide
    as its minimum width or its widest text plus one space, so wide values never run into their
    neighbours."""
    cells = [[text(r) for _, _, text in columns] for r in rows]
    widths = [
        max([w, len(head) + 1] + [len(c[j]) + 1 for c in cells])
        for j, (head, w, _) in enumerate(columns)
    ]

    def line(texts) -> str:
        first = f"{texts[0]:<{widths[0]}}"
        return first + "".join(f"{t:>{w}}" for t, w in zip(texts[1:], widths[1:], strict=True))

    head = line([h for h, _, _ in columns])
    return "\n".join([head] + ["-" * len(head)] * rule + [line(c) for c in cells])


# ---- the Zipf simulator ---------------------------------------------------------------------
SIM_COLUMNS: list[Column] = [
    ("policy", 15, lambda m: m["policy"]),
    ("TTFT mean", 10, lambda m: f"{m['ttft_ms_mean']:.3f}"),
    ("p50", 8, lambda m: f"{m['ttft_ms_p50']:.2f}"),
    ("p99", 8, lambda m: f"{m['ttft_ms_p99']:.2f}"),
    ("hit %", 8, lambda m: f"{100 * m['hit_rate']:.1f}"),
    ("byte hit %", 11, lambda m: f"{100 * m['byte_hit_rate']:.1f}"),
    ("xfer GiB", 10, lambda m: f"{m['transfer_gib']:.1f}"),
    ("admits", 8, lambda m: f"{m['admits']:d}"),
    ("evictions", 10, lambda m: f"{m['evictions']:d}"),
    ("discards", 9, lambda m: f"{m['discards']:d}"),
]


def sim_table(results: list[dict]) -> str:
    """The policy table of one simulator run (``sim.simulate.compare``)."""
    return format_columns(SIM_COLUMNS, results)


def sim_sweep_table(summary: list[dict], *, alpha, pools, policies) -> str:
    """Median mean TTFT per policy (rows) and pool size (columns) at one alpha."""
    cells = {(r["policy"], r["pool_gib"]): r for r in summary if r["alpha"] == alpha}
    columns: list[Column] = [("policy", 15, lambda row: row["policy"])]
    columns += [
        (f"{g:g}G", 10, lambda row, g=g: f"{cells[(row['policy'], g)]['ttft_ms_mean_median']:.3f}")
        for g in pools
    ]
    return format_columns(columns, [{"policy": p} for p in policies], rule=False)


def plot_sim_sweep(summary: list[dict], *, path, alphas, policies) -> None:
    """TTFT (median over seeds, min–max band) vs pool size, one panel per alpha."""
    import matplotlib  # lazy: a heavy import only plots need

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(alphas), figsize=(5 * len(alphas), 4), squeeze=False)
    for ax, alpha in zip(axes[0], alphas, strict=True):
        for name in policies:
            rs = sorted(
                (r for r in summary if r["policy"] == name and r["alpha"] == alpha),
                key=lambda r: r["pool_gib"],
            )
            x = [r["pool_gib"] for r in rs]
            ax.plot(
                x,
                [r["ttft_ms_mean_median"] for r in rs],
                marker="o",
                label=name,
                lw=2.5 if name == "kvlearn" else 1.2,
            )
            ax.fill_between(
                x,
                [r["ttft_ms_mean_min"] for r in rs],
                [r["ttft_ms_mean_max"] for r in rs],
                alpha=0.15,
            )
        ax.set_xscale("log", base=2)
        ax.set_xlabel("pool size (GiB)")
        ax.set_title(f"Zipf α = {alpha}")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("mean TTFT (ms)")
    axes[0][-1].legend(fontsize=8)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ---- the serving simulator ------------------------------------------------------------------
SERVE_COLUMNS: list[Column] = [
    ("policy", 14, lambda m: m["policy"]),
    ("TTFT mean", 11, lambda m: f"{m['ttft_ms_mean']:.1f}"),
    ("p50", 10, lambda m: f"{m['ttft_ms_p50']:.1f}"),
    ("p99", 11, lambda m: f"{m['ttft_ms_p99']:.1f}"),
    ("blk hit %", 10, lambda m: f"{100 * m['hit_rate']:.1f}"),
    ("tok hit %", 10, lambda m: f"{100 * m['token_hit_rate']:.1f}"),
    ("xfer GiB", 10, lambda m: f"{m['transfer_gib']:.0f}"),
    ("wait ms", 10, lambda m: f"{m['wait_ms_mean']:.1f}"),
    ("goodput", 9, lambda m: f"{m['goodput_rps']:.3f}"),
    (
        "max rps",
        9,
        lambda m: "-" if m.get("throughput_rps") is None else f"{m['throughput_rps']:.3f}",
    ),
    ("e2e ms", 10, lambda m: f"{m['e2e_ms_mean']:.0f}"),
    ("sim s", 7, lambda m: f"{m['wall_s']:.2f}"),
]


def serve_table(results: list[dict]) -> str:
    """The policy table of one serving run (``serving.metrics.compare``)."""
    return format_columns(SERVE_COLUMNS, results)


def serve_sweep_table(rows, *, frac, loads, policies) -> str:
    """Mean TTFT per policy (rows) and load scale (columns) at one pool fraction."""
    cells = {(r["policy"], r["load_scale"]): r for r in rows if r["pool_frac"] == frac}
    columns: list[Column] = [("policy", 14, lambda row: row["policy"])]
    columns += [
        (f"{x:g}x", 12, lambda row, x=x: f"{cells[(row['policy'], x)]['ttft_ms_mean']:.1f}")
        for x in loads
    ]
    return format_columns(columns, [{"policy": p} for p in policies], rule=False)


def plot_serve_sweep(rows, *, path, fracs, loads, policies) -> None:
    """Mean TTFT vs pool fraction (at load 1 or the first load) and vs load (largest pool)."""
    import matplotlib  # lazy: a heavy import only plots need

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    load0 = 1.0 if 1.0 in loads else loads[0]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    for p in policies:
        rs = [r for r in rows if r["policy"] == p]
        x = [f for f in fracs]
        a1.plot(x, [_cell(rs, f, load0)["ttft_ms_mean"] for f in x], marker="o", label=p)
        a2.plot(loads, [_cell(rs, fracs[-1], s)["ttft_ms_mean"] for s in loads], marker="o")
    a1.set_xlabel("pool size (fraction of distinct blocks)")
    a1.set_title(f"load scale {load0:g}")
    a2.set_xlabel("load scale")
    a2.set_title(f"pool {100 * fracs[-1]:g} % of distinct blocks")
    for a in (a1, a2):
        a.set_ylabel("mean TTFT (ms)")
        a.set_yscale("log")
        a.grid(alpha=0.3)
    a1.legend(fontsize=8)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _cell(rows, frac, load):
    return next(r for r in rows if r["pool_frac"] == frac and r["load_scale"] == load)
