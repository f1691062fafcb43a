#!/usr/bin/env bash
# Peer comparison with NVIDIA kvpress under the compress-once protocol (issue 14, item 4).
#
#   scripts/compare_kvpress.sh [TEXT_FILE]          the full comparison (default: tinyshakespeare)
#   scripts/compare_kvpress.sh --quick [TEXT_FILE]  1 window, 2 presses, 2 jaxkv policies, shared
#
# Steps (each writes under $OUT, default runs/kvpress-compare/):
#   1. builds .venv-kvpress (torch==2.13.0, the CPU wheel; transformers<5.3; kvpress; gguf):
#      never touches .venv or jaxkv's install requirements; a stamp skips a finished build;
#   2. jaxkv (.venv) exports the fidelity eval's windows of TEXT_FILE, its full-cache logits and
#      the positions its policies keep (scripts/compare_kvpress_export.py);
#   3. jaxkv: python -m jaxkv.eval fidelity --protocol prefill --granularity G for every G in
#      $GRANULARITIES, policies $JAXKV_POLICIES, on the same windows;
#   4. kvpress (.venv-kvpress): every press of $PRESSES on the same windows, after checking that
#      its full-cache logits equal jaxkv's (scripts/compare_kvpress_run.py);
#   5. one joint table: results/kvpress_comparison.md and .json (scripts/compare_kvpress_table.py).
#
# Settings (environment): LIMIT (windows, 8), WINDOW (384), PROMPT_LEN (256), HELDOUT (tail
# fraction of the text, 0.1; use 1 for a file that is held out as a whole), OFFSET (tokens of
# that part skipped first, 0: fidelity's --offset), RATIOS (0.25,0.125),
# JAXKV_POLICIES (comma list; add learned:/ranker: names here), GRANULARITIES, PRESSES (names in
# compare_kvpress_run.PRESSES; default all), OUT, RESULTS (the table's path without suffix), TOL
# (max |Δlogit| of the full caches), STEPS (which steps to run, default "1 2 3 4 5"),
# KVZIP_REQUEST (jaxkv's kvzip request, fidelity's --kvzip-request; default plain, the request
# KVzipPress gets here; tables before session 40 were made with chat).
# Not part of CI. Time on this project's 2-core machine: see results/kvpress_comparison.md.
set -euo pipefail
cd "$(dirname "$0")/.."
quick=0
if [ "${1:-}" = --quick ]; then quick=1; shift; fi
text=${1:-}
venv=${KVPRESS_VENV:-.venv-kvpress}
py=${PYTHON:-python3.11}
out=${OUT:-runs/kvpress-compare}
results=${RESULTS:-results/kvpress_comparison}
if [ "$quick" = 1 ]; then
  : "${LIMIT:=1}" "${PRESSES:=StreamingLLMPress,KnormPress}" "${GRANULARITIES:=shared}"
  : "${JAXKV_POLICIES:=streaming_llm,knorm}"
  out=${OUT:-runs/kvpress-compare-quick}
  results=${RESULTS:-$out/kvpress_comparison}
fi
limit=${LIMIT:-8}
window=${WINDOW:-384}
prompt_len=${PROMPT_LEN:-256}
heldout=${HELDOUT:-0.1}
offset=${OFFSET:-0}
ratios=${RATIOS:-0.25,0.125}
policies=${JAXKV_POLICIES:-streaming_llm,h2o,snapkv,tova,keydiff,knorm,critical:h2o,kvzip,oracle}
granularities=${GRANULARITIES:-shared layer head adaptive global}
steps=${STEPS:-1 2 3 4 5}
text_args=()
if [ -n "$text" ]; then text_args=(--text "$text"); fi
[ -x .venv/bin/python ] || { echo "compare_kvpress: run scripts/run.sh first (.venv)" >&2; exit 1; }
mkdir -p "$out"
t_all=$SECONDS

step() { [[ " $steps " == *" $1 "* ]]; }

if step 1; then
  stamp="$venv/.kvpress-$(sha256sum scripts/compare_kvpress.sh | cut -c1-16)"
  if [ ! -f "$stamp" ]; then
    t=$SECONDS
    [ -x "$venv/bin/python" ] || "$py" -m venv "$venv"
    "$venv/bin/python" -m pip install -q --upgrade pip
    # torch==2.13.0 resolves to the CPU wheel here; any other torch spec may pull CUDA builds.
    "$venv/bin/python" -m pip install -q "torch==2.13.0" "transformers<5.3" "kvpress==0.5.5" \
      "gguf" 2> >(grep -v "^WARNING: Location" >&2)
    if "$venv/bin/python" -m pip list 2>/dev/null | grep -qi '^nvidia-'; then
      echo "compare_kvpress: a CUDA package was installed into $venv" >&2
      exit 1
    fi
    "$venv/bin/python" -c "import kvpress, gguf, torch; assert not torch.cuda.is_available()"
    echo "compare_kvpress: $venv built in $((SECONDS - t)) s"
    touch "$stamp"
  fi
fi

if step 2; then
  t=$SECONDS
  kept=${KEPT:-}
  .venv/bin/python scripts/compare_kvpress_export.py --out "$out" "${text_args[@]}" \
    --heldout "$heldout" --offset "$offset" --window "$window" --prompt-len "$prompt_len" \
    --limit "$limit" --ratios "$ratios" ${kept:+--kept "$kept"}
  echo "compare_kvpress: export $((SECONDS - t)) s"
fi

if step 3; then
  for g in $granularities; do
    t=$SECONDS
    .venv/bin/python -m jaxkv.eval fidelity --protocol prefill --granularity "$g" \
      --policies "$policies" --ratios "$ratios" --limit "$limit" "${text_args[@]}" \
      --heldout "$heldout" --offset "$offset" --window "$window" --prompt-len "$prompt_len" \
      --kvzip-request "${KVZIP_REQUEST:-plain}" --out "$out/jaxkv-$g"
    echo "compare_kvpress: jaxkv $g $((SECONDS - t)) s"
  done
fi

if step 4; then
  t=$SECONDS
  "$venv/bin/python" scripts/compare_kvpress_run.py --dir "$out" --ratios "$ratios" \
    --limit "$limit" ${PRESSES:+--presses "$PRESSES"} ${TOL:+--tol "$TOL"}
  echo "compare_kvpress: kvpress $((SECONDS - t)) s"
fi

if step 5; then
  .venv/bin/python scripts/compare_kvpress_table.py --dir "$out" --out "$results" \
    --text "${text:-tinyshakespeare (jaxkv default)}"
fi
echo "compare_kvpress: done in $((SECONDS - t_all)) s"
