#!/usr/bin/env bash
# Issue 14's training ablation, per (layer, KV head), seeds 0, 1, 2 (the seed sets the
# initialisation, the training windows and the rollouts' keys):
#   supervised  the shipped ranker's recipe, `python -m jaxkv.train ranker` (no RL);
#   rl          REINFORCE per head from a fresh ranker of the same size (hidden 32;
#               configs/distillcache_head_cpu.yaml without its warm start; its feature
#               standardization stays the identity, as only a supervised fit estimates one);
#   warm_rl     REINFORCE per head from that seed's supervised ranker.
# Then decode-protocol fidelity of the three 3-seed groups beside critical:h2o, h2o, tova and
# streaming_llm, per head, on 8 windows of tinyshakespeare's last 10 % (never trained on; the
# ablation chooses nothing), and scripts/ablate_rl_report.py writes $OUT/README.md and
# curves.png. Resumable: a finished training or evaluation is skipped, an interrupted REINFORCE
# run resumes from its last checkpoint (an interrupted supervised fit starts again).
#   bash scripts/ablate_training.sh   # about 3 h of training and 25 min of evaluation on 2 cores
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-.venv/bin/python}
source scripts/lib.sh
work=${WORK:-runs/ablate_training}
out=${OUT:-results/training_ablation}
rl=(--config configs/distillcache_head_cpu.yaml)
for seed in 0 1 2; do
  [[ -f $work/supervised_s$seed/ranker.json ]] || "$py" -m jaxkv.train ranker \
    --windows-per-domain 12 --steps 1500 --target value --seed "$seed" \
    --out "$work/supervised_s$seed"
done
for seed in 0 1 2; do
  [[ -f $work/rl_s$seed/policy/ranker.json ]] || "$py" -m jaxkv.train distillcache "${rl[@]}" \
    --workdir "$work/rl_s$seed" "warm_start=''" hidden=32 "seed=$seed"
  [[ -f $work/warm_rl_s$seed/policy/ranker.json ]] || "$py" -m jaxkv.train distillcache \
    "${rl[@]}" --workdir "$work/warm_rl_s$seed" "warm_start=$work/supervised_s$seed" "seed=$seed"
done
groups="ranker:$work/supervised_s*,ranker:$work/rl_s*/policy,ranker:$work/warm_rl_s*/policy"
prose_tail_check "$out" head "$groups,critical:h2o,h2o,tova,streaming_llm"
"$py" scripts/ablate_rl_report.py "$work" "$out" --arms supervised,rl,warm_rl \
  --title "Training ablation per (layer, KV head)" --script scripts/ablate_training.sh
