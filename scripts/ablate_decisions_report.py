"""The decisions ablation's report (``scripts/ablate_decisions.sh``): OUT/README.md.

Reads ``OUT/<granularity>/fidelity.json`` for each granularity run (one ranker seed group
beside the heuristics) and writes one table: KL per policy and granularity, the rankers' mean ±
std over seeds and their ratio to the best heuristic at the same granularity, and the paired
differences between granularities (same seed, same windows).

    .venv/bin/python scripts/ablate_decisions_report.py results/decision_ablation
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

GRANULARITIES = ("shared", "layer", "head")


def mean_std(xs: list[float]) -> str:
    sd = statistics.stdev(xs) if len(xs) > 1 else 0.0
    return f"{statistics.mean(xs):.4f} ± {sd:.4f}"


def read(out: Path) -> dict[str, dict[str, dict[float, dict[str, float]]]]:
    """{granularity: {policy label: {ratio: {member: KL}}}} of the finished runs."""
    kl: dict[str, dict[str, dict[float, dict[str, float]]]] = {}
    for g in GRANULARITIES:
        path = out / g / "fidelity.json"
        if not path.is_file():
            continue
        for rec in json.loads(path.read_text())["records"]:
            cell = kl.setdefault(g, {}).setdefault(rec["policy"], {}).setdefault(rec["ratio"], {})
            cell[rec["member"]] = rec["kl_mean"]
    return kl


def report(kl: dict, config: dict) -> str:
    grans = [g for g in GRANULARITIES if g in kl]
    labels = list(kl[grans[0]])
    ranker = next(label for label in labels if label.startswith("ranker:"))
    heuristics = [label for label in labels if label != ranker]
    ratios = sorted(kl[grans[0]][ranker], reverse=True)
    cols = [(g, r) for r in ratios for g in grans]

    def kl_of(g, label, r):
        return next(iter(kl[g][label][r].values()))

    best = {(g, r): min(heuristics, key=lambda h: kl_of(g, h, r)) for g, r in cols}
    seeds = {(g, r): [kl[g][ranker][r][m] for m in sorted(kl[g][ranker][r])] for g, r in cols}
    lines = [
        "# Decisions ablation: shared vs per layer vs per (layer, KV head) (issue 14, "
        "deliverable 5)",
        "",
        "`bash scripts/ablate_decisions.sh`: the same three supervised rankers "
        f"(`{ranker.removeprefix('ranker:')}`, seeds 0, 1, 2, from `scripts/ablate_training.sh`) "
        "decide per (layer, KV head) (`head`: each row keeps its own top B), per layer (`layer`: "
        "scores averaged over the layer's KV heads) and once for the whole model (`shared`: "
        "averaged over every row), beside the heuristics at the same granularity. The rankers "
        "were trained per row; averaging their scores is the only change. Decode protocol; "
        f"text `{config['text'] or 'tinyshakespeare'}`, its last {config['heldout']:.0%} (never "
        f"trained on), {config['windows']} windows of {config['prompt_len']} + "
        f"{config['window'] - config['prompt_len']} tokens, B_min {config['min_budget']}. The "
        "ablation chooses nothing.",
        "",
        "## KL(P_full || P_pruned) per token (nats; lower is better)",
        "",
        "| policy | " + " | ".join(f"{g}, r = {r}" for g, r in cols) + " |",
        "|---|" + "---|" * len(cols),
        "| ranker, seeds 0 / 1 / 2 | "
        + " | ".join(" / ".join(f"{x:.4f}" for x in seeds[c]) for c in cols)
        + " |",
        "| ranker, mean ± std | " + " | ".join(mean_std(seeds[c]) for c in cols) + " |",
        "| ranker / best heuristic, per seed | "
        + " | ".join(
            " / ".join(f"{x / kl_of(g, best[g, r], r):.2f}" for x in seeds[g, r]) for g, r in cols
        )
        + " |",
    ]
    for h in heuristics:
        lines.append(f"| {h} | " + " | ".join(f"{kl_of(g, h, r):.4f}" for g, r in cols) + " |")
    lines += [
        "",
        "Best heuristic per cell: "
        + ", ".join(f"{g} r = {r}: {best[g, r]}" for g, r in cols)
        + ".",
        "",
        "## Paired differences between granularities (KL of the first minus the second)",
        "",
        "| policy | pair | " + " | ".join(f"r = {r}" for r in ratios) + " |",
        "|---|---|" + "---|" * len(ratios),
    ]
    for i, a in enumerate(grans):
        for b in grans[i + 1 :]:
            diffs = [[x - y for x, y in zip(seeds[b, r], seeds[a, r], strict=True)] for r in ratios]
            cells = [" / ".join(f"{d:+.4f}" for d in ds) + f" ({mean_std(ds)})" for ds in diffs]
            lines.append(f"| ranker, per seed | `{b}` − `{a}` | " + " | ".join(cells) + " |")
            for h in heuristics:
                cells = [f"{kl_of(b, h, r) - kl_of(a, h, r):+.4f}" for r in ratios]
                lines.append(f"| {h} | `{b}` − `{a}` | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", type=Path, help="the ablation's folder (OUT of the script)")
    args = p.parse_args()
    kl = read(args.out)
    if not kl:
        p.error(f"no {args.out}/<granularity>/fidelity.json for {GRANULARITIES}")
    config = json.loads((args.out / next(iter(kl)) / "fidelity.json").read_text())["config"]
    (args.out / "README.md").write_text(report(kl, config))
    print(f"wrote {args.out / 'README.md'}")


if __name__ == "__main__":
    main()
