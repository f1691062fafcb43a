#!/usr/bin/env bash
# Regenerates the evaluation tables and plots in results/ on the embedded SmolLM2-135M model.
#
#   scripts/reproduce_results.sh            # everything below (~40 min on an idle 2-core CPU)
#   QUICK=1 scripts/reproduce_results.sh    # fidelity + positions + latency only (~20 min)
#   OUT=/tmp/res scripts/reproduce_results.sh
#
# Each step writes <name>.json / .md / .png under $OUT and saves after every finished cell, so
# an interrupted run keeps what it has. Sizes are chosen for a shared 2-core CPU; raise --limit
# (and add ratios / lengths) on a bigger machine. Every step includes the shipped learned policy;
# POLICIES_EXTRA=learned:runs/distillcache_cpu/policy (or learned:'runs/seed*/policy' for seeds)
# replaces it with your own, POLICIES_EXTRA= drops it.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-results}
POLICIES_EXTRA=${POLICIES_EXTRA-learned:distillcache_smollm2_cpu}
EXTRA=${POLICIES_EXTRA:+,$POLICIES_EXTRA}
HEUR=random,streaming_llm,h2o,snapkv,tova,keydiff,knorm
EVAL=(python -m jaxkv.eval)
start=$(date +%s)
step() { echo "== $* ($(($(date +%s) - start)) s)" >&2; "${EVAL[@]}" "$@" --out "$OUT"; }

# Fig. 1: per-step KL and perplexity increase, 4 windows x (256 prefix + 128 teacher-forced).
step fidelity --policies "full,$HEUR$EXTRA" --ratios 1,0.5,0.25,0.125 --seeds 0,1,2 --limit 4
# Fig. 5: where kept tokens sit after 512-token windows.
step positions --policies "$HEUR$EXTRA" --ratios 0.25 --seeds 0 --limit 4
# Table 3: per-component decode latency and tokens/s at 1K context.
step latency --policies "full,streaming_llm,h2o,snapkv,tova,knorm$EXTRA" --ratios 0.25 \
  --context 1024 --new-tokens 32 --repeats 3
if [[ -n "${QUICK:-}" ]]; then exit 0; fi
# Table 2 axis: passkey / needle retrieval at 1K and 2K tokens, 6 seeded prompts each.
step retrieval --policies "full,streaming_llm,h2o,snapkv$EXTRA" --ratios 0.25 \
  --seeds 0 --lengths 1024,2048 --limit 6
# Table 8: agreement with full-cache generations and error modes (GSM8K prompts, 128 tokens).
step agreement --policies "streaming_llm,h2o,snapkv,tova$EXTRA" --ratios 0.25 --seeds 0 \
  --task gsm8k --limit 4 --max-new-tokens 128
# Table 1 axis: GSM8K (8-shot CoT) and BBH (3-shot CoT) exact match, greedy, 512 new tokens.
# A 135M model solves few of these: the rows show how much compression changes that, and
# the agreement step above is the finer measure.
step gsm8k --policies "full,streaming_llm,h2o,snapkv,tova$EXTRA" --ratios 0.25 --limit 8
step bbh --policies "full,streaming_llm,h2o,snapkv,tova$EXTRA" --ratios 0.25 --limit 4 \
  --tasks boolean_expressions,navigate,sports_understanding
echo "done in $(($(date +%s) - start)) s; results in $OUT/" >&2
