#!/usr/bin/env bash
# The one prepared GPU check (bench/gpu_check.py): correctness, speed and serving on a CUDA GPU.
#
#   bench/gpu_check.sh [OUT.json] [gpu_check.py options, e.g. --parts speed or --cpu-smoke]
#
# Runs from a clean clone on a machine with nothing but this repository and a CUDA build of
# torch: it picks a python whose torch sees CUDA ($PYTHON, python3, python, .venv/bin/python),
# and when that python lacks the project's other runtime dependencies it makes .venv-gpu on top
# of it (--system-site-packages: the same torch, never a second one) and pip-installs only what
# is missing, torch excluded (short timeouts: without network, the parts that need a missing
# package report it and the rest runs). The package is used from the checkout (PYTHONPATH), not
# installed. Finishes in under 8 minutes; prints ONE JSON line and writes it to OUT.json
# (default gpu_check.json), also when the python part dies.
set -uo pipefail
cd "$(dirname "$0")/.."
START=$(date +%s)
OUT="${1:-gpu_check.json}"
[ $# -gt 0 ] && shift
TOTAL_S="${GPU_CHECK_TOTAL_S:-470}"
SMOKE=0
for arg in "$@"; do [ "$arg" = "--cpu-smoke" ] && SMOKE=1; done
log() { echo "[gpu_check.sh] $*" >&2; }
emit() {  # a JSON line when the python part could not write one
    local line="{\"check\": \"personaplex-voice gpu_check v1\", \"error\": \"$1\", \"errors\": [\".\"]}"
    mkdir -p "$(dirname "$OUT")" 2>/dev/null
    echo "$line" >"$OUT"
    echo "$line"
}

PY=""
for candidate in "${PYTHON:-}" python3 python .venv/bin/python; do
    [ -n "$candidate" ] || continue
    command -v "$candidate" >/dev/null 2>&1 || [ -x "$candidate" ] || continue
    if [ "$SMOKE" = 1 ]; then
        "$candidate" -c "import torch" 2>/dev/null && PY="$candidate" && break
    elif "$candidate" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
        PY="$candidate"
        break
    fi
done
if [ -z "$PY" ]; then
    log "no python with a CUDA-enabled torch found (set PYTHON=...)"
    emit "no python with a CUDA-enabled torch found"
    exit 1
fi
log "python: $PY ($("$PY" -c 'import torch; print(torch.__version__, torch.version.cuda)' 2>&1))"
command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >&2

# The runtime dependencies (pyproject, torch excluded), as import name=pip requirement.
DEPS="numpy=numpy sentencepiece=sentencepiece soundfile=soundfile soxr=soxr pyloudnorm=pyloudnorm \
opuslib=opuslib typer=typer pydantic=pydantic pydantic_settings=pydantic-settings fastapi=fastapi \
uvicorn=uvicorn[standard] websockets=websockets prometheus_client=prometheus-client tqdm=tqdm \
huggingface_hub=huggingface_hub safetensors=safetensors"
missing() {
    local py="$1" out=""
    for pair in $DEPS; do
        "$py" -c "import ${pair%%=*}" 2>/dev/null || out="$out ${pair#*=}"
    done
    echo "$out"
}
MISSING=$(missing "$PY")
SETUP="{\"missing_before\": \"${MISSING# }\""
if [ -n "$MISSING" ]; then
    log "missing:$MISSING; installing them into .venv-gpu (on top of $PY, same torch)"
    if [ ! -x .venv-gpu/bin/python ]; then
        "$PY" -m venv --system-site-packages .venv-gpu >&2 || log "could not create .venv-gpu"
    fi
    if [ -x .venv-gpu/bin/python ]; then
        # shellcheck disable=SC2086  # one word per requirement
        timeout 150 .venv-gpu/bin/python -m pip install -q --disable-pip-version-check \
            --timeout 10 --retries 1 $MISSING >&2 || log "pip install failed (no network?)"
        if .venv-gpu/bin/python -c "import torch" 2>/dev/null; then
            PY=.venv-gpu/bin/python
        fi
    fi
    STILL=$(missing "$PY")
    SETUP="$SETUP, \"missing_after\": \"${STILL# }\""
    [ -n "$STILL" ] && log "still missing:$STILL (the parts needing them will say so)"
fi
command -v ldconfig >/dev/null 2>&1 && ! ldconfig -p 2>/dev/null | grep -q libopus && {
    log "libopus not found: the serving part needs it (apt-get install libopus0)"
    SETUP="$SETUP, \"libopus\": false"
}
SETUP="$SETUP, \"python\": \"$PY\"}"

ELAPSED=$(($(date +%s) - START))
BUDGET=$((TOTAL_S - ELAPSED - 25))
LIMIT=$((TOTAL_S - ELAPSED))
log "running bench/gpu_check.py (budget ${BUDGET} s, hard limit ${LIMIT} s)"
rm -f "$OUT"
GPU_CHECK_SETUP="$SETUP" PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" \
    timeout -k 10 "$LIMIT" "$PY" bench/gpu_check.py --out "$OUT" --budget-s "$BUDGET" "$@"
RC=$?
[ "$RC" = 0 ] && exit 0
if [ "$RC" = 124 ] || [ "$RC" = 137 ]; then
    WHY="bench/gpu_check.py ran past ${LIMIT} s and was stopped"
else
    WHY="bench/gpu_check.py exited with status $RC"
fi
if [ -s "$OUT" ]; then  # what the parts before the crash measured, with the reason added
    "$PY" -c 'import json, sys
d = json.load(open(sys.argv[1])); d["error"] = sys.argv[2]; d["errors"] = [".", *d.get("errors", [])]
line = json.dumps(d); open(sys.argv[1], "w").write(line + "\n"); print(line)' "$OUT" "$WHY" || emit "$WHY"
else
    emit "$WHY"
fi
exit 1
