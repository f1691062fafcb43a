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
    common=(--ratios 0.25 --limit 8 --data-seed 3 --tasks passkey,needle --lengths 1024,2048)
    for set in "global full,$candidate,h2o,tova" "head $candidate,tova,h2o,critical:h2o,snapkv"; do
      read -r gran policies <<< "$set"
      finished "$out/retrieval_$gran/retrieval.json" && { echo "skip retrieval_$gran"; continue; }
      "$py" -m jaxkv.eval retrieval "${common[@]}" --granularity "$gran" --policies "$policies" \
        --out "$out/retrieval_$gran"
    done
    text=runs/retrieval_recall/heldout.txt
    [[ -f $text ]] || write_text reasoning "$text"
    fresh=(--text "$text" --heldout 0.625 --limit 8 --window 384 --prompt-len 256 --protocol decode
      --ratios 0.25,0.125)
    for set in "global $candidate,$recall" "head critical:h2o"; do
      read -r gran policies <<< "$set"
      finished "$out/fidelity_$gran/fidelity.json" && { echo "skip fidelity_$gran"; continue; }
      "$py" -m jaxkv.eval fidelity "${fresh[@]}" --granularity "$gran" --policies "$policies" \
        --out "$out/fidelity_$gran"
    done ;;
  *) echo "usage: $0 train | heldout" >&2; exit 2 ;;
esac
