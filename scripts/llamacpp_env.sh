#!/usr/bin/env bash
# Builds .venv-llamacpp: llama.cpp through llama-cpp-python (compiled from the registry's sdist,
# CPU only, tuned for this machine's CPU) plus numpy, for scripts/bench_peers.py. A separate venv
# so the C++ build never touches .venv; bench_peers.py drives it as a subprocess.
#
#   scripts/llamacpp_env.sh          build (idempotent: a stamp skips a finished install)
#
# The multimodal (llava/mtmd) library is not built: the benchmark needs only the text model, and
# it halves the build. Measured: about 7 minutes on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${LLAMACPP_VENV:-.venv-llamacpp}
py=${PYTHON:-python3}
version=${LLAMACPP_VERSION:-0.3.36}
stamp="$venv/.jaxkv-llamacpp-$(cat scripts/llamacpp_env.sh | sha256sum | cut -c1-16)"
if [ ! -f "$stamp" ]; then
  start=$SECONDS
  [ -x "$venv/bin/python" ] || "$py" -m venv "$venv"
  "$venv/bin/python" -m pip install -q --upgrade pip
  # GGML_NATIVE: the same -march=native code a user building llama.cpp here would get, except
  # AMX: on a VM whose CPU advertises it (Sapphire Rapids, session 32) the Q8_0 matmul's first
  # `tileloadd` died with SIGILL, so the tile instructions are never compiled in (jaxkv does
  # not use AMX either). --force-reinstall: a changed script rebuilds over an older build.
  no_amx="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
  CMAKE_ARGS="-DGGML_NATIVE=ON -DLLAVA_BUILD=OFF -DGGML_CUDA=OFF -DGGML_BLAS=OFF \
-DCMAKE_C_FLAGS='$no_amx' -DCMAKE_CXX_FLAGS='$no_amx'" \
    CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)} \
    "$venv/bin/python" -m pip install -q --no-cache-dir --force-reinstall \
    --no-binary llama-cpp-python "llama-cpp-python==$version" numpy
  "$venv/bin/python" -c "import llama_cpp; print('llama_cpp', llama_cpp.__version__)"
  echo "llamacpp_env: $venv built in $((SECONDS - start)) s, $(du -sh "$venv" | cut -f1)"
  touch "$stamp"
fi
