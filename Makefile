# The README's two commands: `make demo` and `make test`. Each makes .venv on first use.
PY := .venv/bin/python
PIP := $(PY) -m pip
STAMP := .venv/.installed

.PHONY: demo test test-slow bench bench-quick lint venv clean

venv: $(STAMP)

$(STAMP): setup.cfg constraints.txt pyproject.toml
	test -x $(PY) || python3 -m venv .venv
	$(PIP) install -q -c constraints.txt -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m roundpipe.cli train recipes/demo.yaml --overwrite

test: $(STAMP)
	# Two processes, one per core; then the tests that compare wall-clock times, alone, so that
	# the other process's load cannot skew what they measure. The slow tests are `make test-slow`.
	$(PY) -m pytest -q -p no:cacheprovider -n 2 -m "not timing and not slow"
	$(PY) -m pytest -q -p no:cacheprovider -m "timing and not slow"

test-slow: $(STAMP)
	# The slow tests (marker `slow`): CI runs them after `make test`. The slow ones that compare
	# wall-clock times first, alone: after twenty minutes of two busy processes the simulator-vs-run
	# check once measured every step 20-45% slower than the profile taken just before it predicted.
	$(PY) -m pytest -q -p no:cacheprovider -m "slow and timing"
	$(PY) -m pytest -q -p no:cacheprovider -n 2 -m "slow and not timing"

bench: $(STAMP)
	# Every benchmark, measured: benchmarks/results/*.{json,md} and docs/benchmarks.md.
	$(PY) benchmarks/run_all.py

bench-quick: $(STAMP)
	# The CI smoke: each benchmark at its smallest, results into a temporary directory.
	$(PY) benchmarks/run_all.py --quick

LINT_PATHS := $(wildcard roundpipe tests benchmarks scripts)
# The type-checked part of roundpipe/ (mypy, config in pyproject.toml): add a module here once
# `.venv/bin/mypy <it>` is clean. The modules they import are read for types, not reported.
TYPED_PATHS := roundpipe/errors.py roundpipe/config.py roundpipe/schedule roundpipe/partition \
	roundpipe/sim roundpipe/optim roundpipe/distributed roundpipe/runtime roundpipe/commands \
	roundpipe/backend/base.py roundpipe/backend/sanitizer.py roundpipe/backend/threads.py \
	roundpipe/backend/virtual.py roundpipe/backend/issue_token.py \
	roundpipe/models/base.py roundpipe/models/families.py roundpipe/models/head.py \
	roundpipe/models/mask_facts.py roundpipe/models/router_loss.py roundpipe/models/verify.py \
	roundpipe/models/training_proof.py roundpipe/models/probe.py roundpipe/models/parametrized.py

lint: $(STAMP)
	.venv/bin/ruff format --check $(LINT_PATHS)
	.venv/bin/ruff check $(LINT_PATHS)
	.venv/bin/mypy $(TYPED_PATHS)

clean:
	rm -rf .venv build *.egg-info
