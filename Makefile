# The two quickstart commands; each sets itself up (a virtual environment from requirements.txt) on first use.
#   make quickstart   DPO of a tiny Mistral on the shipped preference data (CPU when no GPU is present)
#   make test         the CPU test suite (real TRL, real DeepSpeed ZeRO-3 over gloo)
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-$(shell cksum < requirements.txt | cut -d' ' -f1)

$(STAMP): requirements.txt
	python3 -m venv $(VENV)
	$(VENV)/bin/pip install --disable-pip-version-check -q -r requirements.txt
	touch $(STAMP)

install: $(STAMP)

# The quickstart's own folder is replaced on every run (--overwrite_output_dir); your runs are refused a used folder.
quickstart: $(STAMP)
	$(PY) launch/train_dpo.py --recipe recipes/tiny_mistral/dpo_quickstart.yaml --overwrite_output_dir

test: $(STAMP)
	$(PY) -m pytest tests

.PHONY: install quickstart test
