"""The tuning rule of results/distillcache_blend/PROTOCOL.md: the blend weight w with the lowest
geometric mean, over the training domains × budget ratios, of its KL over kvzip's.

Usage: python scripts/distillcache_blend_choose.py RESULTS_DIR   (reads RESULTS_DIR/tune_*/)
Writes RESULTS_DIR/choice.md and prints the chosen w.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from jaxkv.policies import rerank


def weight_of(policy: str) -> float | None:
    """The blend weight of a ``rerank`` policy name; None for kvzip."""
    return None if policy == "kvzip" else rerank.parse(policy)[0]


def ratios(results_dir: Path) -> dict[tuple[str, float], dict[float, float]]:
    """``{(domain, r): {w: KL(w) / KL(kvzip)}}`` from every ``tune_<domain>`` run."""
    out = {}
    for path in sorted(results_dir.glob("tune_*/fidelity.json")):
        data = json.loads(path.read_text())
        if not data["complete"]:
            raise SystemExit(f"{path}: the run did not finish")
        domain = path.parent.name.removeprefix("tune_")
        for r in sorted({row["ratio"] for row in data["results"]}):
            kl = {weight_of(row["policy"]): row["kl_mean"] for row in data["results"]
                  if row["ratio"] == r}  # fmt: skip
            out[domain, r] = {w: v / kl[None] for w, v in kl.items() if w is not None}
    if not out:
        raise SystemExit(f"no tune_*/fidelity.json under {results_dir}")
    return out


def choose(cells: dict[tuple[str, float], dict[float, float]]) -> tuple[float, dict[float, float]]:
    """The w of the lowest geometric-mean ratio, and every w's geometric mean."""
    weights = sorted(set.intersection(*(set(c) for c in cells.values())))
    geo = {w: math.exp(sum(math.log(c[w]) for c in cells.values()) / len(cells)) for w in weights}
    return min(geo, key=geo.get), geo


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results_dir", type=Path)
    args = parser.parse_args(argv)
    cells = ratios(args.results_dir)
    best, geo = choose(cells)
    weights = sorted(geo)
    lines = [
        "# Blend weight chosen on the training domains (PROTOCOL.md's rule)",
        "",
        "KL of `rerank@<w>:ranker:ranker_kvzip_smollm2_cpu` over kvzip's, prefill protocol, "
        "global granularity, default allocation; 4 windows per domain.",
        "",
        "| domain | r | " + " | ".join(f"w = {w:g}" for w in weights) + " |",
        "|---|---|" + "---|" * len(weights),
        *(
            f"| {d} | {r:g} | " + " | ".join(f"{c[w]:.3f}" for w in weights) + " |"
            for (d, r), c in sorted(cells.items())
        ),  # fmt: skip
        "| **geometric mean** | | " + " | ".join(f"**{geo[w]:.3f}**" for w in weights) + " |",
        "",
        f"Chosen: **w = {best:g}**.",
    ]
    (args.results_dir / "choice.md").write_text("\n".join(lines) + "\n")
    print(best)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
