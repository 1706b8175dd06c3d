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
# Every agent, planner and test process imports ~100 of reshard's modules: where the environment says not to write
# bytecode (PYTHONDONTWRITEBYTECODE, as this development machine's does), each compiled all of them again, 0.2 s apiece
# (make test's pipeline, faults and errors files: 68 s with it set, 58-60 s without).
unexport PYTHONDONTWRITEBYTECODE

.PHONY: demo test bench e2e gpu-check clean

$(PY):
	@command -v $(PYTHON) >/dev/null || { echo "error: $(PYTHON) not found; set PYTHON=/path/to/python3.11"; exit 1; }
	@echo "make: creating the virtual environment $(VENV) with $(PYTHON)"
	@$(PYTHON) -m venv $(VENV)
	@$(call INSTALL,--upgrade pip)

# reshard/_delta_kernel.c: pip compiles it into the install (an edit needs the install again)
$(DEMO_STAMP): pyproject.toml reshard/_delta_kernel.c | $(PY)
	@echo "make: installing reshard and what the demo needs (numpy, gRPC, FastAPI, rich; no torch) into $(VENV)"
	@$(call INSTALL,-e .)
	@touch $(DEMO_STAMP)

# --no-compile: pip would byte-compile every module of torch, JAX and transformers (27 of the install's 57 s here);
# the tests import a fraction of them, compiled as they first load (about 5 s, once: make unexports
# PYTHONDONTWRITEBYTECODE above, so the bytecode is kept).
$(STAMP): pyproject.toml reshard/_delta_kernel.c | $(PY)
	@echo "make: installing reshard and its dev extra (torch, JAX, pytest, ...) into $(VENV): minutes the first time"
	@$(call INSTALL,--no-compile -e '.[dev]')
	@touch $(STAMP) $(DEMO_STAMP)

demo: $(DEMO_STAMP)
	@echo "make: running reshard demo (a planner and 5 agents on loopback)"
	$(VENV)/bin/reshard demo

# Two pytest workers (pytest-xdist) on CI's 2 cores: the suite's processes often wait on one another (starts,
# heartbeats, timeouts), so two fit: 486 s here (a fresh clone, 2026-12-02; the install adds about a minute).
# Three filled the cores' idle seventh (485-551 s), but under that load a NIXL ring test's host gave up its stream
# once in three runs: not worth a flaky CI. worksteal hands each worker its share of the suite in order (a module's
# cluster starts once where its tests stay together) and moves queued tests to the one that runs dry.
# TEST_WORKERS=1 runs them one at a time.
TEST_WORKERS ?= 2
# numpy asks the kernel for huge pages for its arrays of 4 MiB and more. On a VM that hands free memory back to its
# host (virtio-balloon free page reporting: this development machine; CI's may be alike), a huge page a process
# touches first is faulted in from the host again, about 8 ms per 2 MiB (0.08 GiB/s, against 1-1.4 GiB/s in 4 KiB
# pages; measured with numpy alone). The suite's processes are short-lived and touch fresh memory all the time: the
# whole of make test used 110 s of system time with huge pages and 68 s without, 285 s of wall time against 263 s
# (one run each, back to back, 2026-12-02; four of its integration files: 34-36 s against 21 s, 71 s against 62-64
# s, two runs each). Tests only: the product's processes keep numpy's default (a long-lived agent
# reuses its buffers, and a cold 4 GB sync through 8 agents was faster with huge pages here, 85 s against 111 s).
test: $(STAMP)
	NUMPY_MADVISE_HUGEPAGE=0 $(PY) -m pytest -m "not slow" -q -n $(TEST_WORKERS) --dist worksteal

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
	$(PY) bench/paper.py --transport nixl --strategies auto  # issue 38's nixl rows: a section of its own
	$(PY) bench/pipeline.py  # emulated hosts: needs root, else prints why it skipped
	$(PY) bench/weight_sync.py  # its emulated-hosts part needs root, else says why it skipped
	$(PY) bench/weight_sync.py --transport nixl  # the same on the NIXL transport: a section of its own
	$(PY) bench/link_timeline.py  # where that sync's time goes on the emulated links (root, else says why it skipped)
	$(PY) bench/cpu_profile.py  # where that sync's CPU goes, machine-wide (root and perf, else says why it skipped)
	$(PY) bench/small_tensors.py --sync-at 139583  # about 5 minutes more: a registered sync at issue 41's count
	$(PY) bench/sync_start.py  # issue 41: the planner's part of a repeated sync of the whole Kimi-K2-like case
	$(PY) bench/moe_sync.py  # issue 41 must-show 3; its emulated hosts need root, else it says why it skipped

# make gpu-check: every CUDA test (pytest -m cuda) and bench/gpu.py on this host's GPU, in under 8 minutes, ending
# in one table (bench/gpu_check.py; logs in gpu-check-logs/); exit 1 when a test fails or a goal is missed. Where
# torch sees no CUDA device it says why and passes. Two ways:
#   make gpu-check                                  a GPU host with network: the .venv and dev extra of make test
#   make gpu-check GPU_PYTHON=python3 WHEELS=.whl   a Python that already has CUDA torch, no network: the wheels in
#       WHEELS (optional; what that Python lacks: reshard's dependencies, setuptools>=77 to build it) go into it
#       without dependencies, then reshard editable: the checkout's reshard/ folder would shadow a regular install
#       when run from here, and the editable finder maps reshard.server, .client and .proto to their folders.
#       Naming GPU_PYTHON asks for installing into it, so a distribution's externally-managed mark is overridden.
#       bench/gpu_wheels.sh 3.12 .whl (where pip reaches PyPI) fetches those wheels for that host's Python.
# GPU_CHECK_ARGS passes options to bench/gpu_check.py (--mib 1024, --log DIR, --require-gpu).
GPU_PYTHON ?=
WHEELS ?=
GPU_CHECK_ARGS ?=
GPU_PIP = PIP_BREAK_SYSTEM_PACKAGES=1 PIP_ROOT_USER_ACTION=ignore $(GPU_PYTHON) -m pip --disable-pip-version-check \
	install -q --no-index --no-deps --no-build-isolation

ifeq ($(strip $(GPU_PYTHON)),)
gpu-check: $(STAMP)
	$(PY) bench/gpu_check.py $(GPU_CHECK_ARGS)
else
# The wheels go in first, by a pip of their own: a setuptools among them must be there before reshard is built.
gpu-check:
	@$(GPU_PYTHON) -m pip --version >/dev/null 2>&1 || { echo "error: $(GPU_PYTHON) -m pip does not run; \
	make gpu-check GPU_PYTHON= needs a Python with pip (and CUDA torch)"; exit 1; }
	@if [ -n "$(WHEELS)" ]; then set -- $(WHEELS)/*.whl; if [ -e "$$1" ]; then \
	echo "make: installing $$# wheels from $(WHEELS) into $(GPU_PYTHON)"; $(GPU_PIP) "$$@" || exit 1; \
	else echo "make: warning: WHEELS=$(WHEELS) holds no .whl files; installing reshard alone"; fi; fi
	@$(GPU_PYTHON) -c "import setuptools, sys; sys.exit(int(setuptools.__version__.split('.')[0]) < 77)" \
	|| { echo "error: building reshard here needs setuptools>=77 in $(GPU_PYTHON) (pyproject.toml's build-system) \
	and there is no network: put a setuptools wheel in WHEELS"; exit 1; }
	$(GPU_PIP) -e .
	$(GPU_PYTHON) bench/gpu_check.py $(GPU_CHECK_ARGS)
endif

clean:
	rm -rf $(VENV) build *.egg-info
