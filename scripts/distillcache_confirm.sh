#!/usr/bin/env bash
# The confirmation run of results/distillcache_confirm/PROTOCOL.md: the learned DistillCache
# policies that ship, against every heuristic at every granularity, on 8 BIG-Bench Hard windows
# no earlier run read (6.25 % into the held-out text, between the windows at --heldout 1 and
# 0.875). Writes results/distillcache_confirm/<run>/fidelity.{md,json}, most important runs
# first; a finished run is skipped (delete its folder to redo it). About an hour on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-.venv/bin/python}
source scripts/lib.sh
out=${OUT:-results/distillcache_confirm}
text=runs/distillcache_confirm/heldout.txt
[[ -f $text ]] || write_text reasoning "$text"  # jaxkv.rl.data.HELDOUT_DOMAIN
common=(--text "$text" --heldout 0.9375 --limit 8 --window 384 --prompt-len 256
  --ratios 0.25,0.125)
tier=ranker:ranker_recall_tier_smollm2_cpu
blend=rerank@0.5:ranker:ranker_kvzip_smollm2_cpu
head=ranker:ranker_smollm2_cpu
heur=critical:h2o,h2o,tova,snapkv,expected_attention,streaming_llm
top=critical:h2o,h2o,tova
run() {  # PROTOCOL GRANULARITY POLICIES
  evaluate fidelity "$out/$1_$2" "${common[@]}" --protocol "$1" --granularity "$2" --policies "$3"
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
"$py" scripts/distillcache_confirm_report.py "$out"
