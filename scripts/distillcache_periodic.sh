#!/usr/bin/env bash
# results/distillcache_periodic/PROTOCOL.md: `heldout` runs the peak ranker and the decode
# heuristics once on unread BIG-Bench Hard windows (--heldout 0.1875), decode protocol, with
# eviction every floor(B_max / 16) steps (6 at r = 0.25, 3 at r = 0.125) and at every step;
# `cost` times their eviction at batch 8 x 4K with the same relative period (65 and 32).
# Finished runs are skipped.
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-.venv/bin/python}
source scripts/lib.sh
out=${OUT:-results/distillcache_periodic}
peak=ranker:ranker_peak_tier_smollm2_cpu
runs() {  # DIR TAG FLAGS...: the three granularities' runs of one setting into DIR
  decode_runs "$1" "$2" 0.1875 "$peak" "$peak" "${@:3}"
}
case "${1:-}" in
  heldout)
    runs "$out/periodic" -r0.25 --ratios 0.25 --evict-every 6
    runs "$out/periodic" -r0.125 --ratios 0.125 --evict-every 3
    runs "$out/every_step" "" --ratios 0.25,0.125
    "$py" scripts/distillcache_confirm_report.py "$out/periodic" \
      --runs "$(echo decode_{global,head,layer}-r{0.25,0.125} | tr ' ' ,)"
    "$py" scripts/distillcache_confirm_report.py "$out/every_step" \
      --runs decode_global,decode_head,decode_layer ;;
  cost)
    bench=(scripts/bench_eviction.py --policy "$peak" --granularities head,global --steps 16)
    "$py" "${bench[@]}" --ratio 0.25 --evict-every 65 --out "$out/cost_r0.25_k65"
    "$py" "${bench[@]}" --ratio 0.125 --evict-every 32 --out "$out/cost_r0.125_k32"
    "$py" "${bench[@]}" --ratio 0.25 --evict-every 1 --out "$out/cost_r0.25_k1" ;;
  *) echo "usage: $0 heldout | cost" >&2; exit 2 ;;
esac
