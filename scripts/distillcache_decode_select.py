"""The protocols' selection rule (results/distillcache_tier_wide/PROTOCOL.md,
results/distillcache_blend_decode/PROTOCOL.md, results/distillcache_peak/PROTOCOL.md,
results/distillcache_prefill_peak/PROTOCOL.md): a candidate is admissible if its KL over the
shipped policy's (``--base``, default the recall-tier ranker) has a geometric mean of at most
1.02 over the four training domains at r = 0.25; the admissible one with the lowest geometric
mean at r = 0.125 wins, and ships only if that mean is at most 0.97.

Usage: python scripts/distillcache_decode_select.py RESULTS_DIR CANDIDATE[=CHECKPOINT]...
[--ship DIR] [--base POLICY] [--protocol decode|prefill] (reads RESULTS_DIR/check_*/
fidelity.json; writes RESULTS_DIR/select.md; copies a winner's checkpoint to DIR; a candidate
without one, e.g. a blend, ships by name). The verdict is printed.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
from pathlib import Path

BASE = "ranker:ranker_recall_tier_smollm2_cpu"
ADMIT, SHIP = 1.02, 0.97  # geometric-mean bounds at r = 0.25 and r = 0.125
RATIOS = (0.25, 0.125)


def kl_ratios(
    results_dir: Path, policies: list[str], base: str = BASE
) -> dict[float, dict[str, list[float]]]:
    """``{r: {policy: [KL(policy) / KL(base)] over the domains}}`` from every ``check_*`` run."""
    out = {r: {p: [] for p in policies} for r in RATIOS}
    paths = sorted(results_dir.glob("check_*/fidelity.json"))
    if not paths:
        raise SystemExit(f"no check_*/fidelity.json under {results_dir}")
    for path in paths:
        data = json.loads(path.read_text())
        if not data["complete"]:
            raise SystemExit(f"{path}: the run did not finish")
        for r in RATIOS:
            kl = {row["policy"]: row["kl_mean"] for row in data["results"] if row["ratio"] == r}
            for p in policies:
                out[r][p].append(kl[p] / kl[base])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results_dir", type=Path)
    ap.add_argument("candidates", nargs="+", help="POLICY or POLICY=CHECKPOINT_DIR")
    ap.add_argument("--ship", type=Path, default=None, help="where a winner's checkpoint goes")
    ap.add_argument("--base", default=BASE, help="the shipped policy the candidates must beat")
    ap.add_argument("--protocol", default="decode", choices=("decode", "prefill"))
    args = ap.parse_args()
    paths = dict((*c.split("=", 1), None)[:2] for c in args.candidates)
    if args.ship is None and any(paths.values()):
        ap.error("candidates with checkpoints need --ship DIR")
    ratios = kl_ratios(args.results_dir, list(paths), args.base)
    gm = {r: {p: statistics.geometric_mean(v) for p, v in by.items()} for r, by in ratios.items()}
    admissible = [p for p in paths if gm[0.25][p] <= ADMIT]
    best = min(admissible, key=lambda p: gm[0.125][p]) if admissible else None
    if best is None:
        verdict = "no candidate is admissible: nothing ships, no held-out run"
    elif gm[0.125][best] > SHIP:
        verdict = (
            f"`{best}` is the best admissible candidate, but {gm[0.125][best]:.3f} > {SHIP}: "
            "nothing ships, no held-out run"
        )
    else:
        verdict = f"`{best}` wins and ships" + (f" as `{args.ship.name}`" if paths[best] else "")
    rows = [
        f"| `{p}` | {gm[0.25][p]:.3f} | {'yes' if p in admissible else 'no'} | "
        f"{gm[0.125][p]:.3f} | " + " ".join(f"{x:.3f}" for x in ratios[0.125][p]) + " |"
        for p in paths
    ]
    text = "\n".join(
        [
            f"# {args.protocol.capitalize()} candidates, chosen on the training domains "
            "(PROTOCOL.md)",
            "",
            f"KL over `{args.base}`'s, {args.protocol} protocol, global granularity, 4 windows of "
            "each training domain (chat, code, math, prose: the order of the last column).",
            "",
            f"| candidate | geometric mean, r = 0.25 | admissible (<= {ADMIT}) | "
            "geometric mean, r = 0.125 | per domain, r = 0.125 |",
            "|---|---|---|---|---|",
            *rows,
            "",
            f"Verdict: {verdict}.",
            "",
        ]
    )
    (args.results_dir / "select.md").write_text(text)
    won = best is not None and gm[0.125][best] <= SHIP
    if won and paths[best] and not args.ship.exists():
        shutil.copytree(Path(paths[best]), args.ship)
    print(text)


if __name__ == "__main__":
    main()
