"""The shipping rule of results/retrieval_attended/PROTOCOL.md: the recall ranker with the
attended tier ships when the geometric mean, over the four training domains x two budget
ratios, of its KL over the untiered recall ranker's is at most 1.03.

Usage: python scripts/retrieval_attended_check.py RESULTS_DIR STAGED SHIPPED
(reads RESULTS_DIR/check_*/fidelity.json; writes RESULTS_DIR/check.md; copies the STAGED
checkpoint to SHIPPED when the rule passes). Exit status 0 either way; the verdict is printed.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
from pathlib import Path

BOUND = 1.03
BASE = "ranker:ranker_recall_smollm2_cpu"


def cells(results_dir: Path) -> dict[tuple[str, float], float]:
    """``{(domain, r): KL(tiered) / KL(untiered)}`` from every ``check_<domain>`` run."""
    out = {}
    for path in sorted(results_dir.glob("check_*/fidelity.json")):
        data = json.loads(path.read_text())
        if not data["complete"]:
            raise SystemExit(f"{path}: the run did not finish")
        domain = path.parent.name.removeprefix("check_")
        for r in sorted({row["ratio"] for row in data["results"]}):
            kl = {row["policy"]: row["kl_mean"] for row in data["results"] if row["ratio"] == r}
            (tiered,) = [p for p in kl if p != BASE]
            out[domain, r] = kl[tiered] / kl[BASE]
    if not out:
        raise SystemExit(f"no check_*/fidelity.json under {results_dir}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results_dir", type=Path)
    ap.add_argument("staged", type=Path)
    ap.add_argument("shipped", type=Path)
    args = ap.parse_args()
    ratios = cells(args.results_dir)
    gm = math.exp(sum(map(math.log, ratios.values())) / len(ratios))
    ships = gm <= BOUND
    rows = [f"| {d} | {r:g} | {v:.3f} |" for (d, r), v in sorted(ratios.items())]
    verdict = f"ships as `{args.shipped.name}`" if ships else "does not ship"
    text = "\n".join(
        [
            "# The attended tier on the training domains (PROTOCOL.md's rule)",
            "",
            f"KL of the recall ranker with `attended_fraction` 0.125 over `{BASE}`'s, decode "
            "protocol, global granularity, 4 windows per domain.",
            "",
            "| domain | r | KL ratio |",
            "|---|---|---|",
            *rows,
            f"| **geometric mean** | | **{gm:.3f}** |",
            "",
            f"Bound {BOUND}: the candidate **{verdict}**.",
            "",
        ]
    )
    (args.results_dir / "check.md").write_text(text)
    if ships and not args.shipped.exists():
        shutil.copytree(args.staged, args.shipped)
    print(text)


if __name__ == "__main__":
    main()
