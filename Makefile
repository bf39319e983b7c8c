# Two commands for a new user: `make demo` and `make test`. Both install what they need.
# The interpreter the venv is made with (`PYTHON` is the bundle's target Python, X.Y).
INTERPRETER ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
CONSTRAINTS := requirements/constraints.txt
# fbgemm's CUDA build on a GPU host, its CPU build everywhere else.
FBGEMM := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo fbgemm-gpu || echo fbgemm-gpu-cpu)
# The torch to train with (training/torch_range.py, its first release by default) and the
# fbgemm and TorchRec built for it: `make install TORCH=2.11.0` (or 2.12.0, 2.14.1).
TORCH_RANGE := training/torch_range.py
MATCHED := $(shell $(INTERPRETER) $(TORCH_RANGE) $(TORCH))
TORCH := $(word 1,$(MATCHED))
STAMP  := $(VENV)/.installed-$(FBGEMM)-torch-$(TORCH)
INSTALL_LOG := $(VENV)/install.log

.PHONY: install demo test test-fast test-compat bench bundle lint docs clean

install: $(STAMP)

# Re-runs only when the pins, the package metadata or the chosen torch change. The
# constraints pin the default set; another torch takes its own fbgemm and TorchRec.
$(STAMP): pyproject.toml $(CONSTRAINTS) $(TORCH_RANGE)
	@test -n "$(MATCHED)" || { echo "make install: TORCH=$(TORCH): not a release of $(TORCH_RANGE) (it prints why above)"; exit 2; }
	@test -x $(BIN)/python || $(INTERPRETER) -m venv $(VENV)
	@echo "installing into $(VENV) (torch $(TORCH), $(FBGEMM) $(word 2,$(MATCHED)), torchrec $(word 3,$(MATCHED))); log: $(INSTALL_LOG)"
	@grep -v -E '^(torch|torchrec|fbgemm-gpu|fbgemm-gpu-cpu)==' $(CONSTRAINTS) > $(VENV)/constraints.txt
	@( $(BIN)/pip install -q -c $(VENV)/constraints.txt torch==$(TORCH) $(FBGEMM)==$(word 2,$(MATCHED)) \
	&& $(BIN)/pip install -q --no-deps torchrec==$(word 3,$(MATCHED)) \
	&& $(BIN)/pip install -q -c $(VENV)/constraints.txt -e '.[test]' ) > $(INSTALL_LOG) 2>&1 \
	|| { grep -v '^WARNING: Location' $(INSTALL_LOG) | tail -20; echo "install failed: see $(INSTALL_LOG)"; exit 1; }
	@rm -f $(VENV)/.installed-*
	@touch $@

demo: install
	PREFECT_HOME=$(CURDIR)/runs/demo/prefect $(BIN)/dlrm run --config configs/demo.toml

# Debian's Chromium for the Prefect UI test (Playwright drives it; browser downloads
# cannot work here).
CHROMIUM := /usr/bin/chromium
$(CHROMIUM):
	@echo "installing Debian's chromium for the UI test; log: $(VENV)/apt.log"
	@( apt-get install -y -q chromium || (apt-get update -q && apt-get install -y -q chromium) ) > $(VENV)/apt.log 2>&1 \
	|| { tail -5 $(VENV)/apt.log; echo "could not install chromium: run 'sudo apt-get install chromium'"; exit 1; }

# Debian's Slurm (slurmctld, slurmd, the client commands) and munge, for the test of
# `dlrm submit` on a real one-node cluster (tests/integration/slurm_cluster.py).
SLURM := /usr/sbin/slurmctld
$(SLURM):
	@echo "installing Debian's Slurm and munge for the Slurm test; log: $(VENV)/apt-slurm.log"
	@( apt-get install -y -q slurmctld slurmd slurm-client munge \
	   || (apt-get update -q && apt-get install -y -q slurmctld slurmd slurm-client munge) ) > $(VENV)/apt-slurm.log 2>&1 \
	|| { tail -5 $(VENV)/apt-slurm.log; echo "could not install Slurm: run 'sudo apt-get install slurmctld slurmd slurm-client munge'"; exit 1; }

# Three test processes on 2 cores: two take the modules that compute, the longest first, and
# the third the modules that mostly wait (Slurm's holds, servers starting, an outage), whose
# waits fill the cores the other two leave idle (tests/waiting_apart.py). Three that each took
# any module ended no sooner than two (docs/performance.md). Each test module runs whole in one
# process (fixtures are module-wide). Each keeps every core for its own torch, its threads
# waiting passively, and gives what it starts its share of the cores (tests/core_share.py).
TEST_WORKERS ?= 3
# `make test-fast`: two processes (its tests compute; none of them waits on a server)
FAST_WORKERS ?= 2
test: install lint $(CHROMIUM) $(SLURM)
	PREFECT_HOME=$(CURDIR)/.pytest-prefect $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile \
		--no-loadscope-reorder --durations=30

# The development loop: every test not marked slow (the unit tests and the integration tests
# that start no server and no torchrun), in under two minutes on 2 cores.
test-fast: install
	PREFECT_HOME=$(CURDIR)/.pytest-prefect $(BIN)/python -m pytest -q -n $(FAST_WORKERS) -m "not slow" --durations=5

# An offline bundle for a host with its own torch and no package index (docs/gpu.md):
#   make bundle OUT=DIR [TORCH=2.11.0] [BUILD=cuda|cpu] [PYTHON=3.12] [PART_MB=60] [HOST_HAS=numpy,pyarrow] [LEVEL=0-9|none]
# Defaults: this host's torch, build and Python.
# It runs in the venv (made with the default torch if there is none) and leaves the venv's
# torch as it is, whatever TORCH names: TORCH is the bundle's.
bundle:
	@test -n "$(OUT)" || { echo "make bundle: set OUT=DIR (where the parts and manifest.json go)"; exit 2; }
	@test -x $(BIN)/python || $(MAKE) --no-print-directory install TORCH=$(word 1,$(shell $(INTERPRETER) $(TORCH_RANGE)))
	$(BIN)/python infra/bundle.py --out "$(OUT)" $(if $(filter command line,$(origin TORCH)),--torch $(TORCH)) $(if $(BUILD),--build $(BUILD)) \
		$(if $(filter 3.%,$(PYTHON)),--python $(PYTHON)) --part-mb $(or $(PART_MB),60) $(if $(HOST_HAS),--host-has $(HOST_HAS)) \
		$(if $(LEVEL),--level $(LEVEL))

# The training tests on the ends of the torch range, each in a venv of its own
# (.venv-torch-X: torch X with its fbgemm and TorchRec; other torch releases come as CUDA
# builds, a few GB, which run on a CPU-only host too).
COMPAT_TORCH ?= 2.11.0 2.14.1
COMPAT_TESTS ?= tests/unit/training tests/unit/evaluation tests/unit/ingestion \
	tests/integration/test_sharded_training.py tests/integration/test_checkpoint_recovery.py
test-compat:
	@for torch in $(COMPAT_TORCH); do \
		$(MAKE) --no-print-directory install VENV=.venv-torch-$$torch TORCH=$$torch || exit 1; \
		echo "== the training tests on torch $$torch"; \
		.venv-torch-$$torch/bin/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile $(COMPAT_TESTS) || exit 1; \
	done

bench: install
	$(BIN)/python bench/generate.py

# The style the code keeps (pyproject.toml [tool.ruff]); `make test` and so CI run it first.
# docs/configuration.md from the config classes' field docs (a test fails when it is stale)
docs: install
	$(BIN)/python -m flows.run.config_reference

lint: install
	$(BIN)/python -m ruff check .

clean:
	rm -rf runs .pytest-prefect .pytest_cache
