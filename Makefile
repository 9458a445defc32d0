# The README's two commands: `make demo` and `make test`. Each makes .venv on first use.
PY := .venv/bin/python
PIP := $(PY) -m pip
STAMP := .venv/.installed

.PHONY: demo test test-slow lint venv clean

venv: $(STAMP)

$(STAMP): setup.cfg constraints.txt pyproject.toml
	test -x $(PY) || python3 -m venv .venv
	$(PIP) install -q -c constraints.txt -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m roundpipe.cli train recipes/demo.yaml

test: $(STAMP)
	# Two processes, one per core; then the tests that compare wall-clock times, alone, so that
	# the other process's load cannot skew what they measure. The slow tests are `make test-slow`.
	$(PY) -m pytest -q -p no:cacheprovider -n 2 -m "not timing and not slow"
	$(PY) -m pytest -q -p no:cacheprovider -m timing

test-slow: $(STAMP)
	# The slow tests (marker `slow`): CI runs them after `make test`.
	$(PY) -m pytest -q -p no:cacheprovider -n 2 -m "slow and not timing"

LINT_PATHS := $(wildcard roundpipe tests benchmarks scripts)

lint: $(STAMP)
	.venv/bin/ruff format --check $(LINT_PATHS)
	.venv/bin/ruff check $(LINT_PATHS)

clean:
	rm -rf .venv build *.egg-info
