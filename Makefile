# One-command set-up on a fresh machine: `make demo` (main job) and `make test` (tests).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# CPU wheel on machines without a GPU; on a CUDA machine set TORCH_SPEC="torch" (or keep your own torch).
TORCH_SPEC ?= torch==2.13.0
EXTRAS ?= pipecat,server,livekit,dev

.PHONY: setup demo test lint clean

$(VENV)/.installed: pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH_SPEC)"
	# qwen-tts's own requirements pull torchaudio and gradio (see docs/install.md: "Why qwen-tts --no-deps")
	$(PY) -m pip install -q --no-deps qwen-tts==0.1.1
	$(PY) -m pip install -q -e ".[$(EXTRAS)]"
	touch $@

setup: $(VENV)/.installed

demo: setup
	$(VENV)/bin/qwen3tts-agent say "Hello there, how can I help?" --model synthetic:tiny --out hello.wav

test: setup
	OMP_NUM_THREADS=2 $(PY) -m pytest -q

lint: setup
	$(VENV)/bin/ruff check qwen3tts_agent tests benchmarks examples

clean:
	rm -rf $(VENV) hello.wav
