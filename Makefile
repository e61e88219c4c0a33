# The README's commands in one place. Nothing needs an activated virtualenv: the Python is the active one, else
# the README's .venv, else python3 (override: make test PYTHON=/path/to/python).
PYTHON ?= $(if $(VIRTUAL_ENV),$(VIRTUAL_ENV)/bin/python,$(if $(wildcard .venv/bin/python),.venv/bin/python,python3))
# its console scripts (lint-imports, clgrpo) beside it; a bare python3 finds them on PATH
BIN := $(if $(findstring /,$(PYTHON)),$(dir $(PYTHON)))
PYTEST := $(PYTHON) -m pytest -q

.PHONY: help setup test test-fast test-long test-demo lint format typecheck imports deps check ci demo \
	bench bench-step bench-scale bench-client-cpu bench-overhead bench-scaling bench-prefix bench-agent-step \
	bench-tool-pool bench-embeddings bench-learning bench-hybrid bench-engines bench-gpu \
	bench-saturation bench-shared-prompts

help:  ## this list
	@grep -hE '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | sed 's/:.*## /\t/' | expand -t 20

setup:  ## .venv with the CPU torch, the transformers backend and the dev tools (README: Setup)
	python3 -m venv .venv
	.venv/bin/python -m pip install --upgrade pip
	.venv/bin/python -m pip install "torch==2.13.0"
	.venv/bin/python -m pip install -e ".[local,dev]"

test:  ## the default test run (what .ci/run runs after the checks)
	$(PYTEST)

test-fast:  ## without the slow and integration tests (about 7 minutes)
	$(PYTEST) -m "not slow and not integration and not demo and not long"

test-long:  ## the full-length reliability variants
	$(PYTEST) -m long

test-demo:  ## the demo's own acceptance on the real Qwen2.5-Coder models (about 7 minutes once cached)
	$(PYTEST) -m demo

format:  ## rewrite the code in ruff's style
	$(PYTHON) -m ruff format .

lint:  ## ruff: formatting and lint rules (pyproject [tool.ruff])
	$(PYTHON) -m ruff format --check .
	$(PYTHON) -m ruff check .

typecheck:  ## mypy on the files pyproject [tool.mypy] names
	$(PYTHON) -m mypy

imports:  ## the import layers (pyproject [tool.importlinter])
	$(BIN)lint-imports

deps:  ## every import declared in pyproject.toml (deptry; pyproject [tool.deptry])
	$(BIN)deptry .

check: lint imports typecheck deps test  ## every check of CI, in this environment

ci:  ## CI itself: a fresh virtualenv, the install, the checks and the tests
	bash .ci/run

demo:  ## the offline demo on the real models
	$(BIN)clgrpo demo

LOOPBACK_BENCHES := bench-step bench-scale bench-client-cpu bench-overhead bench-scaling bench-prefix \
	bench-agent-step bench-tool-pool bench-embeddings
bench: $(LOOPBACK_BENCHES)  ## every loopback benchmark (not learning/hybrid: real models, long)

bench-step:  ## 100 problems x G=5: wall vs critical path (~6.5 min)
	$(PYTHON) benchmarks/step.py
bench-scale:  ## 1,000 and 10,000 problems: CPU per call, in flight, GC (~12 min)
	$(PYTHON) benchmarks/scale.py
bench-client-cpu:  ## CPU per LLM call of the client alone
	$(PYTHON) benchmarks/client_cpu.py
bench-overhead:  ## fixed cost of one clgrpo train
	$(PYTHON) benchmarks/overhead.py
bench-scaling:  ## cost and peak RSS vs problems
	$(PYTHON) benchmarks/scaling.py --sizes 100 1000 10000
bench-prefix:  ## shared prompt prefix, plain and with retrieval injection
	$(PYTHON) benchmarks/prefix.py
	$(PYTHON) benchmarks/prefix.py --top-k 5
bench-agent-step:  ## agent mode, 40 x G=5 (~2.5 min)
	$(PYTHON) benchmarks/agent_step.py
bench-tool-pool:  ## the Python sandbox pool (~10 s)
	$(PYTHON) benchmarks/tool_pool.py
bench-embeddings:  ## the embedded embedding model
	$(PYTHON) benchmarks/embeddings.py
bench-learning:  ## learning quality on real models, ranges and percent (~75 min on 2 cores)
	$(PYTHON) benchmarks/learning.py --families ranges --learners qwen2.5-coder-1.5b --report
	$(PYTHON) benchmarks/learning.py --families percent --learners qwen2.5-coder-1.5b --report
bench-engines:  ## llama-server's CPU kernels vs a prebuilt wheel on the demo's requests (~8 min)
	$(PYTHON) benchmarks/engines.py
bench-hybrid:  ## hybrid learning on the embedded model (~15-30 min)
	$(PYTHON) benchmarks/hybrid.py --report
bench-saturation:  ## the demo's stages against the engine's own ceiling (~25 min; needs the built engine)
	$(PYTHON) benchmarks/saturation.py --report
bench-shared-prompts:  ## a problem's samples in one request (n=G) vs one per sample, on llama-server (~10 min)
	$(PYTHON) benchmarks/shared_prompts.py --report
bench-gpu:  ## numeric step and transformers engine on a CUDA GPU, random 0.5B shape (~3 min on an H100)
	$(PYTHON) benchmarks/gpu.py
