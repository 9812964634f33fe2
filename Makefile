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

test: $(STAMP)
	$(PY) -m pytest -q -m "not slow and not tpu and not gpu" --durations=25

test-slow: $(STAMP)
	$(PY) -m pytest -q -m slow

lint: $(STAMP)
	$(VENV)/bin/ruff check .

demo: $(STAMP)
	$(PY) examples/demo.py

clean:
	rm -rf $(VENV) .demo .pytest_cache
