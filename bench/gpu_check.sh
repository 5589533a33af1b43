#!/usr/bin/env bash
# Full-size engine on a CUDA GPU: CUDA-graph tick time for 1..64 slots (random bf16 weights).
# Uses a python whose torch sees CUDA: $PYTHON, else python3, else .venv/bin/python.
set -euo pipefail
cd "$(dirname "$0")/.."
for candidate in "${PYTHON:-}" python3 .venv/bin/python; do
    [ -n "$candidate" ] || continue
    if "$candidate" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
        PY="$candidate"
        break
    fi
done
if [ -z "${PY:-}" ]; then
    echo "gpu_check: no python with a CUDA-enabled torch found" >&2
    exit 1
fi
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader || true
PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" exec "$PY" bench/gpu_check.py "$@"
