#!/usr/bin/env bash
# Set up (idempotent) and run the main job on the embedded SmolLM2-135M-Instruct model.
# Extra arguments go to `python -m jaxkv.eval` instead of the default job.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
if [ $# -eq 0 ]; then
  set -- generate --prompt "What is the capital of France?" --max-new-tokens 32
fi
exec .venv/bin/python -m jaxkv.eval "$@"
