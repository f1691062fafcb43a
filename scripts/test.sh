#!/usr/bin/env bash
# Set up (idempotent, with the test extra) and run lint, format check and the whole test suite.
# Arguments go to one pytest run instead (e.g. scripts/test.sh tests/test_decoder.py -k parity).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh test
.venv/bin/ruff check jaxkv tests scripts
.venv/bin/ruff format --check jaxkv tests scripts
if [ $# -gt 0 ]; then
  exec .venv/bin/python -m pytest -q "$@"
fi
# One pytest process per test file: in one process for the whole suite, XLA:CPU compilation
# crashed (segfault or abort inside backend_compile) after several thousand compiled programs,
# in 4 of 4 full runs this session, at different tests. JAXKV_TEST_JOBS files run at once
# (default 2: one pytest process leaves about a third of two cores idle, in compilation and
# Python); the embedded model's cache is written first, so no two processes build it at once.
jobs=${JAXKV_TEST_JOBS:-2}
.venv/bin/python -c "from jaxkv.model import loading
for dtype in ('float32', 'bfloat16'):
    loading.load_model('smollm2-135m', dtype=dtype)"
logs=$(mktemp -d)
trap 'rm -rf "$logs"' EXIT
run_file() {  # FILE LOGS: runs one test file, keeps its output, exit status and wall seconds,
  # prints its last line
  local out="$2/$(basename "$1")"
  local rc=0 start=$SECONDS
  .venv/bin/python -m pytest -q -p no:cacheprovider "$1" >"$out" 2>&1 || rc=$?
  echo "$rc" >"$out.rc"
  echo "$((SECONDS - start)) $1" >"$out.s"
  echo "$1: $(tail -n 1 "$out")"
}
export -f run_file
printf '%s\n' tests/test_*.py | xargs -P "$jobs" -I{} bash -c 'run_file "$1" "$2"' _ {} "$logs"
passed=0 failed=0 skipped=0 status=0
for file in tests/test_*.py; do
  out="$logs/$(basename "$file")"
  rc=$(cat "$out.rc")
  last=$(tail -n 1 "$out")
  if [ "$rc" -ne 0 ] && [ "$rc" -ne 5 ]; then
    echo "== $file (exit $rc):"
    tail -n 60 "$out"
    status=1
  fi
  for kind in passed failed skipped; do
    n=$(printf '%s\n' "$last" | grep -oE "[0-9]+ $kind" | grep -oE "^[0-9]+" || true)
    eval "$kind=\$(( $kind + ${n:-0} ))"
  done
  if [ "$rc" -ne 0 ] && [ "$rc" -ne 5 ] && ! printf '%s' "$last" | grep -q failed; then
    failed=$((failed + 1))  # a crash or an error that reported no failed test
  fi
done
echo "slowest test files (wall seconds, $jobs at a time):"
sort -rn "$logs"/*.s | head -n 8 | sed 's/^/  /'
echo "$passed passed, $failed failed, $skipped skipped"
exit $status
