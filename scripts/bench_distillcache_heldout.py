"""The learned eviction policies against every heuristic on a domain no training or tuning read.

The held-out domain is ``jaxkv.rl.data.HELDOUT_DOMAIN`` (BIG-Bench Hard: chain-of-thought
prompts, questions and answers of all 27 tasks, interleaved task by task). For each protocol
(``decode``: evict every step; ``prefill``: compress once after the prompt) and granularity,
``python -m jaxkv.eval fidelity`` runs every policy at r = 0.25 and 0.125 on the same windows
(``--window`` tokens, the first ``--prompt-len`` prefilled), and one joint table ranks them per
cell, with each learned policy's KL over the best heuristic's (the issue-14 goal: <= 0.85). The
oracle (future attention under the full cache) is the upper bound, never a competitor.

Usage:
    python scripts/bench_distillcache_heldout.py --ranker jaxkv/checkpoints/ranker_smollm2_cpu
    python scripts/bench_distillcache_heldout.py \
        --ranker jaxkv/checkpoints/ranker_global_smollm2_cpu --kvzip \
        --granularities head,adaptive,global --ranker-granularities global,head \
        --work runs/distillcache_heldout_pooled --out results/distillcache_heldout_pooled
Writes results/distillcache_heldout.{md,json} (and each fidelity run under --work). The best
heuristic of a cell is the best over every granularity run.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from jaxkv.cli import eval as eval_cli
from jaxkv.evals.runner import load_eval_model
from jaxkv.policies import get_policy
from jaxkv.rl.data import HELDOUT_DOMAIN, write_domain_text

EVERYWHERE = (  # heuristics run in every cell
    "streaming_llm",
    "h2o",
    "snapkv",
    "tova",
    "knorm",
    "expected_attention",
    "critical:h2o",
)
OPTIONAL = ("kvzip",)  # heuristics run on request (--kvzip): one more forward pass
HEURISTICS = (*OPTIONAL, *EVERYWHERE)
SHARED_LEARNED = "learned:distillcache_smollm2_cpu"  # one decision for all heads: shared only
RATIOS = (0.25, 0.125)


def run_cell(text: Path, *, protocol: str, granularity: str, policies: list[str], args, out):
    """One fidelity run's results; a complete earlier run of the same settings in ``out`` is
    read back instead (an interrupted benchmark resumes where it stopped)."""
    argv = [
        "fidelity", "--text", str(text), "--heldout", "1", "--limit", str(args.limit),
        "--window", str(args.window), "--prompt-len", str(args.prompt_len),
        "--protocol", protocol, "--granularity", granularity,
        "--ratios", ",".join(map(str, RATIOS)), "--policies", ",".join(policies),
        "--out", str(out),
    ]  # fmt: skip
    done = out / "fidelity.json"
    if done.exists():
        old = json.loads(done.read_text())
        if old.get("complete") and old["config"].get("policies") == ",".join(policies):
            return old["results"]
    if eval_cli.main(argv) != 0:
        raise SystemExit(f"fidelity failed: {' '.join(argv)}")
    return json.loads(done.read_text())["results"]


def label(policy: str, rankers: list[str]) -> str:
    """A row's policy name: "ranker" for the one ranker benchmarked, or with several each
    by its folder's name."""
    if len(rankers) == 1 and policy == f"ranker:{rankers[0]}":
        return "ranker"
    return f"ranker:{Path(policy[7:]).name}" if policy.startswith("ranker:") else policy


def render(rows: list[dict], meta: dict) -> str:
    lines = [
        "# Learned eviction on a held-out domain",
        "",
        f"Held-out domain: **{meta['domain']}** (BIG-Bench Hard; never read by training or "
        f"tuning). Model `smollm2-135m`; {meta['limit']} windows of {meta['window']} tokens, "
        f"the first {meta['prompt_len']} prefilled; mean per-step KL(P_full || P_pruned) in "
        f"nats over the rest (teacher forcing). Ranker: `{meta['ranker']}`. "
        f"`python scripts/bench_distillcache_heldout.py` ({meta['minutes']:.0f} min).",
        "",
    ]
    for protocol in meta["protocols"]:
        for r in RATIOS:
            cell = [x for x in rows if x["protocol"] == protocol and x["ratio"] == r]
            heur = [x for x in cell if x["policy"] in HEURISTICS]
            best = min(heur, key=lambda x: x["kl"])
            lines += [
                f"## {protocol} protocol, r = {r}",
                "",
                "| policy | granularity | KL | / best heuristic |",
                "|---|---|---|---|",
            ]
            for x in sorted(cell, key=lambda x: x["kl"]):
                tag = " (upper bound)" if x["policy"] == "oracle" else ""
                lines.append(
                    f"| {x['policy']}{tag} | {x['granularity']} | {x['kl']:.4f} | "
                    f"{x['kl'] / best['kl']:.3f} |"
                )
            lines += ["", f"Best heuristic: {best['policy']} ({best['granularity']}).", ""]
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--ranker",
        required=True,
        action="append",
        help="ranker checkpoint folder (repeat for several; each runs in the protocols it "
        "supports)",
    )
    ap.add_argument("--granularities", default="head", help="comma list for the heuristics")
    ap.add_argument(
        "--ranker-granularities",
        default="head",
        help="comma list for the ranker (adaptive, global: a ranker trained with --pool > 1)",
    )
    ap.add_argument(
        "--kvzip", action="store_true", help="also kvzip, a heuristic of the prefill protocol"
    )
    ap.add_argument("--protocols", default="prefill,decode")
    ap.add_argument("--limit", type=int, default=4)
    ap.add_argument("--window", type=int, default=384)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--work", default="runs/distillcache_heldout")
    ap.add_argument("--out", default="results/distillcache_heldout")
    args = ap.parse_args()
    t0 = time.time()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    model = load_eval_model("smollm2-135m")
    text = write_domain_text(HELDOUT_DOMAIN, work / "heldout.txt", tokenizer=model.tokenizer)
    protocols = args.protocols.split(",")
    rows = []
    granularities = args.granularities.split(",")
    optional = [x for x in OPTIONAL if getattr(args, x)]
    cells = [
        *[(p, g, [*EVERYWHERE, "oracle"]) for p in protocols for g in granularities],
        *[  # in the protocols it supports (kvzip scores the prompt once: prefill only)
            (p, g, [x])
            for x in optional
            for p in protocols
            if p in get_policy(x).protocols
            for g in granularities
        ],
        *[(p, "shared", [SHARED_LEARNED]) for p in protocols],
        *[  # last: a ranker may still be training
            (p, g, [f"ranker:{r}"])
            for r in args.ranker
            for p in protocols
            if p in get_policy(f"ranker:{r}").protocols
            for g in args.ranker_granularities.split(",")
        ],
    ]
    for protocol, granularity, policies in cells:
        name = label(policies[0], args.ranker)
        out = work / f"{protocol}-{granularity}-{name.replace(':', '_')}"
        results = run_cell(
            text, protocol=protocol, granularity=granularity, policies=policies, args=args, out=out
        )
        rows += [
            {
                "protocol": protocol,
                "granularity": granularity,
                "policy": label(x["policy"], args.ranker),
                "ratio": x["ratio"],
                "kl": x["kl_mean"],
                "top1": x["top1_agreement"],
            }
            for x in results
        ]
    meta = {
        "domain": HELDOUT_DOMAIN,
        "ranker": ", ".join(args.ranker),
        "limit": args.limit,
        "window": args.window,
        "prompt_len": args.prompt_len,
        "protocols": protocols,
        "minutes": (time.time() - t0) / 60,
    }
    Path(args.out + ".json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    Path(args.out + ".md").write_text(render(rows, meta) + "\n")
    print(render(rows, meta))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
