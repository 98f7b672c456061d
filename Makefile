# One-command set-up on a fresh machine: `make demo` (main job) and `make test` (tests).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# CPU wheel on machines without a GPU; on a CUDA machine set TORCH_SPEC="torch" (or keep your own torch).
TORCH_SPEC ?= torch==2.13.0
EXTRAS ?= pipecat,server,livekit,ray,dev

# Programs the test suite drives, and the Debian packages that bring them (docs/install.md).
SYSTEM_PACKAGES ?= espeak-ng sox

.PHONY: setup system-packages demo test lint clean

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	# qwen-tts's own requirements pull torchaudio and gradio (see docs/install.md: "Why qwen-tts --no-deps")
	$(PY) -m pip install -q --no-deps qwen-tts==0.1.1
	$(PY) -m pip install -q -e ".[$(EXTRAS)]"
	touch $@

setup: $(VENV)/.installed

# Installs the missing system packages when it can (root and apt-get); otherwise says what to install,
# and the WebRTC test, which needs espeak-ng, is skipped with the same hint.
system-packages:
	@missing=""; for p in $(SYSTEM_PACKAGES); do command -v $$p >/dev/null 2>&1 || missing="$$missing $$p"; done; \
	if [ -z "$$missing" ]; then exit 0; fi; \
	if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
		echo "installing system packages:$$missing"; \
		export DEBIAN_FRONTEND=noninteractive; \
		(apt-get update -qq && apt-get install -y -qq$$missing >/dev/null) \
			|| echo "could not install$$missing: tests that need them are skipped"; \
	else \
		echo "missing system packages:$$missing (sudo apt-get install$$missing): tests that need them are skipped"; \
	fi

demo: setup
	$(VENV)/bin/qwen3tts-agent say "Hello there, how can I help?" --model synthetic:tiny --out hello.wav

# Two pytest workers (pytest-xdist), one file each at a time (a file's servers and clusters stay in one process),
# one torch thread each, for CI's 2 cores (docs/design.md, Checks). TEST_WORKERS=0 runs it in one process.
# The 15 slowest tests are listed at the end, to keep an eye on the run's length.
TEST_WORKERS ?= 2
ifeq ($(TEST_WORKERS),0)
PYTEST := OMP_NUM_THREADS=2 $(PY) -m pytest -q --durations=15
else
PYTEST := OMP_NUM_THREADS=1 $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=15
endif
test: setup system-packages
	$(PYTEST)

# ruff over everything; mypy over the package; the engine's import contracts (settings of both in pyproject.toml)
lint: setup
	$(VENV)/bin/ruff check qwen3tts_agent tests benchmarks examples
	$(PY) -m mypy
	$(VENV)/bin/lint-imports

clean:
	rm -rf $(VENV) hello.wav
