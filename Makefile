# Each target creates .venv on first use and installs what it needs: make demo the service and SDK
# (numpy and gRPC, no torch), make test and make bench the dev extra too (torch, JAX, pytest).
PYTHON ?= python3.11
VENV := .venv
PY := $(VENV)/bin/python
# pip's and setuptools' chatter goes to a log that is shown only if the install fails.
PIP_LOG := $(VENV)/pip.log
PIP := $(PY) -m pip --disable-pip-version-check
INSTALL = $(PIP) install $(1) >$(PIP_LOG) 2>&1 || \
	{ cat $(PIP_LOG); echo "make: pip install $(1) failed (log above, and in $(PIP_LOG))"; exit 1; }
DEMO_STAMP := $(VENV)/.installed-demo
STAMP := $(VENV)/.installed

.PHONY: demo test bench e2e clean

$(PY):
	@command -v $(PYTHON) >/dev/null || { echo "error: $(PYTHON) not found; set PYTHON=/path/to/python3.11"; exit 1; }
	@echo "make: creating the virtual environment $(VENV) with $(PYTHON)"
	@$(PYTHON) -m venv $(VENV)
	@$(call INSTALL,--upgrade pip)

$(DEMO_STAMP): pyproject.toml | $(PY)
	@echo "make: installing reshard and what the demo needs (numpy, gRPC, FastAPI, rich; no torch) into $(VENV)"
	@$(call INSTALL,-e .)
	@touch $(DEMO_STAMP)

$(STAMP): pyproject.toml | $(PY)
	@echo "make: installing reshard and its dev extra (torch, JAX, pytest, ...) into $(VENV): minutes the first time"
	@$(call INSTALL,-e '.[dev]')
	@touch $(STAMP) $(DEMO_STAMP)

demo: $(DEMO_STAMP)
	@echo "make: running reshard demo (a planner and 5 agents on loopback)"
	$(VENV)/bin/reshard demo

test: $(STAMP)
	$(PY) -m pytest -m "not slow" -q

# docker-compose.yml on a real Docker engine, deployed by the README's own commands (root); -s shows each
# phase's time as it ends.
e2e: $(STAMP)
	$(PY) -m pytest -m e2e -q -s tests/e2e

bench: $(STAMP)
	$(PY) -m pytest -m "slow and not e2e" -q  # the suites too long for make test
	$(MAKE) e2e
	$(PY) bench/plan_quality.py
	$(PY) bench/transport.py
	$(PY) bench/stall.py
	$(PY) bench/einsum.py  # (c) on emulated hosts needs root, else prints why it skipped
	$(PY) bench/buckets.py
	$(PY) bench/paper.py  # emulated hosts: needs root, else prints why it skipped
	$(PY) bench/pipeline.py  # emulated hosts: needs root, else prints why it skipped
	$(PY) bench/weight_sync.py  # its emulated-hosts part needs root, else says why it skipped
	$(PY) bench/weight_sync.py --transport nixl  # the same on the NIXL transport: a section of its own
	$(PY) bench/small_tensors.py

clean:
	rm -rf $(VENV) build *.egg-info
