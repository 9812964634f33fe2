# Every target bootstraps .venv on a fresh machine; nothing needs installing by hand.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: test test-slow lint demo clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e ".[test]"
	touch $(STAMP)

# Two workers, each taking whole test files (module fixtures such as a started server are
# made once): about 25% faster than one on a 2-core machine. The import rules (pyproject's
# [tool.importlinter]) are checked first: a second.
test: $(STAMP)
	$(VENV)/bin/lint-imports --no-logo
	$(PY) -m pytest -q -n 2 --dist loadfile -m "not slow and not tpu and not gpu" --durations=25

test-slow: $(STAMP)
	$(PY) -m pytest -q -m slow

lint: $(STAMP)
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports --no-logo

demo: $(STAMP)
	$(PY) examples/demo.py

clean:
	rm -rf $(VENV) .demo .pytest_cache .import_linter_cache
