#!/usr/bin/env bash
# results/ranker_kvzip_plain/PROTOCOL.md: the kvzip ranker retrained with kvzip's plain repeat
# request. `train` trains the candidate (runs/kvzip_plain/ranker); `validate` scores it against
# the shipped recommendation on the training domains' validation windows (the choice). The
# candidate was not chosen, so the protocol's held-out test has no step here. A finished run is
# skipped.
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-.venv/bin/python}
source scripts/lib.sh
out=${OUT:-results/ranker_kvzip_plain}
work=runs/kvzip_plain
candidate=$work/ranker
shipped=ranker:ranker_kvzip_smollm2_cpu
features=log_attn,log_attn_var,log_attn_cum,log_attn_mean,log_recent,entropy,log_vnorm,log_age
features+=,log_pos,pos_frac,depth,z_attn_cum,z_recent,log_recon,z_recon
case "${1:-}" in
  train)
    "$py" -m jaxkv.train ranker --windows-per-domain 12 --steps 1500 --target value --pool 90 \
      --rows-per-step 270 --points 128,256,384 --features "$features" --kvzip-request plain \
      --seed 0 --out "$candidate" ;;
  validate)
    text=$work/val_train_domains.txt
    [[ -f $text ]] || "$py" -c "
import sys, pathlib
from jaxkv.evals.runner import load_eval_model
from jaxkv.rl.ranker import validation_text
path = pathlib.Path(sys.argv[1])
path.parent.mkdir(parents=True, exist_ok=True)
path.write_text(validation_text(load_eval_model('smollm2-135m').tokenizer))" "$text"
    evaluate fidelity "$out/validation" --text "$text" --heldout 1 --limit 8 --window 384 \
      --prompt-len 256 --protocol prefill --granularity global --head-floor 0 --head-cap 8 \
      --ratios 0.25,0.125 --kvzip-request plain \
      --policies "rerank@0.5:ranker:$candidate,rerank@0.5:$shipped,kvzip,ranker:$candidate,$shipped" ;;
  *) echo "usage: $0 train | validate" >&2; exit 2 ;;
esac
