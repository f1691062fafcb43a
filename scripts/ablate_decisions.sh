#!/usr/bin/env bash
# Issue 14's decisions ablation: the three supervised rankers of scripts/ablate_training.sh
# (seeds 0, 1, 2; run that first) deciding once for the whole model (shared) against per
# (layer, KV head) (the training ablation's own run, $HEAD_RUN), beside critical:h2o, h2o, tova
# and streaming_llm at the same granularity; decode-protocol fidelity on the same 8 windows of
# tinyshakespeare's last 10 % (never trained on; the ablation chooses nothing).
# scripts/ablate_decisions_report.py writes $OUT/README.md. GRANULARITIES adds runs (e.g.
# "shared layer"). Resumable: a finished run is skipped.
#   bash scripts/ablate_decisions.sh   # about 10 min per granularity on 2 cores
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-.venv/bin/python}
source scripts/lib.sh
work=${WORK:-runs/ablate_training}
out=${OUT:-results/decision_ablation}
head_run=${HEAD_RUN:-results/training_ablation/fidelity.json}
need_run "$head_run" scripts/ablate_training.sh
runs=()
for g in ${GRANULARITIES:-shared}; do
  prose_tail_check "$out/$g" "$g" "ranker:$work/supervised_s*,critical:h2o,h2o,tova,streaming_llm"
  runs+=("$out/$g/fidelity.json")
done
"$py" scripts/ablate_decisions_report.py "$out" "${runs[@]}" "$head_run"
