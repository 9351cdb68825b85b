#!/usr/bin/env bash
# Installs llama-cpp-python[server] (its wheel compiles llama.cpp) into a separate venv outside the repo.
# Usage: bench/peers/install_llama_cpp_python.sh [PEERS_DIR]   (default /work/peers)
set -euo pipefail
PEERS="${1:-${PEERS_DIR:-/work/peers}}"
VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
PY="${PYTHON:-python3}"
[ -x "$PEERS/venv/bin/python" ] || "$PY" -m venv "$PEERS/venv"
start=$(date +%s)
# The llava/mtmd library is not needed for a text model; skipping it halves the compile.
CMAKE_ARGS="-DLLAVA_BUILD=OFF -DLLAMA_CURL=OFF -DGGML_NATIVE=ON" CMAKE_BUILD_PARALLEL_LEVEL="${JOBS:-2}" \
    nice -n 19 "$PEERS/venv/bin/pip" install --no-cache-dir "llama-cpp-python[server]==$VERSION"
echo "llama-cpp-python[server] installed in $(( $(date +%s) - start )) s into $PEERS/venv"
