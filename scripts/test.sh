#!/usr/bin/env bash
# Set up (idempotent, with the test extra) and run lint, format check and the whole test suite.
# Arguments go to pytest (then only that one run).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh test
.venv/bin/ruff check jaxkv tests scripts
.venv/bin/ruff format --check jaxkv tests scripts
if [ $# -gt 0 ]; then
  exec .venv/bin/python -m pytest -q "$@"
fi
# The `datasets` tests (pyarrow) run in a process of their own: with pyarrow loaded, XLA:CPU
# compilation later in the same process crashed (segfault/abort) in 3 of 3 full CI runs.
.venv/bin/python -m pytest -q --ignore=tests/test_hub.py
exec .venv/bin/python -m pytest -q tests/test_hub.py
