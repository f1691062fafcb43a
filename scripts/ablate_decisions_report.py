"""The decisions ablation's report (``scripts/ablate_decisions.sh``): OUT/README.md.

Reads fidelity runs that differ only in their granularity (each the same ranker seed group
beside the same heuristics) and writes one table: KL per policy and granularity, the rankers'
mean ± std over seeds and their ratio to the best heuristic at the same granularity, and the
paired differences between granularities (same seed, same windows).

    .venv/bin/python scripts/ablate_decisions_report.py results/decision_ablation \
        results/decision_ablation/shared/fidelity.json results/training_ablation/fidelity.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from ablate_rl_report import mean_std, per_seed_kl, settings, windows_text

GRANULARITIES = {  # what the ranker's decision is at each granularity (jaxkv.policies.ranker)
    "shared": "once for the whole model (its scores averaged over every row)",
    "layer": "once per layer (averaged over the layer's KV heads)",
    "head": "per (layer, KV head) row (each row keeps its own top B)",
}


def read(paths: list[Path]) -> tuple[dict, dict]:
    """({granularity: {policy label: {ratio: {member: KL}}}}, the first run's config); exits
    if the runs differ in more than their granularity and policies."""
    docs = [json.loads(path.read_text()) for path in paths]
    ignore = ("policies", "granularity")
    if any(settings(doc, ignore) != settings(docs[0], ignore) for doc in docs):
        raise SystemExit(f"the runs {[str(p) for p in paths]} differ in more than granularity")
    kl = {doc["config"].get("granularity", "shared"): per_seed_kl(doc) for doc in docs}
    return kl, docs[0]["config"]


def report(kl: dict, config: dict) -> str:
    grans = sorted(kl, key=list(GRANULARITIES).index)
    labels = [label for label in kl[grans[0]] if all(label in kl[g] for g in grans)]
    ranker = next(label for label in labels if label.startswith("ranker:"))
    heuristics = [label for label in labels if label != ranker]
    ratios = sorted(kl[grans[0]][ranker], reverse=True)
    cols = [(g, r) for r in ratios for g in grans]

    def kl_of(g, label, r):
        return next(iter(kl[g][label][r].values()))

    best = {(g, r): min(heuristics, key=lambda h: kl_of(g, h, r)) for g, r in cols}
    seeds = {(g, r): [kl[g][ranker][r][m] for m in sorted(kl[g][ranker][r])] for g, r in cols}
    lines = [
        f"# Decisions ablation: {' vs '.join(grans)} (issue 14, deliverable 5)",
        "",
        "`bash scripts/ablate_decisions.sh`: the same supervised rankers "
        f"(`{ranker.removeprefix('ranker:')}`, from `scripts/ablate_training.sh`) decide "
        + "; ".join(f"`{g}`: {GRANULARITIES[g]}" for g in grans)
        + ". Beside them, the heuristics at the same granularity. The rankers were trained per "
        "row; averaging their scores is the only change. Decode protocol; "
        f"text {windows_text(config)}, B_min {config['min_budget']}. The ablation chooses "
        "nothing.",
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
    p.add_argument("out", type=Path, help="where README.md goes")
    p.add_argument(
        "runs", type=Path, nargs="+", help=f"fidelity.json of some of {list(GRANULARITIES)}"
    )
    args = p.parse_args()
    kl, config = read(args.runs)
    (args.out / "README.md").write_text(report(kl, config))
    print(f"wrote {args.out / 'README.md'}")


if __name__ == "__main__":
    main()
