# Trainyard: `make demo` runs the platform with everything embedded; `make test` runs the suite.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# What running needs (the server and the examples' libraries), and what testing adds to it.
RUN_STAMP := $(VENV)/.installed-run
TEST_STAMP := $(VENV)/.installed-test
PYTEST_ARGS ?=

.PHONY: demo test bench venv venv-test clean assets

venv: $(RUN_STAMP)

venv-test: $(TEST_STAMP)

$(RUN_STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "Trainyard needs Python 3.11 or newer")'
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@echo "Installing Trainyard and its dependencies into $(VENV) (first time takes a few minutes)..."
	$(PY) -m pip install --disable-pip-version-check -q -e ".[server,ml]"
	@touch $(RUN_STAMP)

$(TEST_STAMP): $(RUN_STAMP)
	$(PY) -m pip install --disable-pip-version-check -q -e ".[server,ml,test]"
	@touch $(TEST_STAMP)

demo: $(RUN_STAMP)
	$(PY) manage.py migrate --noinput -v 0
	$(PY) manage.py demo

test: $(TEST_STAMP)
	$(PY) -m pytest $(PYTEST_ARGS)

# Browser libraries (package-lock.json) into static/vendor/; the result is committed, so only this needs npm.
assets: $(RUN_STAMP)
	npm ci --no-audit --no-fund
	$(PY) -m portal.assets

bench: $(TEST_STAMP)  # the benchmarks drive platforms through tests/support
	$(PY) -m bench all

clean:
	rm -rf var/ bench/results/*.json
