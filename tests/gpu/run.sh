#!/usr/bin/env bash
# The real-GPU checks in one go, for a machine with an NVIDIA GPU and driver:
# the `gpu`-marked tests, then `gpu-share discover` as a table and as JSON.
# Usage (from the repository root): tests/gpu/run.sh    (PYTHON=... to use another interpreter)
set -uo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
if ! "$PY" -c "import deviceplugin, pytest" 2>/dev/null; then
  "$PY" -m venv .venv-gpu && .venv-gpu/bin/pip install -q '.[test]' && PY=.venv-gpu/bin/python
fi
status=0
nvidia-smi -L || echo "nvidia-smi not found"
"$PY" -m pytest -m gpu tests/gpu -v -rs || status=$?
"$PY" -m deviceplugin.cli discover || status=$?
"$PY" -m deviceplugin.cli discover --json || status=$?
exit $status
