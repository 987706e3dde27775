# `make demo` and `make test` each do all the set-up first; `make setup` is that idempotent step.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
APT_PACKAGES := libturbojpeg0-dev libopencv-dev pkg-config   # what ffcv needs to build

.PHONY: setup apt demo test clean

setup: $(VENV)/.installed

# ffcv compiles against libturbojpeg and OpenCV. As root with apt, install them (only when missing);
# otherwise say what to install. Without them everything but the ffcv loader still works.
apt:
	@if dpkg -s $(APT_PACKAGES) >/dev/null 2>&1; then :; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $(APT_PACKAGES) >/dev/null; \
	else echo "note: for the ffcv loader, install: $(APT_PACKAGES)"; fi

# The venv sees system site-packages, so a torch that is already installed is reused, never
# downloaded again; requirements.txt only gives ranges. Re-runs only when requirements.txt changes.
# If ffcv fails to build, everything else is installed and training falls back to the torch loader.
$(VENV)/.installed: requirements.txt
	@$(MAKE) --no-print-directory apt
	@test -x $(PY) || $(PYTHON) -m venv --system-site-packages $(VENV)
	@$(PY) -m pip install --quiet --disable-pip-version-check -r requirements.txt || { \
		echo "warning: ffcv did not build (needs $(APT_PACKAGES)); installing the rest, training will use the torch loader"; \
		grep -v '^ffcv' requirements.txt > $(VENV)/requirements-noffcv.txt && \
		$(PY) -m pip install --quiet --disable-pip-version-check -r $(VENV)/requirements-noffcv.txt; }
	@touch $@

demo: setup
	$(PY) ddpm.py --preset demo

test: setup
	$(PY) -m pytest -q -n auto --dist worksteal tests

clean:
	rm -rf $(VENV) .pytest_cache
