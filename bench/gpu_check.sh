#!/usr/bin/env bash
# The one prepared GPU check (bench/gpu_check.py): correctness, speed and serving on a CUDA GPU.
#
#   bench/gpu_check.sh [OUT.json] [gpu_check.py options, e.g. --parts speed or --cpu-smoke]
#
# Runs from a clean clone on a machine with nothing but this repository and a CUDA build of
# torch (any version from 2.4): it picks a python whose torch sees CUDA ($PYTHON, python3,
# python, .venv/bin/python). When that python lacks the project's other runtime dependencies
# (or libopus), it makes .venv-gpu on top of it (a .pth file gives it every site-packages that
# python sees: the same torch, never a second one) and installs what is missing:
# - from the offline bundle when one lies in the checkout (offline-bundle/, made by `make
#   bundle` on a connected machine, or the folder $PERSONAPLEX_BUNDLE names): its install.sh,
#   never the network (docs/deploy.md);
# - otherwise with pip from the network, torch excluded (short timeouts: without network, the
#   parts that need a missing package report it and the rest runs).
# The package is used from the checkout (PYTHONPATH). Finishes in under 8 minutes; prints ONE
# JSON line and writes it to OUT.json (default gpu_check.json), also when the python part dies.
# Beside it, as the run goes: OUT.jsonl (every row and part as it finishes, one JSON line each),
# OUT.log (every line of this script and of the check, whole) and OUT.server.log (the serving
# part's server). A SIGTERM (a timeout, a kill) reaches the check, which keeps every finished
# row, ends its subprocesses and deletes its large files.
set -uo pipefail
cd "$(dirname "$0")/.."
START=$(date +%s)
OUT="${1:-gpu_check.json}"
[ $# -gt 0 ] && shift
mkdir -p "$(dirname "$OUT")" 2>/dev/null
LOG="${OUT%.json}.log"
[ "$LOG" = "$OUT" ] && LOG="$OUT.log"
: >"$LOG"
TOTAL_S="${GPU_CHECK_TOTAL_S:-470}"
SMOKE=0
for arg in "$@"; do [ "$arg" = "--cpu-smoke" ] && SMOKE=1; done
log() { echo "[gpu_check.sh] $*" | tee -a "$LOG" >&2; }
emit() {  # a JSON line when the python part could not write one
    local line="{\"check\": \"personaplex-voice gpu_check v3\", \"error\": \"$1\", \"errors\": [\".\"]}"
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
log "python: $PY ($("$PY" -W ignore -c 'import torch; print(torch.__version__, torch.version.cuda)' 2>&1))"
command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader >&2
# torch.__version__ compares as a version from torch 1.x on (TorchVersion); no newer API is used.
if ! "$PY" -c "import sys, torch; sys.exit(0 if torch.__version__ >= '2.4' else 1)" 2>/dev/null; then
    log "torch $("$PY" -c 'import torch; print(torch.__version__)' 2>&1) is older than 2.4: the project needs torch>=2.4"
    emit "torch older than 2.4"
    exit 1
fi

# What the check imports (torch excluded), as import name=pip requirement: the host's CUDA
# image usually has the first line; the offline bundle's gpu profile carries the rest
# (`make bundle PROFILE=gpu`). Audio voices (soundfile, pyloudnorm) and --ssl (cryptography)
# are not used by the check.
DEPS="numpy=numpy sentencepiece=sentencepiece safetensors=safetensors typer=typer tqdm=tqdm \
prometheus_client=prometheus-client \
fastapi=fastapi pydantic=pydantic pydantic_settings=pydantic-settings uvicorn=uvicorn \
httptools=httptools websockets=websockets soxr=soxr"
missing() {  # the packages $1 cannot import, and opuslib / libopus as the project's loader sees them
    local py="$1" out="" why
    for pair in $DEPS; do
        "$py" -c "import ${pair%%=*}" 2>/dev/null || out="$out ${pair#*=}"
    done
    # never `import opuslib` directly: it looks for a system libopus only, where the bundle's is
    # found by the project's loader alone (personaplex_voice/audio/opus_library.py)
    "$py" -c "import importlib.util, sys; sys.exit(0 if importlib.util.find_spec('opuslib') else 1)" \
        2>/dev/null || out="$out opuslib"
    why=$(PYTHONPATH="$PWD" "$py" -c "from personaplex_voice.audio.opus_library import require_opus; require_opus()" 2>&1) ||
        case "$why" in *"package opuslib"*) ;; *) out="$out libopus" ;; esac
    echo "$out"
}
# .venv-gpu over $1: it sees exactly the site-packages $1 sees (the host's torch among them,
# and the system's when $1 sees them), through a .pth file that adds them after its own. No
# pip or setuptools of its own (they would shadow the host's: torch requires a recent
# setuptools, and a venv's seeded one is older): $1's pip runs in it, else ensurepip's.
make_gpu_venv() {
    local py="$1" site
    [ -x .venv-gpu/bin/python ] || "$py" -m venv --without-pip .venv-gpu >&2 || return 1
    site=$(.venv-gpu/bin/python -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])') || return 1
    "$py" -c 'import sys; dirs = [p for p in sys.path if p.endswith(("site-packages", "dist-packages"))]
print(f"import site; list(map(site.addsitedir, {dirs!r}))")' >"$site/host-python.pth" || return 1
    .venv-gpu/bin/python -m pip --version >/dev/null 2>&1 || .venv-gpu/bin/python -m ensurepip --default-pip >&2
}
BUNDLE="${PERSONAPLEX_BUNDLE:-offline-bundle}"
[ -f "$BUNDLE/install.sh" ] && [ -f "$BUNDLE/manifest.json" ] || BUNDLE=""
MISSING=$(missing "$PY")
if [ -n "$BUNDLE" ]; then
    SETUP="{\"bundle\": \"$BUNDLE\", \"from_bundle\": \"${MISSING# }\""
else
    SETUP="{\"missing_before\": \"${MISSING# }\""
fi
if [ -n "$MISSING" ]; then
    if make_gpu_venv "$PY"; then
        if [ -n "$BUNDLE" ]; then
            log "missing:$MISSING; installing the offline bundle $BUNDLE into .venv-gpu (on top of $PY, same torch; no network)"
            bash "$BUNDLE/install.sh" .venv-gpu/bin/python 2>&1 | tee -a "$LOG" >&2 ||
                log "the bundle's install.sh failed"
        else
            log "missing:$MISSING; installing them into .venv-gpu (on top of $PY, same torch)"
            # shellcheck disable=SC2086  # one word per requirement
            timeout 150 .venv-gpu/bin/python -m pip install -q --disable-pip-version-check \
                --timeout 10 --retries 1 ${MISSING/libopus/} >&2 || log "pip install failed (no network?)"
        fi
        if .venv-gpu/bin/python -c "import torch" 2>/dev/null; then
            PY=.venv-gpu/bin/python
        fi
    else
        log "could not create .venv-gpu"
    fi
    STILL=$(missing "$PY")
    SETUP="$SETUP, \"missing_after\": \"${STILL# }\""
    [ -n "$STILL" ] && log "still missing:$STILL (the parts needing them will say so)"
    case "$STILL" in *libopus*) log "libopus not found: the serving part needs it (apt-get install libopus0, or an offline bundle)" ;; esac
fi
SETUP="$SETUP, \"python\": \"$PY\"}"

ELAPSED=$(($(date +%s) - START))
BUDGET=$((TOTAL_S - ELAPSED - 25))
LIMIT=$((TOTAL_S - ELAPSED))
log "running bench/gpu_check.py (budget ${BUDGET} s, hard limit ${LIMIT} s)"
rm -f "$OUT"
# In the background, waited for: a TERM / INT / HUP to this script is passed on to it (through
# timeout, which forwards it), rather than leaving it running past us.
GPU_CHECK_SETUP="$SETUP" PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" \
    timeout -k 20 "$LIMIT" "$PY" bench/gpu_check.py --out "$OUT" --budget-s "$BUDGET" "$@" &
CHECK=$!
STOPPED=""
forward() {
    STOPPED="$1"
    log "got SIG$1: passing it on to the check"
    kill -s "$1" "$CHECK" 2>/dev/null
}
trap 'forward TERM' TERM
trap 'forward INT' INT
trap 'forward HUP' HUP
RC=0
wait "$CHECK" || RC=$?
while kill -0 "$CHECK" 2>/dev/null; do  # a trapped signal ends `wait` early: wait again
    wait "$CHECK"
    RC=$?
done
trap - TERM INT HUP
[ "$RC" = 0 ] && exit 0
if [ -n "$STOPPED" ]; then
    WHY="stopped by SIG$STOPPED; the finished rows are in ${OUT%.json}.jsonl"
elif [ "$RC" = 124 ] || [ "$RC" = 137 ]; then
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
