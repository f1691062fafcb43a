#!/usr/bin/env bash
# results/retrieval_attended/PROTOCOL.md: `check` scores the shipped recall ranker with and
# without a protected tier of the tokens the latest query attends to most (attended_fraction
# 0.125) on the training domains, and ships the tiered ranker if the rule passes; `heldout` runs
# retrieval on data seed 4 and fidelity on unread BIG-Bench Hard windows (--heldout 0.375), once.
# A finished run is skipped (delete its folder to redo it). Writes results/retrieval_attended/.
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-.venv/bin/python}
source scripts/lib.sh
out=${OUT:-results/retrieval_attended}
recall=ranker:ranker_recall_smollm2_cpu
staged=runs/retrieval_attended/ranker  # the candidate before the rule ships it
shipped=ranker_recall_attended_smollm2_cpu
case "${1:-}" in
  check)
    [[ -f $staged/ranker.json ]] || "$py" -c "
from jaxkv.policies.ranker import retier
retier('ranker_recall_smollm2_cpu', '$staged', attended_fraction=0.125)"
    domain_check "$out" "$recall,ranker:$staged"
    "$py" scripts/retrieval_attended_check.py "$out" "$staged" "jaxkv/checkpoints/$shipped" ;;
  heldout)
    [[ -f jaxkv/checkpoints/$shipped/ranker.json ]] || { echo "not shipped: see $0 check" >&2; exit 2; }
    candidate=ranker:$shipped
    recall_heldout "$out" 4 0.375 "full,$candidate,$recall,h2o,critical:h2o,tova" \
      "$candidate,tova,h2o,critical:h2o,snapkv" "$candidate,$recall" ;;
  *) echo "usage: $0 check | heldout" >&2; exit 2 ;;
esac
