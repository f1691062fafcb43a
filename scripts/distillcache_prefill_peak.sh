#!/usr/bin/env bash
# results/distillcache_prefill_peak/PROTOCOL.md: `select` scores the peak ranker's order inside
# kvzip's allocation (rerank@0.5 and @0.75) against the shipped prefill blend on the training
# domains and applies the rule; `heldout` runs the prefill protocol on unread BIG-Bench Hard
# windows (--heldout 0.6875), once, and only after a candidate won. A finished run is skipped
# (delete its folder to redo it). Writes results/distillcache_prefill_peak/.
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-.venv/bin/python}
source scripts/lib.sh
out=${OUT:-results/distillcache_prefill_peak}
shipped=rerank@0.5:ranker:ranker_kvzip_smollm2_cpu
candidates=(rerank@0.5:ranker:ranker_peak_tier_smollm2_cpu rerank@0.75:ranker:ranker_peak_tier_smollm2_cpu)
window=(--window 384 --prompt-len 256 --ratios 0.25,0.125 --protocol prefill)
nocap=(--head-floor 0 --head-cap 8)
case "${1:-}" in
  select)
    for domain in prose math code chat; do
      text=runs/distillcache_blend/$domain.txt
      [[ -f $text ]] || write_text "$domain" "$text"
      evaluate fidelity "$out/check_$domain" --text "$text" --limit 4 "${window[@]}" \
        --granularity global "${nocap[@]}" --policies "$shipped,$(IFS=,; echo "${candidates[*]}")"
    done
    "$py" scripts/distillcache_decode_select.py "$out" "${candidates[@]}" --base "$shipped" \
      --protocol prefill ;;
  heldout)
    winner=$(sed -n 's/^Verdict: `\(.*\)` wins and ships.*/\1/p' "$out/select.md" 2> /dev/null)
    [[ -n $winner ]] || { echo "no winner: see $0 select" >&2; exit 2; }
    text=runs/distillcache_tier_wide/heldout.txt
    [[ -f $text ]] || write_text reasoning "$text"
    fresh=(--text "$text" --heldout 0.6875 --limit 8 "${window[@]}")
    heur=critical:h2o,h2o,tova
    evaluate fidelity "$out/prefill_global_nocap" "${fresh[@]}" --granularity global \
      "${nocap[@]}" --policies "$winner,$shipped,kvzip,oracle"
    evaluate fidelity "$out/prefill_global" "${fresh[@]}" --granularity global \
      --policies "$winner,$shipped,kvzip,$heur,snapkv,expected_attention,streaming_llm,oracle"
    evaluate fidelity "$out/prefill_head" "${fresh[@]}" --granularity head \
      --policies "kvzip,$heur,snapkv,expected_attention,streaming_llm"
    evaluate fidelity "$out/prefill_layer" "${fresh[@]}" --granularity layer --policies "kvzip,$heur"
    evaluate fidelity "$out/prefill_adaptive" "${fresh[@]}" --granularity adaptive \
      --policies "kvzip,$heur"
    evaluate fidelity "$out/prefill_shared" "${fresh[@]}" --granularity shared --policies "$heur"
    "$py" scripts/distillcache_confirm_report.py "$out" --runs \
      prefill_global_nocap,prefill_global,prefill_head,prefill_layer,prefill_adaptive,prefill_shared ;;
  *) echo "usage: $0 select | heldout" >&2; exit 2 ;;
esac
