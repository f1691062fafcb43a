#!/usr/bin/env bash
# results/distillcache_peak_tova/PROTOCOL.md: `select` runs the development checks of the
# three blends of the peak ranker's allocation with TOVA's order (training-domain KL, retrieval
# on data seed 6) and applies the rule; `heldout` runs the chosen one once on unread BIG-Bench
# Hard windows (--heldout 0.4375) and retrieval data seed 8; `retrieval-only` (the addendum)
# runs the retrieval candidate on seed 8 alone; `select2` / `heldout2` are round 2 (lighter
# blends) and `select3` / `heldout3` round 3 (a TOVA tier), held-out retrieval on data seed 9;
# `select4` / `heldout4` round 4 (wider tiers; BBH 0.3125, data seed 10, left unread);
# `heldout5` round 5 (the look-up blend of round 1, nothing chosen, on that same unread data);
# `retrieval6` round 6 (both recommendations' retrieval, 16 prompts per cell, data seed 11);
# `retrieval7` round 7 (the same on data seed 12); `retrieval8` round 8 (data seed 13);
# `retrieval9` ... `retrieval12` rounds 9-12 (data seeds 14-17) and `pooled` their pooled test
# (PROTOCOL.md, round 9; scripts/retrieval_pooled.py, "pending" until all four exist).
# Finished runs are skipped.
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-.venv/bin/python}
source scripts/lib.sh
out=${OUT:-results/distillcache_peak_tova}
peak=ranker:ranker_peak_tier_smollm2_cpu
candidates=("blend@0.5:$peak+tova" "blend@0.75:$peak+tova" "blend@1:$peak+tova")
dev=dev seed=8 bbh=0.4375
if [[ ${1:-} =~ ^(select|heldout)2$ ]]; then  # round 2
  candidates=("blend@0.125:$peak+tova" "blend@0.25:$peak+tova" "blend@0.375:$peak+tova")
  dev=dev2 seed=9 out=$out/round2
elif [[ ${1:-} =~ ^(select|heldout)3$ ]]; then  # round 3
  candidates=("tier@0.02:$peak+tova" "tier@0.05:$peak+tova" "tier@0.1:$peak+tova")
  dev=dev3 seed=9 out=$out/round3
elif [[ ${1:-} =~ ^(select|heldout)4$ ]]; then  # round 4
  candidates=("tier@0.2:$peak+tova" "tier@0.3:$peak+tova" "tier@0.5:$peak+tova")
  dev=dev4 seed=10 bbh=0.3125 out=$out/round4
elif [[ ${1:-} == heldout5 ]]; then  # round 5: no selection, the look-up recommendation
  seed=10 bbh=0.3125 out=$out/round5
elif [[ ${1:-} =~ ^retrieval([6-9]|1[0-2])$ ]]; then  # rounds 6-12: retrieval alone, twice
  round=${1#retrieval}  # the prompts, each on a fresh data seed (round + 5: 11 ... 17)
  seed=$((round + 5)) out=$out/round$round
  export RETRIEVAL_LIMIT=16
fi
heldout_retrieval() {  # CHOSEN SEED: the held-out retrieval runs of every round
  retrieval_runs "$out" "$2" "full,$1,$peak,h2o,critical:h2o,tova" tova,h2o,critical:h2o,snapkv
}
case "${1:-}" in
  select | select2 | select3 | select4)
    domain_check "$out/$dev" "$peak,$(IFS=,; echo "${candidates[*]}")"
    retrieval_runs "$out/$dev" 6 "$(IFS=,; echo "${candidates[*]}")"
    "$py" scripts/distillcache_peak_tova_select.py "$out/$dev" "${candidates[@]}" --base "$peak" ;;
  heldout | heldout2 | heldout3 | heldout4)
    chosen=$(cat "$out/$dev/chosen.txt" 2>/dev/null) || { echo "nothing chosen: $0 ${1/held/sel}" >&2; exit 2; }
    decode_heldout "$out" "$chosen,$peak" "$bbh"
    heldout_retrieval "$chosen" "$seed" ;;
  heldout5)
    decode_heldout "$out" "blend@0.75:$peak+tova,$peak" "$bbh"
    heldout_retrieval "blend@0.75:$peak+tova" "$seed" ;;
  retrieval6 | retrieval7 | retrieval8 | retrieval9 | retrieval10 | retrieval11 | retrieval12)
    heldout_retrieval "blend@0.75:$peak+tova" "$seed" ;;
  pooled)
    rounds=()
    for r in 9 10 11 12; do
      finished "$out/round$r/retrieval_head/retrieval.json" && rounds+=("$out/round$r")
    done
    "$py" scripts/retrieval_pooled.py "${rounds[@]}" --out "$out/pooled.md" ;;
  retrieval-only)  # PROTOCOL.md's addendum: the retrieval candidate, once, on data seed 8
    heldout_retrieval "blend@0.75:$peak+tova" 8 ;;
  *) echo "usage: $0 select | heldout | retrieval-only | select2 | heldout2 | select3 | heldout3 | select4 | heldout4 | heldout5 | retrieval6 ... retrieval12 | pooled" >&2; exit 2 ;;
esac
