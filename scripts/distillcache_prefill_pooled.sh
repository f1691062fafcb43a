#!/usr/bin/env bash
# results/distillcache_prefill_pooled/PROTOCOL.md: the prefill recommendation beside the
# heuristics and kvpress's KVzipPress on the unread second halves of four BIG-Bench Hard slices
# (`part F`: --heldout F --offset 3072 --limit 8, F in 0.9375 0.6875 0.4375 0.1875; every
# granularity on the first, global in both allocations on the others: the amendment), then
# `pooled`: the 32 windows' tables and the verdict (pooled.md). A finished run is skipped
# (delete its folder to redo it). Writes results/distillcache_prefill_pooled/.
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-.venv/bin/python}
source scripts/lib.sh
KVZIP_REQUEST=chat  # kvzip's repeat request in its recorded runs (before session 40)
out=${OUT:-results/distillcache_prefill_pooled}
recommended=rerank@0.5:ranker:ranker_kvzip_smollm2_cpu
parts=(0.9375 0.6875 0.4375 0.1875)
case "${1:-}" in
  part)
    [[ " ${parts[*]} " == *" ${2:-} "* ]] || { echo "part: one of ${parts[*]}" >&2; exit 2; }
    [[ $2 == "${parts[0]}" ]] || export PREFILL_RUNS=${PREFILL_RUNS:-global_nocap global}
    prefill_confirm "$out/part$2" "$recommended" "runs/kvpress-prefill-pooled-$2" "$(bbh_text)" \
      "$2" 3072 ;;
  all)
    for f in "${parts[@]}"; do "$0" part "$f"; done
    "$0" pooled ;;
  pooled)
    "$py" scripts/distillcache_confirm_report.py "${parts[@]/#/$out/part}" --goal 0.85 \
      --runs prefill_global_nocap,prefill_global --out "$out/pooled.md" ;;
  *) echo "usage: $0 part F | all | pooled" >&2; exit 2 ;;
esac
