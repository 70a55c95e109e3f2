#!/usr/bin/env bash
# Installs everything mirrorsd needs on a fresh machine (idempotent: a second run installs nothing new).
# torch comes first, pinned to the CPU wheel on this machine's disk, so that no resolver ever pulls a CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.__version__.startswith('2.13.0') else 1)" 2>/dev/null; then
    "$PY" -m pip install -q "torch==2.13.0"
fi
EXTRAS="export,openvino,dev"
if [[ "${1:-}" == "--peers" ]]; then
    EXTRAS="$EXTRAS,peers"  # what `mirrorsd bench --modes ...,hf-assisted,ov-sd` compares against
fi
"$PY" -m pip install -q -e ".[$EXTRAS]" "torch==2.13.0" "transformers==4.57.6"
