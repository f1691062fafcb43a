"""The tables of results/distillcache_confirm/ (``scripts/distillcache_confirm.sh``).

Reads every ``<protocol>_<granularity>/fidelity.json`` under the folder (``global_nocap``:
global without a floor or cap) and kvpress's rows (``kvpress.json``, copied from the
comparison's run folder), and writes README.md's tables into ``tables.md``: for each protocol,
every (policy, granularity) row's mean KL at each ratio, the best jaxkv heuristic over every
granularity and allocation (kvzip counts as one; ``oracle`` is the bound and the learned
policies are not heuristics), and each learned row's KL over it with the number of windows (of
8) where the learned row is below that heuristic's own KL, then over the best kvpress press.
Runs that are missing are named, not skipped silently; ``--runs`` names the runs a protocol
planned when it is not all of them (``scripts/distillcache_tier_wide.sh``: decode at global,
head and layer, no kvpress); ``<protocol>_<granularity>-<tag>`` runs add their ratios' cells to
that granularity (``scripts/distillcache_periodic.sh``: one run per ratio).

    .venv/bin/python scripts/distillcache_confirm_report.py results/distillcache_confirm
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from statistics import fmean as mean

from jaxkv.policies import LEARNED_PREFIX, RANKER_PREFIX, RERANK_PREFIXES, rerank

PROTOCOLS = ("decode", "prefill")
GRANULARITIES = ("global", "head", "adaptive", "layer", "shared")
PREFILL_ONLY = ("global_nocap",)  # runs of the prefill protocol alone
LABELS = {"global_nocap": "global, no floor or cap"}
LEARNED = (LEARNED_PREFIX, RANKER_PREFIX, *RERANK_PREFIXES)
RATIOS = (0.25, 0.125)


def is_learned(policy: str) -> bool:
    """A learned row: a learned or ranker policy, a rerank, or a blend or tier with a learned
    part."""
    mixed = policy.startswith(rerank.MIXES) and any(
        p in policy for p in (LEARNED_PREFIX, RANKER_PREFIX)
    )
    return policy.startswith(LEARNED) or mixed


def all_runs() -> list[str]:
    """Every ``<protocol>_<granularity>`` run of distillcache_confirm.sh."""
    return [
        f"{proto}_{gran}"
        for proto in PROTOCOLS
        for gran in GRANULARITIES + (PREFILL_ONLY if proto == "prefill" else ())
    ]


def read_runs(folder: Path, runs: list[str]) -> tuple[dict, list[str]]:
    """{(protocol, granularity, policy, ratio): per-window KL} and the runs not found."""
    cells, missing = {}, []
    for run in runs:
        proto, gran = run.split("_", 1)
        gran = gran.split("-")[0]  # decode_global-r0.25: one ratio's run of a granularity
        path = folder / run / "fidelity.json"
        doc = json.loads(path.read_text()) if path.exists() else {}
        if not doc.get("complete"):
            missing.append(run)
            continue
        for rec in doc["records"]:
            key = (proto, LABELS.get(gran, gran), rec["policy"], rec["ratio"])
            cells[key] = rec["kl_per_window"]
    return cells, missing


def best_heuristic(cells: dict, proto: str, ratio: float) -> tuple[str, str, list[float]]:
    """(policy, granularity, per-window KL) of the lowest mean KL among the heuristics."""
    rows = [
        (mean(kl), pol, gran, kl)
        for (p, gran, pol, r), kl in cells.items()
        if p == proto and r == ratio and not is_learned(pol) and pol not in ("oracle", "full")
    ]
    _, pol, gran, kl = min(rows)
    return pol, gran, kl


def read_kvpress(path: Path) -> dict:
    """{(method, ratio): mean KL} of kvpress's presses (empty without the file)."""
    if not path.exists():
        return {}
    rows = json.loads(path.read_text())["rows"]
    return {(r["method"], float(r["ratio"])): float(r["kl_mean"]) for r in rows}


def protocol_table(cells: dict, proto: str, presses: dict) -> list[str]:
    best = {r: best_heuristic(cells, proto, r) for r in RATIOS}
    press = {}  # ratio → (mean KL, method) of the best kvpress press (prefill protocol)
    if presses and proto == "prefill":
        press = {r: min((kl, m) for (m, rr), kl in presses.items() if rr == r) for r in RATIOS}
    head = "| policy | granularity | " + " | ".join(f"r = {r}" for r in RATIOS) + " |"
    lines = [head, "|---|---|" + "---|" * len(RATIOS)]
    rows = sorted(
        {(pol, gran) for (p, gran, pol, _) in cells if p == proto},
        key=lambda pg: mean(cells[(proto, pg[1], pg[0], RATIOS[0])]),
    )
    for pol, gran in rows:
        parts = []
        for r in RATIOS:
            kl = cells[(proto, gran, pol, r)]
            text = f"{mean(kl):.4f}"
            b_pol, b_gran, b_kl = best[r]
            if is_learned(pol):
                wins = sum(a < b for a, b in zip(kl, b_kl, strict=True))
                text = f"**{text}** ({mean(kl) / mean(b_kl):.2f}×, {wins}/{len(kl)}"
                text += f"; {mean(kl) / press[r][0]:.2f}× kvpress)" if press else ")"
            elif (pol, gran) == (b_pol, b_gran):
                text = f"_{text}_ (best heuristic)"
            parts.append(text)
        name = f"**{pol}**" if is_learned(pol) else pol
        lines.append(f"| {name} | {gran} | " + " | ".join(parts) + " |")
    for method in sorted({m for m, _ in presses}) if press else []:
        kls = [presses.get((method, r)) for r in RATIOS]
        parts = [f"{kl:.4f}" if kl is not None else "–" for kl in kls]
        lines.append(f"| kvpress {method} | its own | " + " | ".join(parts) + " |")
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder", type=Path)
    ap.add_argument(
        "--runs",
        type=lambda text: text.split(","),
        default=all_runs(),
        help="the runs planned, comma-separated (default: all of distillcache_confirm.sh's)",
    )
    args = ap.parse_args()
    cells, missing = read_runs(args.folder, args.runs)
    presses = read_kvpress(args.folder / "kvpress.json")
    out = []
    for proto in PROTOCOLS:
        if not any(p == proto for p, *_ in cells):
            continue
        out += [f"## {proto} protocol", "", *protocol_table(cells, proto, presses), ""]
    out.append(
        "Mean KL in nats per token over the 8 windows. Learned rows: (KL over the best "
        "heuristic of the protocol at that ratio, over every granularity run; windows of 8 where "
        "the learned row's KL is below that heuristic's; in the prefill protocol, KL over the "
        "best kvpress press's mean KL at that ratio)."
    )
    if not presses and any(run.startswith("prefill") for run in args.runs):
        missing.append("kvpress")
    if missing:
        out += ["", "Runs not (yet) complete: " + ", ".join(missing) + "."]
    (args.folder / "tables.md").write_text("\n".join(out) + "\n")
    print("\n".join(out))


if __name__ == "__main__":
    main()
