#!/usr/bin/env bash
# Regenerates every KVLearn result in results/kvlearn/ (about 25 minutes on a 2-core CPU).
#   bash scripts/bench_kvlearn_all.sh
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=results/kvlearn
mkdir -p "$OUT"
KV="python -m jaxkv.eval kvlearn"  # the KVLearn subcommands (sim, serve, calibrate, workload)

# The README's example (policy table) and its JSON.
$KV 3000 1.1 4 --json "$OUT/cli_3000_1.1_4.json" | tee "$OUT/cli_3000_1.1_4.txt"
# Quality goals: 3 pools x 3 alphas x 5 seeds x 20,000 requests, every policy.
python scripts/bench_kvlearn_goals.py --out "$OUT"
# Speed goals: 10^6-request run, 64-cell sweep vs 64 sequential runs, API latency at 100k blocks.
python scripts/bench_kvlearn_speed.py --out "$OUT"
python scripts/bench_kvlearn_speed.py --out "$OUT" --parts sweep64 --cells-requests 20000 --repeats 1 --name speed_20k.json
python scripts/bench_kvlearn_api.py --blocks 100000 --repeats 200 --json "$OUT/api_latency.json"
# Offline pre-training, then the README example starting from the pre-trained PRP.
python -m jaxkv.train kvlearn --n-requests 20000 --alpha 1.1 --pool-gib 4 --epochs 10 --out "$OUT/prp_pretrained" | tee "$OUT/train.txt"
$KV sim 3000 1.1 4 --prp-checkpoint "$OUT/prp_pretrained" --json "$OUT/cli_3000_1.1_4_pretrained.json" \
  | tee "$OUT/cli_3000_1.1_4_pretrained.txt"

# Serving scale (Mooncake trace): goals, speed, the CLI example, the load sweep, MM-Session.
TRACE=example  # the Mooncake example trace shipped with jaxkv (jaxkv/data/mooncake_traces/)
python scripts/bench_kvlearn_serving.py --out "$OUT"
python scripts/bench_kvlearn_serving.py --speed --out "$OUT"
$KV serve --trace "$TRACE" --pool-gib 686 --prefill-nodes 24 --load-scale 1 \
  --json "$OUT/serving_cli_686gib.json" | tee "$OUT/serving_cli_686gib.txt"
$KV serve --trace "$TRACE" --sweep --fracs 0.05,0.1,0.25,0.5 --loads 0.5,1,1.5,2 \
  --plot "$OUT/serving_sweep.png" --json "$OUT/serving_sweep.json" | tee "$OUT/serving_sweep.txt"
MM=$(mktemp -d)/mm.jsonl
$KV workload mmsession --sessions 1500 --seed 0 --out "$MM"
$KV serve --trace "$MM" --pool-frac 0.1 --prefill-nodes 4 | tee "$OUT/serving_mmsession_cli.txt"
