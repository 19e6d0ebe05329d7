PYTHON ?= python3

.PHONY: install run test test-fast lint ruff docs

install:
	bash scripts/setup.sh

# The main job on the built-in default: SFT on an imperfect demonstrator's arithmetic, then PPO with an
# exact-match reward, as two stages of one run; a table of held-out accuracy per stage and two dashboards.
# tests/test_main_job.py runs this very command line, CI-sized.
run: install
	$(PYTHON) -m rlflow.schedulers.cli run examples/arith/sft.yaml examples/arith/ppo.yaml --overwrite

# ruff, then the whole test suite (CPU; GPU tests skip without CUDA) on two xdist workers, the 25 slowest
# tests listed (to keep CI well inside its time); mypy (lint's type check) runs as one of those tests
# (tests/test_lint.py), beside the others. CI runs this (.ci/run). tests/conftest.py: the ordering.
PYTEST_N ?= 2
PYTEST_PARALLEL = -n $(PYTEST_N) --dist loadgroup --no-loadscope-reorder
test: install
	$(MAKE) --no-print-directory ruff PYTHON=$(PYTHON)
	$(PYTHON) -m pytest -q $(PYTEST_PARALLEL) --durations=25

# The edit loop: the single-process tests (those not marked slow), in parallel, in under 3 minutes.
test-fast:
	$(PYTHON) -m pytest -q $(PYTEST_PARALLEL) -m "not slow" --durations=10

# ruff (lint + format) on every tracked .py file (tests/test_lint.py checks none is skipped), mypy over the
# installed names; the import contracts (lint-imports) run in the tests (tests/test_layers.py).
lint: ruff
	$(PYTHON) scripts/typecheck.py

ruff:
	$(PYTHON) -m ruff check .
	$(PYTHON) -m ruff format --check .

# The docs site (MkDocs Material) into site/, strict: a broken link or a missing page fails. The reference
# pages are generated from the code at build time (scripts/docs_reference.py). tests/test_docs.py runs
# the same build in `make test`.
docs:
	$(PYTHON) -m mkdocs build --strict
