"""An ablation's report (``scripts/ablate_rl.sh``, ``ablate_training.sh``, ``ablate_features.sh``):
README.md and curves.png.

Reads the REINFORCE runs ``WORK/<arm>_s<seed>/metrics.jsonl`` and the fidelity run
``OUT/fidelity.json`` (one seed group per arm, ``learned:WORK/<arm>_s*/policy`` or
``ranker:WORK/<arm>_s*[/policy]``, beside the heuristics; ``--with`` adds the policies of
other runs on the same settings, e.g. arms and heuristics another ablation evaluated), and
writes into OUT:

* ``curves.png`` (when some arm trained with REINFORCE): training KL and policy entropy per
  step, each arm's mean over its seeds (a moving average of 10 steps), the seeds' range shaded;
* ``README.md``: held-out KL per arm and seed, mean ± std over seeds (sample std), each
  seed's ratio to the best heuristic at that ratio, and the paired differences between
  arms (same seed, same windows).

    .venv/bin/python scripts/ablate_rl_report.py runs/ablate_rl results/rl_ablation
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from pathlib import Path

import numpy as np

SMOOTH = 10
ARMS = {  # what each arm is, for the report
    "paper": "the DistillCache policy of `configs/distillcache_cpu.yaml` (the paper's 5 "
    "features, one decision shared by all heads, RLOO over 4 rollouts) trained with the "
    "`paper` estimator: a Gumbel-top-B sample scored with the subset log-probability log π "
    "(biased)",
    "exact": "the same policy trained with `exact`: an exact sample from π drawn through the DP",
    "ordered_pl": "the same policy trained with `ordered_pl`: the Gumbel-top-B draw scored with "
    "its ordered log-probability",
    "supervised": "the shipped ranker's recipe (`python -m jaxkv.train ranker "
    "--windows-per-domain 12 --steps 1500 --target value --seed S`; ListNet on the full cache's "
    "future attention × value norm, four training domains, no RL)",
    "rl": "REINFORCE per (layer, KV head) from a fresh ranker of the same size "
    "(`configs/distillcache_head_cpu.yaml`, `warm_start=''`, `hidden=32`; its feature "
    "standardization stays the identity)",
    "warm_rl": "REINFORCE per (layer, KV head) warm-started from the same seed's `supervised` "
    "ranker (`configs/distillcache_head_cpu.yaml`, `warm_start=<supervised_sS>`)",
    "paper5": "the `supervised` recipe reading the paper's 5 features per head (`--features "
    "log_attn,log_vnorm,log_attn_var,entropy,pos_frac`)",
    "all14": "the `supervised` recipe reading all 14 features that need no reconstruction pass "
    "(the default 13 + `log_wo_vnorm`, ‖W_o v‖ of the model's output projection)",
}


def read_runs(work: Path) -> dict[str, dict[int, list[dict]]]:
    """{arm: {seed: metric rows}} of the REINFORCE runs."""
    runs: dict[str, dict[int, list[dict]]] = {}
    for path in sorted(work.glob("*_s*/metrics.jsonl")):
        arm, seed = re.fullmatch(r"(.+)_s(\d+)", path.parent.name).groups()
        rows = [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]
        runs.setdefault(arm, {})[int(seed)] = rows
    return runs


def settings(doc: dict, ignore: tuple[str, ...] = ("policies",)) -> dict:
    """A fidelity run's model and settings less ``ignore``: equal for runs that share a table."""
    return {"model": doc["model"]} | {k: v for k, v in doc["config"].items() if k not in ignore}


def read_fidelity(paths: list[Path]) -> dict:
    """The first fidelity run's document with the records of every run (a policy label read
    from an earlier run is skipped); exits if the runs' settings differ."""
    docs = [json.loads(path.read_text()) for path in paths]
    for path, doc in zip(paths[1:], docs[1:], strict=True):
        if settings(doc) != settings(docs[0]):
            raise SystemExit(f"{path} and {paths[0]} were run on different settings")
    seen: set[str] = set()
    records = []
    for doc in docs:
        new = {rec["policy"] for rec in doc["records"]} - seen
        records += [rec for rec in doc["records"] if rec["policy"] in new]
        seen |= new
    return {**docs[0], "records": records, "sources": [str(path) for path in paths]}


def windows_text(cfg: dict) -> str:
    """The fidelity run's text and windows, for a report."""
    return (
        f"`{cfg['text'] or 'tinyshakespeare'}`, its last {cfg['heldout']:.0%} (never trained "
        f"on), {cfg['windows']} windows of {cfg['prompt_len']} + "
        f"{cfg['window'] - cfg['prompt_len']} tokens"
    )


def per_seed_kl(doc: dict) -> dict[str, dict[float, dict[str, float]]]:
    """{policy label: {ratio: {member: KL}}} from the fidelity records."""
    out: dict[str, dict[float, dict[str, float]]] = {}
    for rec in doc["records"]:
        out.setdefault(rec["policy"], {}).setdefault(rec["ratio"], {})[rec["member"]] = rec[
            "kl_mean"
        ]
    return out


def seed_of(member: str) -> int:
    return int(re.search(r"_s(\d+)(/policy)?$", member).group(1))


def arm_of(label: str) -> str | None:
    m = re.search(r"/([a-z0-9_]+)_s\*(/policy)?$", label)
    return m.group(1) if m else None


def mean_std(xs: list[float]) -> str:
    sd = statistics.stdev(xs) if len(xs) > 1 else 0.0
    return f"{statistics.mean(xs):.4f} ± {sd:.4f}"


def plot(runs: dict, arms: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 3.6))
    for ax, key in zip(axes, ("kl", "entropy"), strict=True):
        for arm in arms:
            if arm not in runs:
                continue
            n = min(len(r) for r in runs[arm].values())
            ys = np.array([[row[key] for row in r[:n]] for r in runs[arm].values()])
            kernel = np.ones(SMOOTH) / SMOOTH
            smooth = np.array([np.convolve(y, kernel, mode="valid") for y in ys])
            steps = np.arange(SMOOTH - 1, n)
            ax.plot(steps, smooth.mean(0), label=f"{arm} ({len(ys)} seeds)")
            ax.fill_between(steps, smooth.min(0), smooth.max(0), alpha=0.2)
        ax.set_xlabel("training step")
        ax.set_title(
            "training KL(P_full || P_pruned) per token" if key == "kl" else "policy entropy"
        )
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def report(runs: dict, doc: dict, arms: list[str], title: str, script: str) -> str:
    kl = per_seed_kl(doc)
    ratios = sorted({r for v in kl.values() for r in v}, reverse=True)
    learned = {arm_of(label): label for label in kl if arm_of(label)}
    heuristics = [label for label in kl if not arm_of(label)]
    best = {r: min(heuristics, key=lambda h: next(iter(kl[h][r].values()))) for r in ratios}
    best_kl = {r: next(iter(kl[best[r]][r].values())) for r in ratios}
    cfg = doc["config"]
    lines = [
        f"# {title} (issue 14, deliverable 5)",
        "",
        f"`bash {script}`: each arm trained with seeds 0, 1, 2 (the seed sets the "
        "initialisation, the training windows and, in REINFORCE, the rollouts' keys); then "
        "decode-protocol fidelity of all of them beside the heuristics "
        f"({', '.join(f'`{s}`' for s in doc['sources'])}, on the same windows). Text: "
        f"{windows_text(cfg)}, granularity "
        f"{cfg.get('granularity', 'shared')}, "
        f"B_min {cfg['min_budget']}. The ablation chooses nothing.",
        "",
        *[f"* `{arm}`: {ARMS[arm]}." for arm in arms],
        "",
        "## Held-out KL per seed (nats per token; lower is better)",
        "",
        "| arm | "
        + " | ".join(f"r = {r}: seeds 0 / 1 / 2 | mean ± std | / best heuristic" for r in ratios)
        + " |",
        "|---|" + "---|---|---|" * len(ratios),
    ]
    seeds_kl: dict[str, dict[float, dict[int, float]]] = {}
    for arm in arms:
        if arm not in learned:
            continue
        cells = []
        for r in ratios:
            by_seed = {seed_of(m): v for m, v in kl[learned[arm]][r].items()}
            seeds_kl.setdefault(arm, {})[r] = by_seed
            xs = [by_seed[s] for s in sorted(by_seed)]
            rel = " / ".join(f"{x / best_kl[r]:.2f}" for x in xs)
            cells += [" / ".join(f"{x:.4f}" for x in xs), mean_std(xs), rel]
        lines.append(f"| `{arm}` | " + " | ".join(cells) + " |")
    for h in heuristics:
        cells = []
        for r in ratios:
            x = next(iter(kl[h][r].values()))
            cells += [f"{x:.4f}", "", f"{x / best_kl[r]:.2f}"]
        lines.append(f"| {h} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "Best heuristic: " + ", ".join(f"r = {r}: {best[r]}" for r in ratios) + ".",
        "",
        "## Paired differences (same seed, same windows; KL of the first minus the second)",
        "",
        "| pair | " + " | ".join(f"r = {r}: per seed | mean ± std" for r in ratios) + " |",
        "|---|" + "---|---|" * len(ratios),
    ]
    done = [e for e in arms if e in seeds_kl]
    for i, a in enumerate(done):
        for b in done[i + 1 :]:
            cells = []
            for r in ratios:
                common = sorted(set(seeds_kl[a][r]) & set(seeds_kl[b][r]))
                d = [seeds_kl[a][r][s] - seeds_kl[b][r][s] for s in common]
                cells += [" / ".join(f"{x:+.4f}" for x in d), mean_std(d)]
            lines.append(f"| `{a}` − `{b}` | " + " | ".join(cells) + " |")
    if not any(arm in runs for arm in arms):  # supervised fits only: no REINFORCE curves
        return "\n".join(lines) + "\n"
    lines += [
        "",
        "## Training",
        "",
        "![training curves](curves.png)",
        "",
        "| arm | seed | steps | training KL, mean of the last 50 steps | entropy, last 50 | "
        "minutes |",
        "|---|---|---|---|---|---|",
    ]
    for arm in arms:
        for seed, rows in sorted(runs.get(arm, {}).items()):
            tail = rows[-50:]
            lines.append(
                f"| `{arm}` | {seed} | {len(rows)} | "
                f"{np.mean([r['kl'] for r in tail]):.3f} | "
                f"{np.mean([r['entropy'] for r in tail]):.2f} | "
                f"{sum(r['seconds'] for r in rows) / 60:.1f} |"
            )
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("work", type=Path, help="the training runs (WORK of the ablation script)")
    p.add_argument("out", type=Path, help="the fidelity run (OUT of the ablation script)")
    p.add_argument("--arms", default="paper,exact,ordered_pl", help=f"comma list from {list(ARMS)}")
    p.add_argument("--title", default="REINFORCE estimator ablation")
    p.add_argument("--script", default="scripts/ablate_rl.sh", help="the ablation's command")
    p.add_argument(
        "--with",
        dest="more",
        type=Path,
        action="append",
        default=[],
        help="another fidelity.json on the same settings whose policies join the table",
    )
    args = p.parse_args()
    arms = args.arms.split(",")
    if unknown := sorted(set(arms) - set(ARMS)):
        p.error(f"unknown arms {unknown}; choose from {list(ARMS)}")
    runs = read_runs(args.work)
    doc = read_fidelity([args.out / "fidelity.json", *args.more])
    if any(arm in runs for arm in arms):
        plot(runs, arms, args.out / "curves.png")
    (args.out / "README.md").write_text(report(runs, doc, arms, args.title, args.script))
    print(f"wrote {args.out / 'README.md'}")


if __name__ == "__main__":
    main()
