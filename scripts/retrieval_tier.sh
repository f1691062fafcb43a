#!/usr/bin/env bash
# results/retrieval_tier/PROTOCOL.md: `select` scores the recall ranker with attended tiers of
# 0.125, 0.25 and 0.5 of the budget on the training domains (fidelity) and on retrieval data
# seed 0 (read before), and ships the winner; `heldout` runs retrieval on data seed 5 and
# fidelity on unread BIG-Bench Hard windows (--heldout 0.75), once. A finished run is skipped
# (delete its folder to redo it). Writes results/retrieval_tier/.
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-.venv/bin/python}
source scripts/lib.sh
out=${OUT:-results/retrieval_tier}
recall=ranker:ranker_recall_smollm2_cpu
eighth=ranker_recall_attended_smollm2_cpu  # F = 0.125, shipped in session 14
shipped=ranker_recall_tier_smollm2_cpu
case "${1:-}" in
  select)
    candidates=("ranker:$eighth=jaxkv/checkpoints/$eighth")
    for f in 0.25 0.5; do
      candidates+=("$(tier_candidate runs/retrieval_tier/tier_$f "$f")")
    done
    policies=$(IFS=,; echo "${candidates[*]%%=*}")
    domain_check "$out" "$recall,$policies"
    evaluate retrieval "$out/design_head" --ratios 0.25 --limit 8 --data-seed 0 \
      --tasks passkey,needle --lengths 1024,2048 --granularity head --policies "$policies"
    "$py" scripts/retrieval_tier_select.py "$out" "${candidates[@]}" "jaxkv/checkpoints/$shipped" ;;
  heldout)
    [[ -f jaxkv/checkpoints/$shipped/ranker.json ]] || { echo "nothing shipped: see $0 select" >&2; exit 2; }
    candidate=ranker:$shipped
    recall_heldout "$out" 5 0.75 "full,$candidate,ranker:$eighth,h2o,critical:h2o,tova" \
      "$candidate,tova,h2o,critical:h2o,snapkv" "$candidate,ranker:$eighth" ;;
  *) echo "usage: $0 select | heldout" >&2; exit 2 ;;
esac
