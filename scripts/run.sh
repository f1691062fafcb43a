#!/usr/bin/env bash
# Set up (idempotent; runtime install only: no torch) and run the main job on the embedded
# SmolLM2-135M-Instruct model: `python -m jaxkv.eval` with no arguments, a fidelity comparison of
# the full cache, four heuristics and the shipped learned policy, written to runs/fidelity-<time>/.
# Extra arguments go to `python -m jaxkv.eval` instead, e.g.
#   scripts/run.sh generate --prompt "What is the capital of France?"
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec .venv/bin/python -m jaxkv.eval "$@"
