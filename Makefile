# One task runner: .ci/run calls `make -k checks`, then the README's test command, and a
# developer runs the same targets.
# `make help` lists them. PYTHON is the interpreter with the test extra installed
# (pip install -e '.[test]').

PYTHON ?= python
PYTEST ?= $(PYTHON) -m pytest

.DEFAULT_GOAL := help
.PHONY: help install lint type imports build-c build-c-werror test test-unit \
        test-integration fuzz-slice docs docs-check bench-quick checks ci

help: ## this list
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F ':.*## ' '{printf "  %-17s %s\n", $$1, $$2}'

install: ## the package in place with the test extra (the README's first step)
	$(PYTHON) -m pip install -e '.[test]'

lint: ## ruff over the whole tree ([tool.ruff] in pyproject.toml)
	$(PYTHON) -m ruff check .

type: ## mypy over the product packages ([tool.mypy] in pyproject.toml)
	$(PYTHON) -m mypy

imports: ## the layering contract ([tool.importlinter] in pyproject.toml)
	lint-imports

build-c: ## the C relay built in place (spliceway/_relay*.so), as the tests load it
	$(PYTHON) csrc/relay_build.py

build-c-werror: ## the same with every compiler warning an error (what CI builds)
	SPLICEWAY_RELAY_WERROR=1 $(PYTHON) csrc/relay_build.py

test: ## the whole suite in two xdist workers (the README's command)
	$(PYTEST)

test-unit: ## the tests marked unit: pure code or loopback sockets, no engine, no peer
	$(PYTEST) -m unit

test-integration: ## the tests marked integration: engines, Debian peers, namespaces
	$(PYTEST) -m integration

fuzz-slice: ## a bounded run of the C fuzzers (parse, route) under ASan/UBSan, gcc only
	$(PYTHON) benchmarks/fuzz_slice.py

docs: ## regenerate the references in docs/ from the code
	$(PYTHON) -m spliceway.tools.docgen

docs-check: ## fail when docs/ differs from what the code generates
	$(PYTHON) -m spliceway.tools.docgen --check

bench-quick: ## the end-to-end benchmark's short run (about a minute; not in ci)
	$(PYTHON) benchmarks/run_e2e.py --quick

# The C build comes first: the tests and the fuzz slice load what it builds.
checks: build-c-werror lint type imports docs-check fuzz-slice ## every check but the suite

ci: checks test ## everything .ci/run checks (it runs the suite as the README spells it)
