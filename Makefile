# Two commands for a new user: `make demo` and `make test`. Both install what they need.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
CONSTRAINTS := requirements/constraints.txt
# fbgemm's CUDA build on a GPU host, its CPU build everywhere else.
FBGEMM := $(shell command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && echo fbgemm-gpu || echo fbgemm-gpu-cpu)
STAMP  := $(VENV)/.installed-$(FBGEMM)
INSTALL_LOG := $(VENV)/install.log

.PHONY: install demo test bench lint clean

install: $(STAMP)

# Re-runs only when the pins or the package metadata change.
$(STAMP): pyproject.toml $(CONSTRAINTS)
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@echo "installing into $(VENV) ($(FBGEMM)); log: $(INSTALL_LOG)"
	@( $(BIN)/pip install -q -c $(CONSTRAINTS) torch==2.13.0 $(FBGEMM)==1.8.0 \
	&& $(BIN)/pip install -q --no-deps torchrec==1.8.0 \
	&& $(BIN)/pip install -q -c $(CONSTRAINTS) -e '.[test]' ) > $(INSTALL_LOG) 2>&1 \
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

# Two test processes: much of an end-to-end test is waiting (servers starting, a stopped
# run ending), so two share a 2-core machine well. Each test module runs whole in one of them
# (fixtures are module-wide), the longest first (tests/conftest.py).
TEST_WORKERS ?= 2
test: install $(CHROMIUM)
	PREFECT_HOME=$(CURDIR)/.pytest-prefect $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile \
		--no-loadscope-reorder --durations=15

bench: install
	$(BIN)/python bench/generate.py

lint: install
	$(BIN)/python -m ruff check . || true

clean:
	rm -rf runs .pytest-prefect .pytest_cache
