#!/usr/bin/env bash
# results/distillcache_kvzip_plain/PROTOCOL.md: the prefill recommendation with kvzip's plain
# repeat request (and, beside it, the chat one of before session 40) and kvpress's KVzipPress on
# the unread second halves of four BIG-Bench Hard slices (`part F`: --heldout F --offset 3072
# --limit 8, F in 0.875 0.625 0.375 0.125; every heuristic at the default allocation on the
# first), then `pooled`: the 32 windows' tables and the verdict (pooled.md). A finished run is
# skipped (delete its folder to redo it). Writes results/distillcache_kvzip_plain/.
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-.venv/bin/python}
source scripts/lib.sh
out=${OUT:-results/distillcache_kvzip_plain}
recommended=rerank@0.5:ranker:ranker_kvzip_smollm2_cpu
parts=(0.875 0.625 0.375 0.125)
case "${1:-}" in
  part)
    [[ " ${parts[*]} " == *" ${2:-} "* ]] || { echo "part: one of ${parts[*]}" >&2; exit 2; }
    runs="global_nocap global_nocap_chat"
    [[ $2 == "${parts[0]}" ]] && runs+=" global"
    PREFILL_RUNS=$runs prefill_confirm "$out/part$2" "$recommended" \
      "runs/kvpress-kvzip-plain-$2" "$(bbh_text)" "$2" 3072 ;;
  all)
    for f in "${parts[@]}"; do "$0" part "$f"; done
    "$0" pooled ;;
  pooled)
    "$py" scripts/distillcache_confirm_report.py "${parts[@]/#/$out/part}" --goal 0.85 \
      --runs prefill_global_nocap,prefill_global_nocap_chat --out "$out/pooled.md" ;;
  *) echo "usage: $0 part F | all | pooled" >&2; exit 2 ;;
esac
