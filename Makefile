# Two commands do all the set-up on a fresh machine:
#   make demo   creates .venv, installs Outrider, pulls the default model, runs the main job
#               (`outrider bench --preset quick`: every method side by side, report in bench-results/)
#   make test   creates .venv if needed, pulls what the tests need, runs the suite
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# The CPU wheel of torch 2.13.0; override (e.g. TORCH=torch) to take another build.
TORCH ?= torch==2.13.0
DEFAULT_MODEL := smollm2-135m-instruct
PROMPT ?= Write a Python function that checks whether a number is prime.

.PHONY: demo test test-unit mutate install clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "$(TORCH)"
	$(PY) -m pip install -q -e ".[dev]"
	touch $@

install: $(VENV)/.installed

demo: install
	$(VENV)/bin/outrider models pull $(DEFAULT_MODEL)
	$(VENV)/bin/outrider generate --chat --max-new-tokens 64 --drafter suffix --stats "$(PROMPT)"
	$(VENV)/bin/outrider bench --preset quick   # a new bench-results/<time> folder each run

# Tests run in TEST_WORKERS processes (pytest-xdist), one torch thread each (tests/conftest.py);
# a file's tests stay in one process, so its fixtures (the SmolLM2 model) load once there.
TEST_WORKERS ?= 2
PYTEST := $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile

test: install
	$(VENV)/bin/outrider models pull $(DEFAULT_MODEL)
	$(PYTEST)

# the unit tests alone: tiny random models, no download
test-unit: install
	$(PYTEST) -m "not model"

# mutation testing of the exactness core, bounded in time (MUTATE_MINUTES per group); not part of `make test`
MUTATE_MINUTES ?= 20
mutate: install
	$(PY) -m pip install -q -e ".[mutate]"
	$(PY) scripts/mutate.py --minutes $(MUTATE_MINUTES) $(GROUPS)

clean:
	rm -rf $(VENV) .pytest_cache
