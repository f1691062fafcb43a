"""The pooled retrieval test of results/distillcache_peak_tova/PROTOCOL.md (fixed in round 9,
before its data existed): over rounds 9-12 (retrieval data seeds 14-17, 16 prompts per cell
each), the look-up blend's correct answers per cell are summed and compared with the best
heuristic's, the heuristic run with the most correct answers over the same rounds in that cell
(h2o, critical:h2o and tova at ``global``; tova, h2o, critical:h2o and snapkv per head). The
goal counts as met if the blend's pooled count is at least the best heuristic's in all four
cells (needle and passkey at 1K / 2K, r = 0.25). With fewer rounds than ``--expect`` the
verdict is "pending": the partial pool is printed, and decides nothing.

Usage: python scripts/retrieval_pooled.py ROUND_DIR... [--expect 4] [--out FILE]
(each ROUND_DIR holds retrieval_global/retrieval.json and retrieval_head/retrieval.json)
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

BLEND = "blend@0.75:ranker:ranker_peak_tier_smollm2_cpu+tova"
HEURISTICS = {
    "global": ("h2o", "critical:h2o", "tova"),
    "head": ("tova", "h2o", "critical:h2o", "snapkv"),
}
CELLS = ("needle/1024", "needle/2048", "passkey/1024", "passkey/2048")
RATIO = 0.25

Counts = dict[str, tuple[int, int]]  # cell → (correct, prompts)


def run_counts(path: Path) -> dict[str, Counts]:
    """``{policy: {cell: (correct, prompts)}}`` at r = 0.25 of one finished retrieval run (one
    seed per prompt, so each row's accuracy × prompts is a whole count)."""
    data = json.loads(path.read_text())
    if not data["complete"]:
        raise SystemExit(f"{path}: the run did not finish")
    out: dict[str, Counts] = {}
    for row in data["results"]:
        if row["ratio"] == RATIO and row["task"] in CELLS:
            if row.get("n_seeds", 1) != 1:
                raise SystemExit(f"{path}: {row['policy']} ran {row['n_seeds']} seeds, not one")
            n = row["n_examples"]
            out.setdefault(row["policy"], {})[row["task"]] = (round(row["score"] * n / 100), n)
    return out


def pool(rounds: list[Path]) -> dict[tuple[str, str], Counts]:
    """``{(policy, granularity): {cell: (correct, prompts)}}`` summed over the rounds, for the
    blend (global) and every heuristic run of the rule; a run missing from a round is an
    error."""
    runs = [(BLEND, "global")] + [(h, g) for g, hs in HEURISTICS.items() for h in hs]
    total = {run: dict.fromkeys(CELLS, (0, 0)) for run in runs}
    for d in rounds:
        by_gran = {g: run_counts(d / f"retrieval_{g}" / "retrieval.json") for g in HEURISTICS}
        for policy, gran in runs:
            got = by_gran[gran].get(policy)
            if got is None or set(got) != set(CELLS):
                raise SystemExit(f"{d}: no complete {policy} run at {gran}")
            for cell, (c, n) in got.items():
                c0, n0 = total[(policy, gran)][cell]
                total[(policy, gran)][cell] = (c0 + c, n0 + n)
    return total


def verdict(total: dict[tuple[str, str], Counts], n_rounds: int, expect: int) -> tuple[str, dict]:
    """(the verdict, ``{cell: (best heuristic runs, their count)}``) by the rule."""
    best = {}
    for cell in CELLS:
        counts = {run: cs[cell][0] for run, cs in total.items() if run[0] != BLEND}
        top = max(counts.values())
        best[cell] = ([run for run, c in counts.items() if c == top], top)
    blend = total[(BLEND, "global")]
    met = all(blend[cell][0] >= best[cell][1] for cell in CELLS)
    if n_rounds < expect:
        return f"pending ({n_rounds} of {expect} rounds; the partial pool decides nothing)", best
    return ("met" if met else "not met"), best


def report(rounds: list[Path], expect: int) -> str:
    total = pool(rounds)
    result, best = verdict(total, len(rounds), expect)
    head = "| run | " + " | ".join(CELLS) + " |"
    lines = [
        "# The pooled retrieval test (PROTOCOL.md, round 9)",
        "",
        f"Rounds: {', '.join(d.name for d in rounds)}. Correct answers / prompts at r = {RATIO}, "
        "summed over the rounds.",
        "",
        head,
        "|---" * (len(CELLS) + 1) + "|",
    ]
    for (policy, gran), cs in total.items():
        name = f"**{policy}** (look-up blend)" if policy == BLEND else policy
        lines.append(
            f"| {name}, {gran} | " + " | ".join(f"{c} / {n}" for c, n in cs.values()) + " |"
        )
    runs = lambda rs: ", ".join(f"{p} {g}" for p, g in rs)
    lines.append("| best heuristic | " + " | ".join(f"{c} ({runs(r)})" for r, c in best.values()))
    lines[-1] += " |"
    lines += ["", f"Verdict: {result}."]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("rounds", nargs="+", type=Path)
    ap.add_argument("--expect", type=int, default=4, help="rounds the test pools")
    ap.add_argument("--out", type=Path, help="also write the report here")
    args = ap.parse_args()
    text = report(args.rounds, args.expect)
    print(text, end="")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(text)


if __name__ == "__main__":
    main()
