#!/usr/bin/env bash
# Issue 14's estimator ablation: the REINFORCE policy of configs/distillcache_cpu.yaml (the
# paper's 5 features, one decision shared by all heads) trained with each estimator (paper,
# exact, ordered_pl) and seeds 0, 1, 2 for $STEPS steps (default 200; the shipped policy ran
# 300), then decode-protocol fidelity of the three 3-seed groups beside streaming_llm, h2o and
# tova on 8 windows of tinyshakespeare's last 10 % (never trained on; the ablation chooses
# nothing). Then scripts/ablate_rl_report.py writes $OUT/README.md and curves.png.
# Resumable: a finished training or evaluation is skipped, an interrupted training resumes.
#   bash scripts/ablate_rl.sh      # about 60 min of training and 15 of evaluation on 2 cores
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-.venv/bin/python}
source scripts/lib.sh
steps=${STEPS:-200}
work=${WORK:-runs/ablate_rl}
out=${OUT:-results/rl_ablation}
groups=()
for est in paper exact ordered_pl; do
  for seed in 0 1 2; do
    dir=$work/${est}_s$seed
    [[ -f $dir/policy/policy.json ]] || "$py" -m jaxkv.train distillcache \
      --config configs/distillcache_cpu.yaml --workdir "$dir" \
      "estimator=$est" "seed=$seed" "steps=$steps"
  done
  groups+=("learned:$work/${est}_s*/policy")
done
prose_tail_check "$out" shared "$(IFS=,; echo "${groups[*]}"),streaming_llm,h2o,tova"
"$py" scripts/ablate_rl_report.py "$work" "$out"
