# The two commands of the README:
#   make serve   install into .venv, then run the server on the built-in `demo` model
#   make test    install into .venv (with dev extras and test system packages), then run the tests
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
HOST ?= 127.0.0.1
PORT ?= 8998
# The CPU build of torch that this project is tested with; a plain `torch` would pull a CUDA build.
TORCH_PIN ?= torch==2.13.0

.PHONY: install install-dev system-deps serve-deps serve test lint bench bundle

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

install: $(BIN)/python
	$(BIN)/pip install -q "$(TORCH_PIN)"
	$(BIN)/pip install -q -e .

install-dev: $(BIN)/python
	$(BIN)/pip install -q "$(TORCH_PIN)"
	$(BIN)/pip install -q -e ".[dev]"

# Debian packages the tests use: libopus (codec), chromium (browser test), espeak-ng + sox (speech fixtures).
system-deps:
	@if command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
		missing=""; \
		for p in libopus0 chromium chromium-driver espeak-ng sox; do \
			dpkg -s $$p >/dev/null 2>&1 || missing="$$missing $$p"; \
		done; \
		if [ -n "$$missing" ]; then apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q $$missing; fi; \
	else echo "system-deps: not root on Debian; install libopus0 chromium espeak-ng sox yourself"; fi

# What `serve` needs from the system: libopus (the /api/chat audio codec). Installed when root on
# Debian/Ubuntu, as `make test` does; otherwise one line says what to install.
serve-deps:
	@if $(PY) -c "import ctypes.util, sys; sys.exit(0 if ctypes.util.find_library('opus') else 1)"; then :; \
	elif command -v apt-get >/dev/null 2>&1 && [ "$$(id -u)" = 0 ]; then \
		apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q libopus0; \
	else \
		echo "make serve: libopus is missing: install libopus0 (Debian/Ubuntu: sudo apt-get install libopus0; macOS: brew install opus)"; \
		exit 1; \
	fi

serve: serve-deps install
	$(BIN)/personaplex-voice serve --model demo --host $(HOST) --port $(PORT)

test: install-dev system-deps
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q

lint: install-dev
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

bench: install-dev
	$(BIN)/python bench/engine_step.py --model ../shared/golden

# An offline install bundle for an air-gapped GPU host with its own torch (docs/deploy.md):
# `make bundle BUNDLE_PYTHON=3.12 BUNDLE_PLATFORM=manylinux_2_28_x86_64 BUNDLE_EXTRAS=twilio`;
# `make bundle PROFILE=gpu`: only what bench/gpu_check.sh needs on a CUDA torch image (~6 MiB).
BUNDLE_PYTHON ?= 3.12
BUNDLE_PLATFORM ?= manylinux_2_28_x86_64
BUNDLE_EXTRAS ?=
PROFILE ?= full
bundle: install
	$(BIN)/personaplex-voice bundle --python-version $(BUNDLE_PYTHON) --platform $(BUNDLE_PLATFORM) \
		--extras "$(BUNDLE_EXTRAS)" --profile $(PROFILE)
