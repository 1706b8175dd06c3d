# Each target creates .venv on first use and installs what it needs.
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test bench clean

$(STAMP): pyproject.toml
	@command -v $(PYTHON) >/dev/null || { echo "error: $(PYTHON) not found; set PYTHON=/path/to/python3.11"; exit 1; }
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/reshard demo

test: $(STAMP)
	$(PY) -m pytest -m "not slow" -q

bench: $(STAMP)
	$(PY) -m pytest -m slow -q  # the suites too long for make test
	$(PY) bench/plan_quality.py
	$(PY) bench/transport.py
	$(PY) bench/stall.py
	$(PY) bench/einsum.py  # (c) on emulated hosts needs root, else prints why it skipped
	$(PY) bench/buckets.py
	$(PY) bench/paper.py  # emulated hosts: needs root, else prints why it skipped
	$(PY) bench/pipeline.py  # emulated hosts: needs root, else prints why it skipped

clean:
	rm -rf $(VENV) build *.egg-info
