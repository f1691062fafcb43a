#!/usr/bin/env bash
# Set up (idempotent, with the test extra) and run lint, format check and the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh test
.venv/bin/ruff check jaxkv tests scripts
.venv/bin/ruff format --check jaxkv tests scripts
exec .venv/bin/python -m pytest -q "$@"
