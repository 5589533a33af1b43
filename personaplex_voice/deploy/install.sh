#!/usr/bin/env bash
# Install this offline bundle of personaplex-voice into a Python environment that already has
# torch (the host's own CUDA build: the bundle carries none). No network is used.
#
#   ./install.sh [PYTHON]      PYTHON: that environment's python (default: $PYTHON, else python3)
#
# 1. checks that PYTHON is the bundle's Python version and that torch imports there;
# 2. pip-installs personaplex-voice and every dependency from wheels/ (--no-index, and no pip
#    configuration read: nothing but this folder is looked at);
# 3. copies lib/libopus.so.0 into <PYTHON's sys.prefix>/lib/personaplex-voice/, the directory the
#    project's opus loader searches (no system path is touched);
# 4. proves it: imports the package and loads libopus.
# A system python may refuse pip installs ("externally managed"): make a venv over it first,
#   python3 -m venv --system-site-packages ~/personaplex && ./install.sh ~/personaplex/bin/python
set -euo pipefail
HERE="$(cd "$(dirname "$0")" && pwd)"
PY="${1:-${PYTHON:-python3}}"
say() { echo "[install.sh] $*" >&2; }
die() {
    say "error: $*"
    exit 1
}

command -v "$PY" >/dev/null 2>&1 || [ -x "$PY" ] || die "$PY: no such python (give the environment's python)"
[ -f "$HERE/manifest.json" ] || die "$HERE/manifest.json missing: not a complete bundle"
field() { "$PY" -c 'import json, sys; print(json.load(open(sys.argv[1])).get(sys.argv[2]) or "")' "$HERE/manifest.json" "$1"; }
WANT=$(field python_version)
REQUIREMENT=$(field requirement)
PROFILE=$(field profile)
PROJECT_WHEEL=$(field project_wheel)
# a profile with a fixed set of packages (gpu): those, and what the host must have already
list_field() { "$PY" -c 'import json, sys; print(" ".join(json.load(open(sys.argv[1])).get(sys.argv[2]) or []))' "$HERE/manifest.json" "$1"; }
FIXED=$(list_field profile_requirements)
HOST_PROVIDES=$(list_field host_provides)
HAVE=$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
[ "$HAVE" = "$WANT" ] || die "this bundle is for Python $WANT and $PY is Python $HAVE: make one for it \
(personaplex-voice bundle --python-version $HAVE)"
"$PY" -c 'import torch' 2>/dev/null || die "$PY cannot import torch: install the host's CUDA build of \
torch first, or use a venv made with --system-site-packages over the python that has it"
"$PY" -m pip --version >/dev/null 2>&1 || die "$PY has no pip (python -m ensurepip, or use a venv)"
if [ -n "$HOST_PROVIDES" ]; then  # the profile leaves these to the host: are they there?
    ABSENT=$("$PY" -c 'import importlib.metadata as m, sys
missing = []
for name in sys.argv[1:]:
    try:
        m.version(name)
    except m.PackageNotFoundError:
        missing.append(name)
print(" ".join(missing))' $HOST_PROVIDES)
    [ -z "$ABSENT" ] || die "this bundle (profile ${PROFILE:-full}) expects the host to have $ABSENT: \
install them there, or make a full bundle (personaplex-voice bundle --profile full)"
fi
say "installing $REQUIREMENT (profile ${PROFILE:-full}) into $("$PY" -c 'import sys; print(sys.prefix)') from $HERE/wheels (no network)"
bundle_pip() {
    (
        for var in $(env | sed -n 's/^\(PIP_[A-Z_]*\)=.*/\1/p'); do unset "$var"; done
        PIP_CONFIG_FILE=/dev/null PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_INPUT=1 \
            "$PY" -m pip install --no-index --find-links "$HERE/wheels" --quiet "$@"
    )
}
if [ -n "$FIXED" ]; then
    # the project's wheel without its dependencies, the profile's packages with theirs (the
    # host's installed distributions count: nothing it has is replaced)
    bundle_pip --no-deps "$HERE/wheels/$PROJECT_WHEEL" || die "pip could not install the project's wheel"
    # shellcheck disable=SC2086  # one word per requirement
    bundle_pip $FIXED || die "pip could not install the profile's packages from the bundle (see above)"
else
    bundle_pip "$REQUIREMENT" || die "pip could not install from the bundle (see above)"
fi

if [ -f "$HERE/lib/libopus.so.0" ]; then
    LIBDIR=$("$PY" -c 'from personaplex_voice.audio.opus_library import project_lib_dir; print(project_lib_dir())')
    mkdir -p "$LIBDIR"
    cp "$HERE/lib/libopus.so.0" "$LIBDIR/libopus.so.0"
    [ -f "$HERE/lib/libopus.copyright" ] && cp "$HERE/lib/libopus.copyright" "$LIBDIR/"
    say "libopus placed in $LIBDIR"
fi
VERSION=$("$PY" -c 'from personaplex_voice.audio.opus_library import libopus_version; print(libopus_version())' 2>&1) ||
    die "libopus does not load: $VERSION"
say "done: $("$PY" -c 'import importlib.metadata as m; print("personaplex-voice", m.version("personaplex-voice"))'), \
torch $("$PY" -c 'import torch; print(torch.__version__)'), $VERSION"
