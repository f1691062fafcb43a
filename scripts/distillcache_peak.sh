#!/usr/bin/env bash
# results/distillcache_peak/PROTOCOL.md: `train` trains the one candidate (the recall ranker's
# recipe with the peak target) and gives it the shipped attended tier; `select` scores it
# against the shipped recall-tier ranker on the training domains and ships it if the rule
# admits it; `heldout` runs decode-protocol fidelity on unread BIG-Bench Hard windows
# (--heldout 0.8125) and retrieval on data seed 6, once, and only after a candidate shipped;
# `second` repeats the decode run on a second unread slice (--heldout 0.5625) and
# `second-retrieval` the retrieval runs on a second fresh seed (7).
# A finished run is skipped (delete its folder to redo it). Writes results/distillcache_peak/.
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-.venv/bin/python}
source scripts/lib.sh
out=${OUT:-results/distillcache_peak}
work=runs/distillcache_peak
shipped=ranker:ranker_recall_tier_smollm2_cpu
ship=jaxkv/checkpoints/ranker_peak_tier_smollm2_cpu
candidate=ranker:${ship##*/}
retrieval() {  # OUT SEED: passkey and needle at 1K / 2K, r = 0.25, on data seed SEED
  retrieval_runs "$1" "$2" "full,$candidate,$shipped,h2o,critical:h2o,tova" \
    "$candidate,tova,h2o,critical:h2o,snapkv"
}
case "${1:-}" in
  train)
    [[ -f $work/peak/ranker.json ]] || "$py" -m jaxkv.train ranker \
      --domains prose,math,code,chat,recall --windows-per-domain 12 --steps 1500 \
      --target peak --chunk 1 --pool 90 --rows-per-step 270 --out "$work/peak"
    tier_candidate "$work/peak_tier" 0.5 "$work/peak" > /dev/null ;;
  select)
    domain_check "$out" "$shipped,ranker:$work/peak_tier"
    "$py" scripts/distillcache_decode_select.py "$out" "ranker:$work/peak_tier=$work/peak_tier" \
      --ship "$ship" ;;
  heldout)
    [[ -f $ship/ranker.json ]] || { echo "nothing shipped: see $0 select" >&2; exit 2; }
    decode_heldout "$out" "$candidate,$shipped" 0.8125
    retrieval "$out" 6 ;;
  second)  # the same decode run, once, on a second unread slice (PROTOCOL.md, session 25)
    decode_heldout "$out/second" "$candidate,$shipped" 0.5625 ;;
  second-retrieval)  # the same retrieval runs, once, on a second fresh seed (session 25)
    retrieval "$out/second" 7 ;;
  *) echo "usage: $0 train | select | heldout | second | second-retrieval" >&2; exit 2 ;;
esac
