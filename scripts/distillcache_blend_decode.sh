#!/usr/bin/env bash
# results/distillcache_blend_decode/PROTOCOL.md: `select` scores the recall-tier ranker's
# allocation with its order blended with critical:h2o's (w = 0.25, 0.5, 0.75, 1) against the
# ranker alone on the training domains and names the winner, if any; `heldout` runs
# decode-protocol fidelity on unread BIG-Bench Hard windows (--heldout 0.125), once, for the
# candidate of PROTOCOL.md's addendum (w = 0.25, at r = 0.125), and writes its table
# (tables.md). A finished run is skipped (delete its folder to redo it).
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-.venv/bin/python}
source scripts/lib.sh
out=${OUT:-results/distillcache_blend_decode}
shipped=ranker:ranker_recall_tier_smollm2_cpu
candidates=()
for w in 0.25 0.5 0.75 1; do candidates+=("blend@$w:$shipped+critical:h2o"); done
case "${1:-}" in
  select)
    domain_check "$out" "$shipped,$(IFS=,; echo "${candidates[*]}")"
    "$py" scripts/distillcache_decode_select.py "$out" "${candidates[@]}" ;;
  heldout)
    [[ -f $out/select.md ]] || { echo "no selection yet: see $0 select" >&2; exit 2; }
    winner=blend@0.25:$shipped+critical:h2o  # PROTOCOL.md's addendum: the r = 0.125 candidate
    decode_heldout "$out" "$winner,$shipped" ;;
  *) echo "usage: $0 select | heldout" >&2; exit 2 ;;
esac
