#!/usr/bin/env bash
# Builds llama.cpp's own `llama-server` (continuous batching with --parallel N) from the llama.cpp
# vendored in the llama-cpp-python sdist, outside the repo. Slow on 2 cores, so it runs niced.
# Usage: [LLAMA_NO_AMX=1] bench/peers/build_llama_server.sh [PEERS_DIR]   (default /work/peers)
set -euo pipefail
PEERS="${1:-${PEERS_DIR:-/work/peers}}"
VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
JOBS="${JOBS:-2}"
mkdir -p "$PEERS/sdist"
SDIST="$PEERS/sdist/llama_cpp_python-$VERSION.tar.gz"
if [ ! -f "$SDIST" ]; then
    python3 -m pip download --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$PEERS/sdist"
fi
SRC="$PEERS/llama_cpp_python-$VERSION"
[ -d "$SRC" ] || tar xzf "$SDIST" -C "$PEERS"
BUILD="$PEERS/llama.cpp-build"
start=$(date +%s)
# Release + native CPU flags for best throughput; no curl (no network at run time anyway).
# Some VMs list AMX in /proc/cpuinfo but fault on its first instruction (ldtilecfg: llama-server dies with
# SIGSEGV while loading the model); there the AVX-512 flags are named one by one and AMX left out.
CPU_FLAGS=(-DGGML_NATIVE=ON)
if [ "${LLAMA_NO_AMX:-0}" = 1 ]; then
    CPU_FLAGS=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON
        -DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AVX_VNNI=ON
        -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF)
fi
nice -n 19 cmake -S "$SRC/vendor/llama.cpp" -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF \
    "${CPU_FLAGS[@]}" -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DBUILD_SHARED_LIBS=OFF
nice -n 19 cmake --build "$BUILD" --config Release --target llama-server -j "$JOBS"
echo "llama-server built in $(( $(date +%s) - start )) s: $BUILD/bin/llama-server"
