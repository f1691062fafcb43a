"""The selection rule of results/retrieval_tier/PROTOCOL.md: among the recall ranker's tiered
candidates whose KL over the untiered ranker's has a geometric mean (four training domains x two
budget ratios) of at most 1.03, the one with the most retrieval successes on data seed 0 wins;
ties go to the lower geometric mean.

Usage: python scripts/retrieval_tier_select.py RESULTS_DIR CANDIDATE=CHECKPOINT... SHIPPED
(reads RESULTS_DIR/check_*/fidelity.json and RESULTS_DIR/design_head/retrieval.json; writes
RESULTS_DIR/select.md; copies the winner's checkpoint to SHIPPED unless the winner is
already shipped, i.e. its checkpoint lies in jaxkv/checkpoints). The verdict is printed.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
from pathlib import Path

BOUND = 1.03
BASE = "ranker:ranker_recall_smollm2_cpu"


def _complete(path: Path) -> dict:
    data = json.loads(path.read_text())
    if not data["complete"]:
        raise SystemExit(f"{path}: the run did not finish")
    return data


def kl_ratios(results_dir: Path, policies: list[str]) -> dict[str, list[float]]:
    """``{policy: [KL(policy) / KL(untiered)] over (domain, r)}`` from every ``check_*`` run."""
    out = {p: [] for p in policies}
    paths = sorted(results_dir.glob("check_*/fidelity.json"))
    if not paths:
        raise SystemExit(f"no check_*/fidelity.json under {results_dir}")
    for path in paths:
        rows = _complete(path)["results"]
        for r in sorted({row["ratio"] for row in rows}):
            kl = {row["policy"]: row["kl_mean"] for row in rows if row["ratio"] == r}
            for p in policies:
                out[p].append(kl[p] / kl[BASE])
    return out


def successes(results_dir: Path, policies: list[str]) -> dict[str, float]:
    """Retrieval successes (score x examples / 100) summed over the design run's cells."""
    rows = _complete(results_dir / "design_head" / "retrieval.json")["results"]
    return {
        p: sum(row["score"] * row["n_examples"] / 100 for row in rows if row["policy"] == p)
        for p in policies
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results_dir", type=Path)
    ap.add_argument("candidates", nargs="+", help="POLICY=CHECKPOINT_DIR")
    ap.add_argument("shipped", type=Path)
    args = ap.parse_args()
    paths = dict(c.split("=", 1) for c in args.candidates)
    ratios = kl_ratios(args.results_dir, list(paths))
    gm = {p: math.exp(sum(map(math.log, v)) / len(v)) for p, v in ratios.items()}
    hits = successes(args.results_dir, list(paths))
    admissible = [p for p in paths if gm[p] <= BOUND]
    winner = min(admissible, key=lambda p: (-hits[p], gm[p])) if admissible else None
    rows = [
        f"| `{p}` | {gm[p]:.3f} | {'yes' if gm[p] <= BOUND else 'no'} | {hits[p]:g} |"
        for p in paths
    ]
    src = Path(paths[winner]) if winner else None
    already = src is not None and src.parent.name == "checkpoints"
    if winner is None:
        verdict = "no candidate is admissible: nothing ships, no held-out run"
    elif already:
        verdict = f"`{winner}` wins; it is already shipped: no held-out run"
    else:
        verdict = f"`{winner}` wins and ships as `{args.shipped.name}`"
    text = "\n".join(
        [
            "# The attended tier's size, chosen on training domains and read prompts (PROTOCOL.md)",
            "",
            "Geometric mean over 4 training domains x r in {0.25, 0.125} of KL over "
            f"`{BASE}`'s (decode protocol, global granularity, 4 windows per domain), and "
            "retrieval successes on data seed 0 (passkey and needle at 1K / 2K, r = 0.25, "
            "8 examples per cell, head granularity; 32 at most).",
            "",
            "| candidate | KL ratio, geometric mean | admissible (<= 1.03) | retrievals |",
            "|---|---|---|---|",
            *rows,
            "",
            f"Verdict: {verdict}.",
            "",
        ]
    )
    (args.results_dir / "select.md").write_text(text)
    if winner and not already and not args.shipped.exists():
        shutil.copytree(src, args.shipped)
    print(text)


if __name__ == "__main__":
    main()
