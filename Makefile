# `make demo` and `make test` each do all the set-up first; `make setup` is that idempotent step.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python

.PHONY: setup demo test clean

setup: $(VENV)/.installed

# The venv sees system site-packages, so a torch that is already installed is reused, never
# downloaded again; requirements.txt only gives ranges. Re-runs only when requirements.txt changes.
$(VENV)/.installed: requirements.txt
	@test -x $(PY) || $(PYTHON) -m venv --system-site-packages $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check -r requirements.txt
	@touch $@

demo: setup
	$(PY) ddpm.py --preset demo

test: setup
	$(PY) -m pytest -q tests

clean:
	rm -rf $(VENV) .pytest_cache
