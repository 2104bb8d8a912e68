#!/bin/sh
# Build llama.cpp as vendored by the llama-cpp-python 0.3.36 sdist (llama.cpp of October 2026, with
# MLA for the deepseek2 architecture) into a cache outside the work tree, once; later runs reuse it.
# Only what tests and benchmarks run is built: libllama (shared), llama-perplexity, llama-bench,
# llama-completion, llama-tokenize, llama-quantize and our small transmla-logits tool (tools/llama_cpp/logits.cpp).
#
#   tools/llama_cpp/build.sh [DIR]      (DIR defaults to $LLAMA_CPP_DIR or ~/.cache/transmla/llama.cpp-0.3.36)
set -eu
VERSION=0.3.36
DIR=${1:-${LLAMA_CPP_DIR:-$HOME/.cache/transmla/llama.cpp-$VERSION}}
HERE=$(cd "$(dirname "$0")" && pwd)
PY=${PYTHON:-python3}
JOBS=${JOBS:-2}
BIN=$DIR/build/bin
TARGETS="llama-perplexity llama-bench llama-completion llama-tokenize llama-quantize"

built=yes
for t in $TARGETS; do [ -x "$BIN/$t" ] || built=no; done
if [ $built = yes ] && [ "$BIN/transmla-logits" -nt "$HERE/logits.cpp" ]; then
    exit 0
fi
mkdir -p "$DIR"
SRC=$DIR/src
PYTHON=$PY "$HERE/../vendored_source.sh" llama-cpp-python "$VERSION" vendor/llama.cpp "$DIR"
start=$(date +%s)
cmake -S "$SRC" -B "$DIR/build" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON \
    -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_TESTS=OFF \
    -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=ON -DGGML_NATIVE=ON >"$DIR/cmake.log"
cmake --build "$DIR/build" -j "$JOBS" --target $TARGETS >"$DIR/build.log"
${CXX:-g++} -O2 -std=c++17 "$HERE/logits.cpp" -I"$SRC/include" -I"$SRC/ggml/include" \
    -L"$BIN" -lllama -lggml -lggml-base -Wl,-rpath,"$BIN" -o "$BIN/transmla-logits"
echo "llama.cpp $VERSION built in $(( $(date +%s) - start )) s: $BIN" >&2
