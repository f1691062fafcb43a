"""Ablations of the supervised per-head ranker (``jaxkv.rl.ranker``, issue 14), over seeds.

Three arms, each against the shipped ranker's recipe (``RankerConfig(windows_per_domain=12,
steps=1500, target="value")``, the default 13 per-head features, per-row ListNet):

* features: the paper's 5 per head (``PAPER_FEATURES``) vs the default 13
  (``ranker_lib.DEFAULT_FEATURES``) vs all 14 (``ranker_lib.FEATURES``: + ``log_wo_vnorm``);
* pooling: ListNet per row (``pool=1``) vs over groups of 90 rows (``pool=90`` = L·K of
  SmolLM2-135M), both at ``rows_per_step=270`` so that only the pooling differs;
* target: future attention (``"attention"``) vs future attention times ``||v||`` (``"value"``).

Data. The rows are collected once per data seed (``ranker.collect_splits``, with the value
target) and every configuration is fitted on them (``ranker.fit``); another target is
recomputed from the rows' future attention (``ranker.weighted``), no re-collection. With
``--vary-data`` each seed collects its own windows and row subsample; without it the data of
seed 0 serves every seed, which then varies only the fit (initialization and row sampling).

Metrics, all on the validation windows of the training domains (``TRAIN_DOMAINS``; the
held-out domain is never read), mean over the 4 domains and 5 points: ``kept_r`` is the
share of the oracle's kept future mass (of the configuration's own target) that the
ranker's top-B per row keeps, B = r·P; ``kept_critical_r`` the same of the common yardstick
(future attention times ``||W_o v||_1``), ``kept_value_r`` / ``kept_attention_r`` of each
training target; ``*_attn_cum_*`` is H2O (accumulated attention) on the same rows.
``kept_pooled_r``: the same over groups of 90 rows of one point taken as one list (what a
pooled granularity keeps), over the 4 domains' validation rows together (one domain holds
too few for a group of 90), averaged over ``PERMUTATIONS`` random groupings.

Usage:
    python scripts/ablate_ranker.py --seeds 0,1,2
Writes results/ranker_ablation.{md,json} (the JSON also after every run, ``complete`` false).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path

import jax.numpy as jnp
import numpy as np
from tqdm import tqdm

from jaxkv.cli.flags import parse_seeds
from jaxkv.evals.report import write_atomic
from jaxkv.evals.runner import load_eval_model
from jaxkv.policies import ranker as ranker_lib
from jaxkv.rl import ranker
from jaxkv.rl.data import TRAIN_DOMAINS

PAPER_FEATURES = ("log_attn", "log_vnorm", "log_attn_var", "entropy", "pos_frac")
BASE = {"windows_per_domain": 12, "steps": 1500, "target": "value"}  # the shipped ranker's
POOL = 90
PERMUTATIONS = 16
RATIOS = (0.25, 0.125)
CONFIGS = {  # name -> RankerConfig fields over BASE
    "paper5": {"features": PAPER_FEATURES},
    "default13": {},
    "all14": {"features": ranker_lib.FEATURES},
    "pool1_rows270": {"rows_per_step": 270},
    "pool90_rows270": {"rows_per_step": 270, "pool": POOL},
    "target_attention": {"target": "attention"},
}
ARMS = {  # arm -> (configurations, the reference the others are differenced against)
    "features": (("paper5", "default13", "all14"), "default13"),
    "pooling": (("pool1_rows270", "pool90_rows270"), "pool1_rows270"),
    "target": (("target_attention", "default13"), "default13"),
}
LABELS = {
    "paper5": "paper's 5 per head",
    "default13": "default 13 (shipped)",
    "all14": "all 14 (+ log_wo_vnorm)",
    "pool1_rows270": "pool=1, 270 rows/step",
    "pool90_rows270": "pool=90, 270 rows/step",
    "target_attention": "target = attention",
}


def retarget(sets: list[ranker.RowSet], target: str) -> list[ranker.RowSet]:
    """The rows with ``target`` recomputed from their future attention and features."""
    return [dataclasses.replace(s, target=ranker.weighted(s.future, s.feats, target)) for s in sets]


def merge(per_domain: list[list[ranker.RowSet]]) -> list[ranker.RowSet]:
    """One RowSet per point, the domains' rows concatenated (full-cache rows only)."""
    return [s for s in ranker.merge_domains(per_domain) if s.pruned is None]


def scores(params, s: ranker.RowSet, cols: np.ndarray) -> np.ndarray:
    feats = jnp.asarray(s.feats[..., cols], jnp.float32)
    valid = jnp.ones(feats.shape[:-1], bool)
    return np.asarray(ranker_lib.scores_from_features(params, feats, valid))


def pooled_kept(scores_RC, target_RC, *, ratio: float, rng) -> float:
    """Mean kept mass over ``PERMUTATIONS`` random groupings of the rows into lists of
    ``POOL`` rows (the remainder of each grouping left out)."""
    n = len(scores_RC) // POOL * POOL
    kept = []
    for _ in range(PERMUTATIONS):
        idx = rng.permutation(len(scores_RC))[:n]
        s, t = ranker.pooled(scores_RC[idx], POOL), ranker.pooled(target_RC[idx], POOL)
        kept.append(ranker.kept_mass(s, t, ratio))
    return float(np.mean(kept))


def evaluate(params, val: list[list[ranker.RowSet]], cfg: ranker.RankerConfig) -> dict:
    """Every metric of the module docstring: name -> mean over domains (and points)."""
    cells = []
    for sets in val:
        sets = [s for s in retarget(sets, cfg.target) if s.pruned is None]
        rows = ranker.evaluate_rows(params, sets, cfg.columns)
        for s in sets:
            sc, h2o = scores(params, s, cfg.columns), s.feats[..., _CUM].astype(np.float32)
            for target in ("value", "attention"):
                t = ranker.weighted(s.future, s.feats, target)
                for r in RATIOS:
                    rows[s.name][f"kept_{target}_{r}"] = ranker.kept_mass(sc, t, r)
                    rows[s.name][f"kept_{target}_attn_cum_{r}"] = ranker.kept_mass(h2o, t, r)
            cells.append(rows[s.name])
    out = {k: float(np.mean([c[k] for c in cells])) for k in cells[0]}
    pooled = []
    for s in retarget(merge(val), cfg.target):
        sc, h2o = scores(params, s, cfg.columns), s.feats[..., _CUM].astype(np.float32)
        row = {}
        for r in RATIOS:  # the same groupings for every configuration and seed
            row[f"kept_pooled_{r}"] = pooled_kept(sc, s.target, ratio=r, rng=_rng(s.point))
            row[f"kept_pooled_attn_cum_{r}"] = pooled_kept(
                h2o, s.target, ratio=r, rng=_rng(s.point)
            )
        pooled.append(row)
    out |= {k: float(np.mean([p[k] for p in pooled])) for k in pooled[0]}
    out["val_rows"] = int(sum(len(s.target) for sets in val for s in sets))
    return out


_CUM = ranker_lib.FEATURES.index("log_attn_cum")


def _rng(point: int):
    return np.random.default_rng([1234, point])


def run_one(data: dict, name: str, *, seed: int, args) -> dict:
    """Fits configuration ``name`` with fit seed ``seed`` on ``data`` and evaluates it."""
    cfg = config(name, seed=seed, args=args)
    t0 = time.time()
    train = retarget(merge(data["train"]), cfg.target)
    params = ranker.fit(train, cfg)
    metrics = evaluate(params, data["val"], cfg)
    return {**metrics, "fit_seconds": round(time.time() - t0, 1)}


def config(name: str, *, seed: int, args) -> ranker.RankerConfig:
    fields = {**BASE, "steps": args.steps, "windows_per_domain": args.windows_per_domain}
    return ranker.RankerConfig(**{**fields, **CONFIGS[name], "seed": seed})


def summarize(runs: dict, seeds: list[int]) -> dict:
    """config -> metric -> {mean, std (ddof 1), per_seed}, plus paired differences to each
    arm's reference (same seed, same data): arm -> config -> metric -> the same."""
    summary = {}
    for name, per_seed in runs.items():
        done = [s for s in seeds if str(s) in per_seed]
        summary[name] = {
            k: _stats([per_seed[str(s)][k] for s in done], done)
            for k in per_seed[str(done[0])]
            if k != "val_rows"
        }
    diffs = {}
    for arm, (names, ref) in ARMS.items():
        diffs[arm] = {}
        for name in names:
            if name == ref or name not in runs or ref not in runs:
                continue
            done = [s for s in seeds if str(s) in runs[name] and str(s) in runs[ref]]
            a, b = runs[name], runs[ref]
            diffs[arm][name] = {
                k: _stats([a[str(s)][k] - b[str(s)][k] for s in done], done)
                for k in a[str(done[0])]
                if k.startswith("kept_") and "attn_cum" not in k and k in b[str(done[0])]
            }
    return {"configs": summary, "paired_diffs": diffs}


def _stats(values: list[float], seeds: list[int]) -> dict:
    v = np.asarray(values, np.float64)
    return {
        "mean": float(v.mean()),
        "std": float(v.std(ddof=1)) if len(v) > 1 else 0.0,
        "per_seed": dict(zip(map(str, seeds), map(float, v), strict=True)),
    }


def cell(stats: dict, *, digits: int = 4, seeds: bool = True) -> str:
    text = f"{stats['mean']:.{digits}f} ± {stats['std']:.{digits}f}"
    if seeds and len(stats["per_seed"]) > 1:
        text += " (" + ", ".join(f"{v:.{digits}f}" for v in stats["per_seed"].values()) + ")"
    return text


def markdown(result: dict) -> str:
    """The report: one table per arm, then its paired differences."""
    s, meta = result["summary"], result["meta"]
    lines = [
        "# Supervised ranker ablations (validation rows of the training domains)",
        "",
        "Each configuration of `jaxkv.rl.ranker` is fitted with seeds "
        f"{', '.join(map(str, meta['seeds']))} and scored on the **validation windows of the 4 "
        f"training domains** ({', '.join(TRAIN_DOMAINS)}; the held-out domain is never read). "
        "This is a ranking metric on recorded cache rows, not held-out KL or task accuracy.",
        "",
        "* `kept_r`: share of the oracle's top-B future mass (of the configuration's own "
        "training target) that the ranker's top-B per (layer, KV head) row keeps, B = r·P, "
        "mean over 4 domains × 5 points (P = 128 … 640). Not comparable across targets.",
        "* `kept_critical_r`: the same of the common yardstick, future attention × "
        "`||W_o v||_1` (CriticalKV's bound), comparable across every configuration.",
        "* `kept_value_r` / `kept_attention_r` (target arm): of either training target.",
        f"* `kept_pooled_r`: the same over lists of {POOL} rows of one point (= L·K, what a "
        "pooled granularity such as `global` ranks), the 4 domains' rows together, mean over "
        f"{PERMUTATIONS} random groupings.",
        "* H2O: the same metric for accumulated attention (`kept_*attn_cum*`) on the same rows; "
        "it depends on the data and target only, not on the fit seed.",
        "* Cells: mean ± std over seeds (sample std, ddof 1), then each seed's value in "
        "order. Δ rows: paired difference to the arm's reference, same seed and data.",
        "",
        f"Data: {meta['data']}. Base recipe: `RankerConfig({meta['base']})`; "
        f"{_span(meta['val_rows'].values())} validation rows (full cache) per seed.",
        "",
        f"Command: `{meta['command']}`  ",
        f"Wall time: {meta['wall_minutes']:.1f} min on {meta['machine']} "
        f"(data collection {meta['collect_minutes']:.1f} min).",
        "",
    ]
    arm_metrics = {
        "features": ("kept", "kept_critical", "kept_pooled"),
        "pooling": ("kept", "kept_critical", "kept_pooled"),
        "target": ("kept_value", "kept_attention", "kept_critical"),
    }
    for arm, (names, ref) in ARMS.items():
        names = [n for n in names if n in s["configs"]]
        if not names:
            continue
        cols = [f"{m}_{r}" for m in arm_metrics[arm] for r in RATIOS]
        lines += [f"## {arm}", "", "| config | " + " | ".join(f"`{c}`" for c in cols) + " |"]
        lines.append("|---" * (len(cols) + 1) + "|")
        for n in names:
            row = [cell(s["configs"][n][c]) for c in cols]
            lines.append(f"| {LABELS[n]} | " + " | ".join(row) + " |")
        for n, d in s["paired_diffs"].get(arm, {}).items():
            row = [cell(d[c]) if c in d else "" for c in cols]
            lines.append(f"| Δ {LABELS[n]} − {LABELS[ref]} | " + " | ".join(row) + " |")
        last = s["configs"][names[-1]]
        h2o_row = [cell(last[_h2o(c)], seeds=False) if _h2o(c) in last else "" for c in cols]
        lines += [f"| H2O (attn_cum), {LABELS[names[-1]]} rows | " + " | ".join(h2o_row) + " |"]
        lines.append("")
    lines += ["## Conclusions", "", result.get("conclusions", "(to be written)"), ""]
    return "\n".join(lines)


def _span(values) -> str:
    lo, hi = min(values), max(values)
    return str(lo) if lo == hi else f"{lo}–{hi}"


def _h2o(col: str) -> str:
    """The H2O key beside a ranker metric key: kept_x_r -> kept_x_attn_cum_r."""
    head, r = col.rsplit("_", 1)
    return f"{head}_attn_cum_{r}"


def render(out: Path, conclusions: Path | None) -> int:
    """Rewrites ``out``.md from ``out``.json (of an interrupted run: the seeds every
    configuration finished), with ``conclusions`` if given."""
    result = json.loads(out.with_suffix(".json").read_text())
    if not result.get("complete"):  # an interrupted run: the seeds every configuration has
        runs = result["runs"]
        seeds = [s for s in result["meta"]["seeds"] if all(str(s) in r for r in runs.values())]
        result["meta"]["seeds"] = seeds
        result["meta"]["data"] += " (interrupted: the seeds every configuration finished)"
        result["summary"] = summarize(runs, seeds)
    if conclusions:
        result["conclusions"] = conclusions.read_text().strip()
        write_atomic(out.with_suffix(".json"), json.dumps(result, indent=1))
    write_atomic(out.with_suffix(".md"), markdown(result))
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=parse_seeds, default=[0, 1, 2])
    ap.add_argument("--steps", type=int, default=BASE["steps"])
    ap.add_argument("--windows-per-domain", type=int, default=BASE["windows_per_domain"])
    ap.add_argument("--out", type=Path, default=Path("results/ranker_ablation"))
    ap.add_argument(
        "--configs",
        default=",".join(CONFIGS),
        help=f"comma list of configurations to run, some of {', '.join(CONFIGS)}",
    )
    ap.add_argument(
        "--vary-data",
        action="store_true",
        help="collect each seed's own windows (default: seed 0's data for every seed)",
    )
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--conclusions", type=Path, help="a markdown file for the Conclusions")
    ap.add_argument(
        "--render",
        action="store_true",
        help="only rewrite the markdown from the JSON at --out (with --conclusions)",
    )
    args = ap.parse_args()
    if args.render:
        return render(args.out, args.conclusions)
    names = [n.strip() for n in args.configs.split(",") if n.strip()]
    if unknown := set(names) - set(CONFIGS):
        ap.error(f"unknown configs {sorted(unknown)}; valid: {', '.join(CONFIGS)}")
    for n in names:
        config(n, seed=0, args=args)  # validates before the long part

    t0 = time.time()
    model = load_eval_model(args.model)
    json_path, md_path = args.out.with_suffix(".json"), args.out.with_suffix(".md")
    json_path.parent.mkdir(parents=True, exist_ok=True)
    runs: dict[str, dict[str, dict]] = {n: {} for n in names}
    data, collect_seconds, val_rows = None, 0.0, {}
    meta = {
        "command": "python scripts/ablate_ranker.py " + " ".join(sys.argv[1:]),
        "seeds": args.seeds,
        "configs": {n: CONFIGS[n] for n in names},
        "base": ", ".join(
            f"{k}={v!r}"
            for k, v in {
                **BASE,
                "steps": args.steps,
                "windows_per_domain": args.windows_per_domain,
            }.items()
        ),
        "data": (
            "collected per seed (windows and row subsample vary with the seed)"
            if args.vary_data
            else "collected once with seed 0; the seeds vary the fit only (init, row sampling)"
        ),
        "machine": f"CPU ({os.cpu_count()} cores, shared)",
        "model": args.model,
        "domains": list(TRAIN_DOMAINS),
    }
    bar = tqdm(total=len(names) * len(args.seeds), desc="ablation configs")
    for seed in args.seeds:
        if data is None or args.vary_data:
            t1 = time.time()
            data_cfg = config("default13", seed=seed if args.vary_data else 0, args=args)
            assert data_cfg.domains == TRAIN_DOMAINS  # the held-out domain is never read
            data = ranker.collect_splits(model, data_cfg)
            collect_seconds += time.time() - t1
        val_rows[str(seed)] = sum(len(s.target) for sets in data["val"] for s in sets)
        for n in names:
            bar.set_postfix(seed=seed, config=n)
            runs[n][str(seed)] = run_one(data, n, seed=seed, args=args)
            meta |= {
                "wall_minutes": (time.time() - t0) / 60,
                "collect_minutes": collect_seconds / 60,
                "val_rows": val_rows,
            }
            partial = {"complete": False, "meta": meta, "runs": runs}
            write_atomic(json_path, json.dumps(partial, indent=1))
            bar.update()
    bar.close()
    meta |= {
        "wall_minutes": (time.time() - t0) / 60,
        "collect_minutes": collect_seconds / 60,
        "val_rows": val_rows,
    }
    result = {
        "complete": True,
        "meta": meta,
        "summary": summarize(runs, args.seeds),
        "runs": runs,
    }
    if args.conclusions:
        result["conclusions"] = args.conclusions.read_text().strip()
    write_atomic(json_path, json.dumps(result, indent=1))
    write_atomic(md_path, markdown(result))
    print(f"wrote {md_path} and {json_path} in {meta['wall_minutes']:.1f} min")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
