"""The rule of results/distillcache_peak_tova/PROTOCOL.md: a candidate is admissible if its KL
over the base policy's has a geometric mean of at most 1.15 over the four training domains at
r = 0.25 and at r = 0.125; the admissible one with the highest mean retrieval accuracy on data
seed 6 wins (ties: the lower geometric mean at r = 0.125) and is chosen only if it is at least
TOVA per head's accuracy in every retrieval cell.

Usage: python scripts/distillcache_peak_tova_select.py DEV_DIR CANDIDATE... --base POLICY
[--tova-head JSON] (reads DEV_DIR/check_*/fidelity.json and DEV_DIR/retrieval_global/
retrieval.json; writes DEV_DIR/select.md and, for a chosen candidate, DEV_DIR/chosen.txt).
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from distillcache_decode_select import RATIOS, kl_ratios

ADMIT = 1.15  # geometric-mean bound on KL(candidate) / KL(base), at both ratios
TOVA_HEAD = "results/distillcache_peak/retrieval_head/retrieval.json"  # seed 6, session 24


def accuracies(path: Path, ratio: float = 0.25) -> dict[str, dict[str, float]]:
    """``{policy: {task/length: accuracy %}}`` at ``ratio`` from a finished retrieval run."""
    data = json.loads(path.read_text())
    if not data["complete"]:
        raise SystemExit(f"{path}: the run did not finish")
    out: dict[str, dict[str, float]] = {}
    for row in data["results"]:
        if row["ratio"] == ratio:
            out.setdefault(row["policy"], {})[row["task"]] = row["score"]
    return out


def mean_accuracy(acc_policy: dict[str, float], tasks) -> float:
    """A policy's mean accuracy over the retrieval cells ``tasks``."""
    return statistics.fmean(acc_policy[t] for t in tasks)


def choose(gm: dict, acc: dict, tova: dict, candidates: list[str]) -> tuple[str | None, list]:
    """(the chosen candidate or None, the admissible ones) by the rule."""
    admissible = [p for p in candidates if all(gm[r][p] <= ADMIT for r in RATIOS)]
    ranked = sorted(admissible, key=lambda p: (-mean_accuracy(acc[p], tova), gm[0.125][p]))
    if not ranked:
        return None, admissible
    best = ranked[0]
    return (best if all(acc[best][t] >= tova[t] for t in tova) else None), admissible


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dev_dir", type=Path)
    ap.add_argument("candidates", nargs="+")
    ap.add_argument("--base", required=True, help="the shipped policy the KL is relative to")
    ap.add_argument("--tova-head", type=Path, default=Path(TOVA_HEAD))
    args = ap.parse_args()
    ratios = kl_ratios(args.dev_dir, args.candidates, args.base)
    gm = {r: {p: statistics.geometric_mean(v) for p, v in by.items()} for r, by in ratios.items()}
    acc = accuracies(args.dev_dir / "retrieval_global" / "retrieval.json")
    tova = accuracies(args.tova_head)["tova"]
    chosen, admissible = choose(gm, acc, tova, args.candidates)
    tasks = sorted(tova)
    lines = [
        f"Selection (results/distillcache_peak_tova/PROTOCOL.md). KL over `{args.base}`: "
        "geometric mean over the four training domains; retrieval accuracy (%) on data seed 6 "
        "at r = 0.25, global granularity; TOVA per head on the same prompts: "
        + ", ".join(f"{t} {tova[t]:g}" for t in tasks)
        + ".",
        "",
        "| candidate | KL ratio r = 0.25 | KL ratio r = 0.125 | admissible | "
        + " | ".join(tasks)
        + " | mean |",
        "|---|---|---|---|" + "---|" * (len(tasks) + 1),
    ]
    for p in args.candidates:
        cells = " | ".join(f"{acc[p][t]:g}" for t in tasks)
        lines.append(
            f"| {p} | {gm[0.25][p]:.3f} | {gm[0.125][p]:.3f} | {p in admissible} | {cells} "
            f"| {mean_accuracy(acc[p], tasks):.1f} |"
        )
    verdict = f"chosen: `{chosen}`" if chosen else "nothing chosen: the held-out data stays unread"
    lines += ["", f"**{verdict}**"]
    (args.dev_dir / "select.md").write_text("\n".join(lines) + "\n")
    if chosen:
        (args.dev_dir / "chosen.txt").write_text(chosen + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
