#!/bin/sh
# Unpack the C++ tree a Python sdist vendors into SRC, once (nothing happens when SRC/CMakeLists.txt
# exists): the llama.cpp builds (tools/llama_cpp, tools/ik_llama_cpp) take their sources this way.
#
#   tools/vendored_source.sh PACKAGE VERSION VENDOR_PATH DIR
#   e.g. tools/vendored_source.sh llama-cpp-python 0.3.36 vendor/llama.cpp ~/.cache/transmla/llama.cpp-0.3.36
# writes DIR/src (the vendored tree) and keeps the sdist in DIR/sdist; PYTHON picks the pip (python3).
set -eu
PACKAGE=$1 VERSION=$2 VENDOR=$3 DIR=$4
SRC=$DIR/src
[ -f "$SRC/CMakeLists.txt" ] && exit 0
mkdir -p "$DIR"
"${PYTHON:-python3}" -m pip download -q --no-deps --no-binary :all: "$PACKAGE==$VERSION" -d "$DIR/sdist"
STEM=$(echo "$PACKAGE" | tr - _)-$VERSION  # the sdist's file and top folder name
rm -rf "$DIR/unpack" && mkdir -p "$DIR/unpack"
tar xzf "$DIR/sdist/$STEM.tar.gz" -C "$DIR/unpack"
rm -rf "$SRC" && mv "$DIR/unpack/$STEM/$VENDOR" "$SRC"
rm -rf "$DIR/unpack"
