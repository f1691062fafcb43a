#!/usr/bin/env bash
# results/retrieval_recall/PROTOCOL.md: `train` trains the one candidate (the pooled ranker's
# recipe plus the recall domain) and applies the validation rule; `heldout` runs retrieval on
# data seed 2 and fidelity on unread BIG-Bench Hard windows, once. A finished run is skipped
# (delete its folder to redo it). Writes results/retrieval_recall/<run>/.
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-.venv/bin/python}
source scripts/lib.sh
out=${OUT:-results/retrieval_recall}
ship=jaxkv/checkpoints/ranker_recall_smollm2_cpu
candidate=ranker:$ship
pooled=ranker:ranker_global_smollm2_cpu
case "${1:-}" in
  train)
    [[ -f runs/ranker_recall/ranker.json ]] || "$py" -m jaxkv.train ranker \
      --domains prose,math,code,chat,recall --windows-per-domain 12 --steps 1500 \
      --target value --pool 90 --rows-per-step 270 --out runs/ranker_recall
    "$py" - "$ship" <<'PY'
import json, shutil, sys
from pathlib import Path
import numpy as np
def kept(path):
    v = json.loads(Path(path, "ranker.json").read_text())["validation"]
    return float(np.mean([r["kept_0.25"] for d in ("prose", "math", "code", "chat") for r in v[d].values()]))
new, old = kept("runs/ranker_recall"), kept("jaxkv/checkpoints/ranker_global_smollm2_cpu")
ok = new >= old - 0.005
print(f"kept_0.25 on the training domains' validation: candidate {new:.4f}, pooled ranker {old:.4f}: "
      f"{'passes' if ok else 'fails'} the rule (>= {old - 0.005:.4f})")
if ok and not Path(sys.argv[1]).exists():
    shutil.copytree("runs/ranker_recall", sys.argv[1])
PY
    ;;
  heldout)
    [[ -d $ship ]] || candidate=ranker:runs/ranker_recall  # failed the rule: evaluated anyway
    recall_heldout "$out" 2 0.875 "full,$candidate,$pooled,h2o,critical:h2o,tova" \
      "$candidate,h2o,critical:h2o,tova,snapkv" "$candidate,$pooled" ;;
  *) echo "usage: $0 train | heldout" >&2; exit 2 ;;
esac
