#!/usr/bin/env bash
# results/retrieval_recall_h16/PROTOCOL.md: `train` trains the one candidate (session 12's recall
# ranker's recipe with a 16-query target horizon); `heldout` runs retrieval on data seed 3 and
# fidelity on unread BIG-Bench Hard windows (--heldout 0.625), once. A finished run is skipped
# (delete its folder to redo it). Writes results/retrieval_recall_h16/<run>/.
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-.venv/bin/python}
source scripts/lib.sh
out=${OUT:-results/retrieval_recall_h16}
run=runs/ranker_recall_h16
candidate=ranker:$run
recall=ranker:ranker_recall_smollm2_cpu
case "${1:-}" in
  train)
    [[ -f $run/ranker.json ]] || "$py" -m jaxkv.train ranker \
      --domains prose,math,code,chat,recall --windows-per-domain 12 --steps 1500 \
      --target value --pool 90 --rows-per-step 270 --horizon 16 --chunk 16 --out "$run" ;;
  heldout)
    [[ -f $run/ranker.json ]] || { echo "train first: $0 train" >&2; exit 2; }
    recall_heldout "$out" 3 0.625 "full,$candidate,h2o,tova" \
      "$candidate,tova,h2o,critical:h2o,snapkv" "$candidate,$recall" ;;
  *) echo "usage: $0 train | heldout" >&2; exit 2 ;;
esac
