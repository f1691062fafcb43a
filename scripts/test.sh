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
# in 4 of 4 full runs this session, at different tests.
passed=0 failed=0 skipped=0 status=0
for file in tests/test_*.py; do
  out=$(.venv/bin/python -m pytest -q -p no:cacheprovider "$file" 2>&1) || rc=$?
  rc=${rc:-0}
  last=$(printf '%s\n' "$out" | tail -n 1)
  echo "$file: $last"
  if [ "$rc" -ne 0 ] && [ "$rc" -ne 5 ]; then
    printf '%s\n' "$out" | tail -n 60
    status=1
  fi
  for kind in passed failed skipped; do
    n=$(printf '%s\n' "$last" | grep -oE "[0-9]+ $kind" | grep -oE "^[0-9]+" || true)
    eval "$kind=\$(( $kind + ${n:-0} ))"
  done
  if [ "$rc" -ne 0 ] && [ "$rc" -ne 5 ] && ! printf '%s' "$last" | grep -q failed; then
    failed=$((failed + 1))  # a crash or an error that reported no failed test
  fi
  unset rc
done
echo "$passed passed, $failed failed, $skipped skipped"
exit $status
