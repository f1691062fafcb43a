#!/usr/bin/env bash
# results/distillcache_blend_nocap/PROTOCOL.md: `tune` re-chooses the blend weight w on the
# training domains under the recommendation's allocation (global, no floor or cap); if it is not
# 0.5, `part F W` runs w beside 0.5 on the unread second half of BBH slice F (F in 0.875 0.625
# 0.375 0.125; every heuristic at the default allocation on the first), and `pooled` writes
# the 32 windows' tables and verdicts. A finished run is skipped (delete its folder to redo it).
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-.venv/bin/python}
source scripts/lib.sh
out=${OUT:-results/distillcache_blend_nocap}
ranker=ranker:ranker_kvzip_smollm2_cpu
nocap=(--granularity global --head-floor 0 --head-cap 8)
parts=(0.875 0.625 0.375 0.125)
case "${1:-}" in
  tune)
    weights=$(printf "rerank@%s:$ranker," 0.25 0.375 0.5 0.625 0.75)
    for domain in prose math code chat; do
      text=runs/distillcache_blend/$domain.txt
      [[ -f $text ]] || write_text "$domain" "$text"
      evaluate fidelity "$out/tune_$domain" --text "$text" --limit 8 --window 384 \
        --prompt-len 256 --ratios 0.25,0.125 --protocol prefill "${nocap[@]}" \
        --policies "kvzip,${weights%,}"
    done
    "$py" scripts/distillcache_blend_choose.py "$out" ;;
  part)
    [[ " ${parts[*]} " == *" ${2:-} "* ]] || { echo "part: one of ${parts[*]}" >&2; exit 2; }
    w=${3:?usage: $0 part F W}
    [[ $2 == "${parts[0]}" ]] && runs="global_nocap global" || runs=global_nocap
    PREFILL_RUNS=$runs prefill_confirm "$out/part$2" "rerank@$w:$ranker,rerank@0.5:$ranker" \
      "runs/kvpress-blend-nocap-$2" "$(bbh_text)" "$2" 3072 ;;
  pooled)
    "$py" scripts/distillcache_confirm_report.py "${parts[@]/#/$out/part}" --goal 0.85 \
      --runs prefill_global_nocap --out "$out/pooled.md" ;;
  *) echo "usage: $0 tune | part F W | pooled" >&2; exit 2 ;;
esac
