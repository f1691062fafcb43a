#!/usr/bin/env bash
# Issue 14's features ablation on held-out KL: supervised per-head rankers reading the paper's 5
# features (paper5: log_attn, log_vnorm, log_attn_var, entropy, pos_frac), the default 13
# (scripts/ablate_training.sh's supervised arm; run that first) or all 14 (all14: + ||W_o v||,
# log_wo_vnorm), seeds 0, 1, 2, the training ablation's recipe otherwise. Then decode-protocol
# fidelity per (layer, KV head) of the paper5 and all14 groups on the training ablation's 8
# windows of tinyshakespeare's last 10 % (never trained on; the ablation chooses nothing);
# scripts/ablate_rl_report.py writes $OUT/README.md with the default 13 and the heuristics
# (critical:h2o, h2o, tova, streaming_llm) from the training ablation's run on the same windows.
# Resumable: a finished fit or evaluation is skipped. (scripts/ablate_ranker.py compares the same
# configurations on the kept future mass of the training domains' validation rows.)
#   bash scripts/ablate_features.sh   # about 40 min of training and 10 of evaluation on 2 cores
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-.venv/bin/python}
source scripts/lib.sh
work=${WORK:-runs/ablate_training}
out=${OUT:-results/feature_ablation}
base_run=${BASE_RUN:-results/training_ablation/fidelity.json}
need_run "$base_run" scripts/ablate_training.sh
declare -A features=(
  [paper5]=log_attn,log_vnorm,log_attn_var,entropy,pos_frac
  [all14]=$("$py" -c "from jaxkv.policies.ranker import FEATURES, RECON_FEATURES
print(','.join(n for n in FEATURES if n not in RECON_FEATURES))")
)
for seed in 0 1 2; do
  for arm in paper5 all14; do
    [[ -f $work/${arm}_s$seed/ranker.json ]] || "$py" -m jaxkv.train ranker \
      --windows-per-domain 12 --steps 1500 --target value --seed "$seed" \
      --features "${features[$arm]}" --out "$work/${arm}_s$seed"
  done
done
prose_tail_check "$out" head "ranker:$work/paper5_s*,ranker:$work/all14_s*"
"$py" scripts/ablate_rl_report.py "$work" "$out" --with "$base_run" \
  --arms paper5,supervised,all14 --title "Features ablation per (layer, KV head)" \
  --script scripts/ablate_features.sh
