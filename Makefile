# Two entry points, each creates the environment it needs:
#   make demo   train on the bundled data with the hooks, print where the timelines are
#   make test   lint (ruff), then the test suite against real Lightning and Keras (torch backend)
#   make bench  the benchmarks in bench/ (numbers recorded in bench/README.md)
#   make compat the Lightning and Keras tests again, against the oldest lightning and keras pyproject declares
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
COMPAT := .venv-compat
COMPAT_STAMP := $(COMPAT)/.installed
# `lightning>=2.4` and `keras>=3.6` in pyproject.toml's extras -> "keras==3.6 lightning==2.4"
OLDEST = $(shell $(PYTHON) -c 'import re, tomllib; extras = tomllib.load(open("pyproject.toml", "rb"))["project"]\
["optional-dependencies"]; print(*sorted({f"{m[1]}=={m[2]}" for r in extras["lightning"] + extras["keras"] \
for m in [re.fullmatch(r"(lightning|keras)>=([0-9.]+)", r)] if m}))')
COMPAT_TESTS := tests/test_lightning_prof.py tests/test_keras_prof.py tests/test_one_driver.py \
                tests/reliability/test_real_faults.py tests/reliability/test_preemption.py

.PHONY: demo test bench venv compat clean

# torch 2.13.0 first: the machine has its CPU wheel locally; letting another package pick torch would
# pull a newer CUDA build (gigabytes). With it installed, the ranges below are already satisfied.
$(STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet torch==2.13.0
	$(BIN)/python -m pip install --quiet -e ".[all,test]"
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	KERAS_BACKEND=torch $(BIN)/python examples/demo.py

test: $(STAMP)
	$(BIN)/ruff check .
	KERAS_BACKEND=torch $(BIN)/python -m pytest -q

# The same torch (its local CPU wheel), then the oldest declared lightning and keras (pure Python), then hookprof:
# pip keeps those, since they meet its ranges.
$(COMPAT_STAMP): pyproject.toml Makefile
	$(PYTHON) -m venv $(COMPAT)
	$(COMPAT)/bin/python -m pip install --quiet --upgrade pip
	$(COMPAT)/bin/python -m pip install --quiet torch==2.13.0
	$(COMPAT)/bin/python -m pip install --quiet $(OLDEST)
	$(COMPAT)/bin/python -m pip install --quiet -e ".[all,test]"
	touch $(COMPAT_STAMP)

compat: $(COMPAT_STAMP)
	KERAS_BACKEND=torch $(COMPAT)/bin/python -c "import keras, lightning; print('compat: lightning', lightning.__version__, 'keras', keras.__version__)"
	KERAS_BACKEND=torch $(COMPAT)/bin/python -m pytest -q $(COMPAT_TESTS)

bench: $(STAMP)
	$(BIN)/python bench/hook_step_cost.py
	$(BIN)/python bench/trace_size.py
	$(BIN)/python bench/traced_fit_cost.py
	$(BIN)/python bench/traced_step_vs_torch.py
	$(BIN)/python bench/step_phases.py
	$(BIN)/python bench/identity_sources.py
	$(BIN)/python bench/op_durations.py
	$(BIN)/python bench/writer_throughput.py
	$(BIN)/python bench/profiler_reports.py
	KERAS_BACKEND=torch $(BIN)/python bench/idle_fit_overhead.py
	KERAS_BACKEND=torch $(BIN)/python bench/trigger_watch_cost.py
	KERAS_BACKEND=jax $(BIN)/python bench/jax_traced_step.py
	$(BIN)/python bench/agree_cost.py
	$(BIN)/python bench/long_run_stability.py
	$(BIN)/python bench/gpu_traced_step.py  # skips without a CUDA device

clean:
	rm -rf $(VENV) $(COMPAT) runs lightning_logs .pytest_cache
