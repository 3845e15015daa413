# One entry point for users and CI. `make demo` serves a tiny random model with a few
# adapters on the CPU; `make test` runs every test suite. Both build the venv they need.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed

.PHONY: demo test venv clean

venv: $(STAMP)

# torch first, by exact version: on CI machines that takes the CPU build from local disk.
$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[test]'
	touch $(STAMP)

demo: $(STAMP)
	$(BIN)/loraplex-server --demo

# pytest exits 5 when it selects no test: that is not a failure of the suite.
test: $(STAMP)
	$(BIN)/pytest $(PYTEST_ARGS); rc=$$?; if [ $$rc -eq 5 ]; then echo "no tests selected"; exit 0; fi; exit $$rc

clean:
	rm -rf $(VENV) .pytest_cache
