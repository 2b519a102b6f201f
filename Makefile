# The two quickstart commands; each sets itself up (a virtual environment with the pinned packages of
# requirements.txt and this repo's `longdpo` package installed editable) on first use.
#   make quickstart   DPO of a tiny Mistral on the shipped preference data (CPU when no GPU is present)
#   make test         the linter, then the CPU test suite (real TRL, real DeepSpeed ZeRO-3 over gloo)
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell cat requirements.txt pyproject.toml | cksum | cut -d' ' -f1)

$(STAMP): requirements.txt pyproject.toml
	python3 -m venv $(VENV)
	$(VENV)/bin/pip install --disable-pip-version-check -q -r requirements.txt
	$(VENV)/bin/pip install --disable-pip-version-check -q --no-deps -e .
	touch $(STAMP)

install: $(STAMP)

# The quickstart's own folder is replaced on every run (--overwrite_output_dir); your runs are refused a used folder.
quickstart: $(STAMP)
	$(PY) launch/train_dpo.py --recipe recipes/tiny_mistral/dpo_quickstart.yaml --overwrite_output_dir

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# Two test files at a time, each in its own process (a file's launches share their fixtures): a launch leaves a core
# idle while its ranks start and meet; two cores run the suite in about two thirds of the time it takes in one process.
test: lint
	$(PY) -m pytest -n 2 --dist loadfile tests

.PHONY: install quickstart lint test
