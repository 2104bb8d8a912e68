#!/bin/sh
# Build ik_llama.cpp as vendored by the ik-llama-cpp-python 0.1.5 sdist (the llama.cpp fork with MLA
# modes -mla 1/2/3 and CPU flash MLA kernels) into a cache outside the work tree, once; later runs reuse
# it. Only what tests and benchmarks run is built: libllama (shared), llama-perplexity, llama-bench,
# llama-batched-bench and our transmla-logits tool (tools/llama_cpp/logits.cpp compiled with
# -DIK_LLAMA_CPP: ik's llama.h differs a little from mainline's). The sdist lacks
# common/cmake/build-info-gen-cpp.cmake, so common/build-info.cpp is written here from its template first.
#
# IK_PATCHES (optional): names of patches in this folder applied to the source before the build, e.g.
# "parallel-flash-attention parallel-mla-decode" (applied in that order; `make ik-llama-cpp-patched` names the
# whole list: ik with those changes, built into a folder of its own for the benchmark rows that measure them; the
# plain build stays the engine as its users get it).
#
#   tools/ik_llama_cpp/build.sh [DIR]   (DIR defaults to $IK_LLAMA_CPP_DIR or ~/.cache/transmla/ik_llama.cpp-0.1.5)
set -eu
VERSION=0.1.5
DIR=${1:-${IK_LLAMA_CPP_DIR:-$HOME/.cache/transmla/ik_llama.cpp-$VERSION}}
HERE=$(cd "$(dirname "$0")" && pwd)
LOGITS=$HERE/../llama_cpp/logits.cpp
PY=${PYTHON:-python3}
JOBS=${JOBS:-2}
BIN=$DIR/build/bin
TARGETS="llama llama-perplexity llama-bench llama-batched-bench"

built=yes
for t in llama-perplexity llama-bench llama-batched-bench; do [ -x "$BIN/$t" ] || built=no; done
logits() {  # libllama and libggml stay in the build tree (build/src, build/ggml/src), as llama-bench finds them
    LIBS="$DIR/build/src:$DIR/build/ggml/src"
    ${CXX:-g++} -O2 -std=c++17 -DIK_LLAMA_CPP "$LOGITS" -I"$SRC/include" -I"$SRC/ggml/include" \
        -L"$DIR/build/src" -L"$DIR/build/ggml/src" -lllama -lggml -Wl,-rpath,"$LIBS" -o "$BIN/transmla-logits"
}
SRC=$DIR/src
if [ $built = yes ]; then
    [ "$BIN/transmla-logits" -nt "$LOGITS" ] || logits
    exit 0
fi
mkdir -p "$DIR"
PYTHON=$PY "$HERE/../vendored_source.sh" ik-llama-cpp-python "$VERSION" vendor/ik_llama.cpp "$DIR"
: >"$DIR/transmla-patches"
for patch in ${IK_PATCHES:-}; do  # applied once: a rerun after a failed build finds the source patched
    patch -d "$SRC" -p1 -R -s -f --dry-run <"$HERE/$patch.patch" >/dev/null 2>&1 ||
        patch -d "$SRC" -p1 -s --forward <"$HERE/$patch.patch"
    echo "$patch" >>"$DIR/transmla-patches"  # read by transmla.bench.llama_cpp.applied_patches
done
sed -e 's/@BUILD_NUMBER@/0/' -e "s/@BUILD_COMMIT@/ik-llama-cpp-python-$VERSION/" \
    -e "s/@BUILD_COMPILER@/$(${CXX:-g++} --version | head -1 | tr -d '"')/" -e 's/@BUILD_TARGET@/native/' \
    "$SRC/common/build-info.cpp.in" >"$SRC/common/build-info.cpp"
start=$(date +%s)
cmake -S "$SRC" -B "$DIR/build" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON \
    -DLLAMA_CURL=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_TESTS=OFF \
    -DLLAMA_BUILD_EXAMPLES=ON -DGGML_NATIVE=ON -DGGML_CCACHE=OFF >"$DIR/cmake.log"
cmake --build "$DIR/build" -j "$JOBS" --target $TARGETS >"$DIR/build.log"
logits
echo "ik_llama.cpp $VERSION built in $(( $(date +%s) - start )) s: $BIN" >&2
