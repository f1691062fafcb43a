#!/usr/bin/env bash
# results/distillcache_prefill_peak/PROTOCOL.md: `select` scores the peak ranker's order inside
# kvzip's allocation (rerank@0.5 and @0.75) against the shipped prefill blend on the training
# domains and applies the rule (none won); `train` trains the third candidate, the kvzip-feature
# ranker's recipe with the peak target, and `select2` scores it the same way (it did not win);
# `confirm` runs the shipped blend, every heuristic and kvpress's KVzipPress in the prefill
# protocol on unread BIG-Bench Hard windows (--heldout 0.6875), once. A finished run is skipped
# (delete its folder to redo it). Writes results/distillcache_prefill_peak/.
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-.venv/bin/python}
source scripts/lib.sh
KVZIP_REQUEST=chat  # kvzip's repeat request in its recorded runs (before session 40)
out=${OUT:-results/distillcache_prefill_peak}
shipped=rerank@0.5:ranker:ranker_kvzip_smollm2_cpu
candidates=(rerank@0.5:ranker:ranker_peak_tier_smollm2_cpu
  rerank@0.75:ranker:ranker_peak_tier_smollm2_cpu)
window=(--window 384 --prompt-len 256 --ratios 0.25,0.125 --protocol prefill)
nocap=(--head-floor 0 --head-cap 8)
work=runs/distillcache_prefill_peak
kvzip_features=log_attn,log_attn_var,log_attn_cum,log_attn_mean,log_recent,entropy,log_vnorm
kvzip_features+=,log_age,log_pos,pos_frac,depth,z_attn_cum,z_recent,log_recon,z_recon
check() {  # OUT POLICIES...: the candidates beside the shipped blend on the training domains
  local dir=$1 domain text
  shift
  for domain in prose math code chat; do
    text=runs/distillcache_blend/$domain.txt
    [[ -f $text ]] || write_text "$domain" "$text"
    evaluate fidelity "$dir/check_$domain" --text "$text" --limit 4 "${window[@]}" \
      --granularity global "${nocap[@]}" --policies "$shipped,$(IFS=,; echo "$*")"
  done
}
case "${1:-}" in
  select)
    check "$out" "${candidates[@]}"
    "$py" scripts/distillcache_decode_select.py "$out" "${candidates[@]}" --base "$shipped" \
      --protocol prefill ;;
  train)
    [[ -f $work/kvzip_peak/ranker.json ]] || "$py" -m jaxkv.train ranker \
      --domains prose,math,code,chat --windows-per-domain 12 --steps 1500 --points 128,256,384 \
      --features "$kvzip_features" --target peak --chunk 1 --pool 90 --rows-per-step 270 \
      --kvzip-request "$KVZIP_REQUEST" --out "$work/kvzip_peak" ;;
  select2)
    third=rerank@0.5:ranker:$work/kvzip_peak
    check "$out/third" "$third"
    "$py" scripts/distillcache_decode_select.py "$out/third" "$third=$work/kvzip_peak" \
      --base "$shipped" --protocol prefill --ship jaxkv/checkpoints/ranker_kvzip_peak_smollm2_cpu
    cp "$out/third/select.md" "$out/select2.md" ;;
  confirm)  # no candidate won: the shipped blend, once, on the windows kept for the winner
    prefill_confirm "$out" "$shipped" runs/kvpress-prefill-peak "$(bbh_text)" 0.6875 0 ;;
  *) echo "usage: $0 select | train | select2 | confirm" >&2; exit 2 ;;
esac
