#!/usr/bin/env bash
# The confirmation run of results/distillcache_confirm/PROTOCOL.md: the learned DistillCache
# policies that ship, against every heuristic at every granularity, on 8 BIG-Bench Hard windows
# no earlier run read (6.25 % into the held-out text, between the windows at --heldout 1 and
# 0.875), then kvpress's two best presses on the same windows. Writes
# results/distillcache_confirm/<run>/fidelity.{md,json}, most important runs first, and
# tables.md; a finished run is skipped (delete its folder to redo it). About two hours on 2
# cores, plus building .venv-kvpress the first time.
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-.venv/bin/python}
source scripts/lib.sh
KVZIP_REQUEST=chat  # kvzip's repeat request in its recorded runs (before session 40)
out=${OUT:-results/distillcache_confirm}
text=runs/distillcache_confirm/heldout.txt
[[ -f $text ]] || write_text reasoning "$text"  # jaxkv.rl.data.HELDOUT_DOMAIN
common=(--text "$text" --heldout 0.9375 --limit 8 --window 384 --prompt-len 256
  --ratios 0.25,0.125)
tier=ranker:ranker_recall_tier_smollm2_cpu
blend=rerank@0.5:ranker:ranker_kvzip_smollm2_cpu
head=ranker:ranker_smollm2_cpu
top=critical:h2o,h2o,tova
heur=$top,snapkv,expected_attention,streaming_llm
run() {  # PROTOCOL GRANULARITY POLICIES [FLAGS...]
  local proto=$1 gran=$2 policies=$3
  shift 3
  evaluate fidelity "$out/${proto}_$gran" "${common[@]}" --protocol "$proto" \
    --granularity "${gran%_nocap}" --policies "$policies" "$@"
}
run decode global "$tier,$top,snapkv,oracle"
run prefill global "$blend,$tier,kvzip,$heur,oracle"
run decode head "$head,$heur,oracle"
run prefill head "$head,kvzip,$heur,oracle"
run decode adaptive "$top"
run prefill adaptive "kvzip,$top"
run decode layer "$top"
run prefill layer "kvzip,$top"
run decode shared "$top,learned:distillcache_smollm2_cpu"
run prefill shared "$top"
run prefill global_nocap "$blend,$tier,kvzip,oracle" --head-floor 0 --head-cap 8
if [[ ! -f $out/kvpress.json ]]; then
  OUT=runs/kvpress-confirm RESULTS=$out/kvpress_comparison HELDOUT=0.9375 LIMIT=8 \
    STEPS="1 2 4 5" PRESSES=KVzipPress,KVComposePress scripts/compare_kvpress.sh "$text"
  cp runs/kvpress-confirm/kvpress.json "$out/kvpress.json"
fi
"$py" scripts/distillcache_confirm_report.py "$out"
