#!/usr/bin/env bash
# results/retrieval_fresh/PROTOCOL.md: needle / passkey at 1K / 2K, r = 0.25, data seed 1, for
# the learned rankers and the heuristics at global and head granularity. A finished run is
# skipped (delete its folder to redo it).
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-.venv/bin/python}
source scripts/lib.sh
out=${OUT:-results/retrieval_fresh}
common=(--ratios 0.25 --limit 8 --data-seed 1 --tasks passkey,needle --lengths 1024,2048)
run() {  # name, then retrieval flags
  local name=$1; shift
  evaluate retrieval "$out/$name" "${common[@]}" "$@"
}
run global --granularity global --policies full,ranker:ranker_global_smollm2_cpu,h2o,critical:h2o,tova
run head --granularity head --policies ranker:ranker_smollm2_cpu,h2o,critical:h2o,tova,snapkv
