#!/usr/bin/env bash
# Issue 14's decisions ablation: the three supervised rankers of scripts/ablate_training.sh
# (seeds 0, 1, 2; run that first) deciding once for the whole model (shared), per layer and per
# (layer, KV head), beside critical:h2o, h2o, tova and streaming_llm at the same granularity;
# decode-protocol fidelity on 8 windows of tinyshakespeare's last 10 % (never trained on; the
# ablation chooses nothing). scripts/ablate_decisions_report.py writes $OUT/README.md.
# Resumable: a finished granularity is skipped.
#   bash scripts/ablate_decisions.sh   # about 20 min on 2 cores
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-.venv/bin/python}
source scripts/lib.sh
work=${WORK:-runs/ablate_training}
out=${OUT:-results/decision_ablation}
for seed in 0 1 2; do
  [[ -f $work/supervised_s$seed/ranker.json ]] || {
    echo "no $work/supervised_s$seed: run scripts/ablate_training.sh first" >&2
    exit 1
  }
done
for g in shared layer head; do
  prose_tail_check "$out/$g" "$g" "ranker:$work/supervised_s*,critical:h2o,h2o,tova,streaming_llm"
done
"$py" scripts/ablate_decisions_report.py "$out"
