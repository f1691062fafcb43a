#!/usr/bin/env bash
# results/distillcache_tier_wide/PROTOCOL.md: `select` scores the recall ranker with attended
# tiers of 0.625, 0.75 and 0.875 of the budget against the shipped 0.5 on the training domains
# and ships the winner, if any; `heldout` runs decode-protocol fidelity on unread BIG-Bench Hard
# windows (--heldout 0.125), once, and writes its table (tables.md). A finished run is skipped
# (delete its folder to redo it). Writes results/distillcache_tier_wide/.
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-.venv/bin/python}
source scripts/lib.sh
out=${OUT:-results/distillcache_tier_wide}
shipped=ranker_recall_tier_smollm2_cpu  # F = 0.5
wide=ranker_recall_tier_wide_smollm2_cpu
case "${1:-}" in
  select)
    candidates=()
    for f in 0.625 0.75 0.875; do
      candidates+=("$(tier_candidate runs/distillcache_tier_wide/tier_$f "$f")")
    done
    policies=$(IFS=,; echo "${candidates[*]%%=*}")
    domain_check "$out" "ranker:$shipped,$policies"
    "$py" scripts/distillcache_decode_select.py "$out" "${candidates[@]}" --ship "jaxkv/checkpoints/$wide" ;;
  heldout)
    [[ -f jaxkv/checkpoints/$wide/ranker.json ]] || { echo "nothing shipped: see $0 select" >&2; exit 2; }
    decode_heldout "$out" "ranker:$wide,ranker:$shipped" ;;
  *) echo "usage: $0 select | heldout" >&2; exit 2 ;;
esac
