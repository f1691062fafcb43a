#!/usr/bin/env bash
# The confirmation run of results/distillcache_fresh/PROTOCOL.md: the chosen DistillCache
# policies and the heuristics on 8 BIG-Bench Hard windows no earlier run read (the second half
# of the held-out text). Writes results/distillcache_fresh/<run>/fidelity.{md,json}; a finished
# run is skipped (delete its folder to redo it). About an hour on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-.venv/bin/python}
source scripts/lib.sh
KVZIP_REQUEST=chat  # kvzip's repeat request in its recorded runs (before session 40)
out=${OUT:-results/distillcache_fresh}
text=runs/distillcache_fresh/heldout.txt
mkdir -p "$out"
write_text reasoning "$text"  # jaxkv.rl.data.HELDOUT_DOMAIN
common=(--text "$text" --heldout 0.5 --limit 8 --window 384 --prompt-len 256 --ratios 0.25,0.125)
q2=rerank:ranker:ranker_kvzip_smollm2_cpu
r1=ranker:ranker_kvzipres_smollm2_cpu
heur=h2o,snapkv,tova,expected_attention,critical:h2o,streaming_llm,knorm
run() {  # name, then fidelity flags
  local name=$1; shift
  evaluate fidelity "$out/$name" "${common[@]}" "$@"
}
run prefill_global --protocol prefill --granularity global \
  --policies kvzip,$q2,$r1,ranker:ranker_global_smollm2_cpu,$heur,oracle
run prefill_head --protocol prefill --granularity head \
  --policies $heur,kvzip,ranker:ranker_smollm2_cpu,oracle
run prefill_nocap --protocol prefill --granularity global --head-floor 0 --head-cap 8 \
  --policies kvzip,$q2,$r1,oracle
run decode_head --protocol decode --granularity head \
  --policies ranker:ranker_smollm2_cpu,$heur,oracle
run decode_global --protocol decode --granularity global \
  --policies ranker:ranker_global_smollm2_cpu,critical:h2o,h2o,tova,oracle
