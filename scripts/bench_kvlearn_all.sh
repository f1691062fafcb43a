#!/usr/bin/env bash
# Regenerates every KVLearn result in results/kvlearn/ (about 15 minutes on a 2-core CPU).
#   bash scripts/bench_kvlearn_all.sh
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=results/kvlearn
mkdir -p "$OUT"
run() { python -c "import sys; from jaxkv.kvlearn.cli import $1; sys.exit($1(sys.argv[1:]))" "${@:2}"; }

# The README's example (policy table) and its JSON.
run eval_main 3000 1.1 4 --json "$OUT/cli_3000_1.1_4.json" | tee "$OUT/cli_3000_1.1_4.txt"
# Quality goals: 3 pools x 3 alphas x 5 seeds x 20,000 requests, every policy.
python scripts/bench_kvlearn_goals.py --out "$OUT"
# Speed goals: 10^6-request run, 64-cell sweep vs 64 sequential runs, API latency at 100k blocks.
python scripts/bench_kvlearn_speed.py --out "$OUT"
python scripts/bench_kvlearn_speed.py --out "$OUT" --parts sweep64 --cells-requests 20000 --repeats 1 --name speed_20k.json
python scripts/bench_kvlearn_api.py --blocks 100000 --repeats 200 --json "$OUT/api_latency.json"
# Offline pre-training, then the README example starting from the pre-trained PRP.
run train_main --n-requests 20000 --alpha 1.1 --pool-gib 4 --epochs 10 --out "$OUT/prp_pretrained" | tee "$OUT/train.txt"
run eval_main 3000 1.1 4 --prp-checkpoint "$OUT/prp_pretrained" --json "$OUT/cli_3000_1.1_4_pretrained.json" \
  | tee "$OUT/cli_3000_1.1_4_pretrained.txt"
