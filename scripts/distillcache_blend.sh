#!/usr/bin/env bash
# results/distillcache_blend/PROTOCOL.md: `tune` scores kvzip and rerank@<w>: on the training
# domains; `confirm W` runs the chosen w once on unread BIG-Bench Hard windows; `earlier W` runs
# it, after the choice, on the BBH windows earlier runs had read. A finished run
# is skipped (delete its folder to redo it). Writes results/distillcache_blend/<run>/.
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-.venv/bin/python}
source scripts/lib.sh
KVZIP_REQUEST=chat  # kvzip's repeat request in its recorded runs (before session 40)
out=${OUT:-results/distillcache_blend}
ranker=ranker:ranker_kvzip_smollm2_cpu
window=(--window 384 --prompt-len 256 --ratios 0.25,0.125 --protocol prefill --granularity global)
run() {  # name, then fidelity flags
  local name=$1; shift
  evaluate fidelity "$out/$name" "${window[@]}" "$@"
}
heldout=runs/distillcache_blend/heldout.txt  # the BBH text (confirm, earlier)
case "${1:-}" in
  confirm | earlier) [[ -f $heldout ]] || write_text reasoning "$heldout" ;;
esac
case "${1:-}" in
  tune)
    weights=$(printf "rerank@%s:$ranker," 0.25 0.5 0.75)
    for domain in prose math code chat; do
      text=runs/distillcache_blend/$domain.txt
      [[ -f $text ]] || write_text "$domain" "$text"
      run "tune_$domain" --text "$text" --limit 4 --policies "kvzip,${weights}rerank:$ranker"
    done
    "$py" scripts/distillcache_blend_choose.py "$out" ;;
  confirm)
    w=${2:?usage: $0 confirm W}
    fresh=(--text "$heldout" --heldout 0.25 --limit 8)
    heur=h2o,critical:h2o,tova,snapkv,expected_attention,streaming_llm
    run prefill_global "${fresh[@]}" --policies "kvzip,rerank@$w:$ranker,rerank:$ranker,$heur,oracle"
    run prefill_nocap "${fresh[@]}" --head-floor 0 --head-cap 8 \
      --policies "kvzip,rerank@$w:$ranker,rerank:$ranker,oracle" ;;
  earlier)  # after the choice: the chosen w on the BBH windows earlier runs had read
    w=${2:?usage: $0 earlier W}
    for set in "first4 1 4" "middle8 0.5 8"; do
      read -r name frac n <<< "$set"
      cut=(--text "$heldout" --heldout "$frac" --limit "$n" --policies "kvzip,rerank@$w:$ranker")
      run "earlier_${name}_global" "${cut[@]}"
      run "earlier_${name}_nocap" "${cut[@]}" --head-floor 0 --head-cap 8
    done ;;
  *) echo "usage: $0 tune | confirm W | earlier W" >&2; exit 2 ;;
esac
