PYTHON ?= python3

.PHONY: install run test lint

install:
	bash scripts/setup.sh

# The main job on the built-in default: SFT, then PPO, on arithmetic; prints held-out accuracy.
run: install
	$(PYTHON) -m rlflow.schedulers.cli run examples/arith/sft.yaml --overwrite
	$(PYTHON) -m rlflow.schedulers.cli run examples/arith/ppo.yaml --overwrite

# The test suite (CPU; GPU tests skip without CUDA).
test: install
	$(PYTHON) -m pytest -q

lint:
	$(PYTHON) -m ruff check . && $(PYTHON) -m ruff format --check . && $(PYTHON) scripts/typecheck.py
