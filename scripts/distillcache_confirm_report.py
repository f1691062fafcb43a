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

Given several folders (the same runs on different windows), it pools them: each row's
per-window KL concatenated, kvpress's mean KL averaged over the folders (each holds as many
windows), the tables written to ``--out``; ``--goal`` adds each learned row's verdict
(``scripts/distillcache_prefill_pooled.sh``).

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
LABELS = {
    "global_nocap": "global, no floor or cap",
    "global_nocap_chat": "global, no floor or cap, kvzip's chat request",  # before session 40
}
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


def pool_runs(folders: list[Path], runs: list[str]) -> tuple[dict, list[str]]:
    """``read_runs`` over several folders: the cells complete in every folder, their
    per-window KL concatenated in folder order, and the runs missing anywhere (named with
    their folder when there are several)."""
    parts = [read_runs(folder, runs) for folder in folders]
    keys = set.intersection(*(set(cells) for cells, _ in parts))
    cells = {k: [x for part, _ in parts for x in part[k]] for k in keys}
    many = len(folders) > 1
    missing = [
        f"{f}/{m}" if many else m for f, (_, ms) in zip(folders, parts, strict=True) for m in ms
    ]
    return cells, missing


def read_kvpress(path: Path) -> dict:
    """{(method, ratio): mean KL} of kvpress's presses (empty without the file)."""
    if not path.exists():
        return {}
    rows = json.loads(path.read_text())["rows"]
    return {(r["method"], float(r["ratio"])): float(r["kl_mean"]) for r in rows}


def pool_kvpress(paths: list[Path]) -> dict:
    """``read_kvpress``'s means averaged over files of equally many windows; empty unless
    every file exists and has the same presses."""
    parts = [read_kvpress(p) for p in paths]
    if not all(parts) or any(set(p) != set(parts[0]) for p in parts):
        return {}
    return {k: mean(p[k] for p in parts) for k in parts[0]}


def verdicts(cells: dict, presses: dict, goal: float) -> list[str]:
    """One line per learned prefill row and ratio: met iff its mean KL is ≤ ``goal`` × the
    best heuristic's and ≤ ``goal`` × the best kvpress press's."""
    lines = []
    for proto, gran, pol, r in sorted(k for k in cells if k[0] == "prefill" and is_learned(k[2])):
        kl = mean(cells[(proto, gran, pol, r)])
        b_pol, b_gran, b_kl = best_heuristic(cells, proto, r)
        vs_h = kl / mean(b_kl)
        text = f"{vs_h:.3f}× {b_pol} ({b_gran})"
        ok = vs_h <= goal
        if presses:
            p_kl, method = min((v, m) for (m, rr), v in presses.items() if rr == r)
            text += f", {kl / p_kl:.3f}× kvpress {method}"
            ok = ok and kl / p_kl <= goal
        else:
            text += ", kvpress not measured"
        verdict = "**met**" if ok else "**not met**"
        lines.append(f"* {pol} ({gran}), r = {r}: {kl:.4f}: {text}: {verdict} (goal ≤ {goal}×)")
    return lines


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
    ap.add_argument("folders", type=Path, nargs="+", metavar="folder")
    ap.add_argument(
        "--runs",
        type=lambda text: text.split(","),
        default=all_runs(),
        help="the runs planned, comma-separated (default: all of distillcache_confirm.sh's)",
    )
    ap.add_argument(
        "--out",
        type=Path,
        help="the tables (default: FOLDER/tables.md; needed with several folders)",
    )
    ap.add_argument("--goal", type=float, help="add the learned prefill rows' verdicts")
    args = ap.parse_args()
    if args.out is None and len(args.folders) > 1:
        ap.error("--out: needed with several folders")
    out_path = args.out or args.folders[0] / "tables.md"
    cells, missing = pool_runs(args.folders, args.runs)
    presses = pool_kvpress([f / "kvpress.json" for f in args.folders])
    n = len(next(iter(cells.values()))) if cells else 0
    out = []
    for proto in PROTOCOLS:
        if not any(p == proto for p, *_ in cells):
            continue
        out += [f"## {proto} protocol", "", *protocol_table(cells, proto, presses), ""]
    out.append(
        f"Mean KL in nats per token over the {n} windows. Learned rows: (KL over the best "
        "heuristic of the protocol at that ratio, over every granularity run; windows of "
        f"{n} where the learned row's KL is below that heuristic's; in the prefill protocol, KL "
        "over the best kvpress press's mean KL at that ratio)."
    )
    if args.goal is not None:
        out += ["", "Verdicts:", "", *verdicts(cells, presses, args.goal)]
    if not presses and any(run.startswith("prefill") for run in args.runs):
        missing.append("kvpress")
    if missing:
        out += ["", "Runs not (yet) complete: " + ", ".join(missing) + "."]
    out_path.write_text("\n".join(out) + "\n")
    print("\n".join(out))


if __name__ == "__main__":
    main()
