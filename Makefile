# Trainyard: `make demo` runs the platform with everything embedded; `make test` runs the suite.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed-stamp
PYTEST_ARGS ?=

.PHONY: demo test bench venv clean assets

venv: $(STAMP)

$(STAMP): pyproject.toml
	@$(PYTHON) -c 'import sys; sys.exit(0 if sys.version_info >= (3, 11) else "Trainyard needs Python 3.11 or newer")'
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@echo "Installing Trainyard and its dependencies into $(VENV) (first time takes a few minutes)..."
	$(PY) -m pip install --disable-pip-version-check -q -e ".[ml,test]"
	@touch $(STAMP)

demo: $(STAMP)
	$(PY) manage.py migrate --noinput -v 0
	$(PY) manage.py demo

test: $(STAMP)
	$(PY) -m pytest $(PYTEST_ARGS)

# Browser libraries (package-lock.json) into static/vendor/; the result is committed, so only this needs npm.
assets: $(STAMP)
	npm ci --no-audit --no-fund
	$(PY) -m portal.assets

bench: $(STAMP)
	$(PY) -m bench all

clean:
	rm -rf var/ bench/results/*.json
