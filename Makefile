# Two commands from a fresh clone: `make demo` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
BIN     = $(VENV)/bin

.PHONY: demo test docs notebook fuzz lint bench clean

# `make test` compiles the CPU kernels first, in two processes that share the
# work (`flashtile precompile`), and builds the documentation site meanwhile
# (`make docs`: a failed build prints its log and fails the run); then it
# runs two pytest workers, one test file
# each at a time (loadfile: a file's module fixtures, such as the distributed
# tests' process groups, are built once); the workers load the kernels from
# Numba's on-disk cache instead of both compiling the same ones at the start.
# The stamps re-run the install whenever pyproject.toml changes.
#
# Installs skip pip's byte-compilation of every installed module (torch's
# thousands: about 50 of a fresh install's 90 s on 2 cores); Python compiles
# each module the first time it is imported instead, and keeps it, so the
# recipes run with bytecode writing on even where the environment turns it off.
unexport PYTHONDONTWRITEBYTECODE
PIP_INSTALL = $(BIN)/python -m pip install --quiet --no-compile
$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(VENV)/.installed: pyproject.toml | $(BIN)/python
	$(PIP_INSTALL) -e .
	touch $@

$(VENV)/.dev-installed: pyproject.toml | $(BIN)/python
	$(PIP_INSTALL) -e '.[dev]'
	touch $@ $(VENV)/.installed

$(VENV)/.bench-installed: pyproject.toml | $(VENV)/.dev-installed
	$(PIP_INSTALL) -e '.[dev,torch,plot]'
	touch $@

demo: $(VENV)/.installed
	$(BIN)/flashtile demo

# The tests run the routes' fixed rules (tests/conftest.py): precompile
# without measuring them, which beside the docs build would store choices
# timed under that load in the developer's route cache.
test: $(VENV)/.dev-installed
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	@mkdir -p build
	$(MAKE) --no-print-directory docs > build/docs.log 2>&1 & docs=$$!; \
	$(BIN)/flashtile precompile --jobs 2 --no-tune && wait $$docs || { cat build/docs.log; exit 1; }
	$(BIN)/python -m pytest -q -n 2 --dist loadfile

# The documentation site (mkdocs.yml) into build/site: every public name must
# have a docstring and a place in docs/api/ (scripts/check_docs.py), and the
# build is strict (a broken link or anchor, a missing reference or a docstring
# that does not parse fails it).
docs: $(VENV)/.dev-installed
	$(BIN)/python scripts/check_docs.py
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict  # (not --quiet: it hides the warnings strict counts)

# The tutorial as a notebook, run top to bottom: docs/tutorial.ipynb (beside
# the images it shows; not tracked: docs/tutorial.md is its source).
notebook: $(VENV)/.dev-installed
	$(BIN)/python scripts/tutorial_notebook.py docs/tutorial.ipynb

# The fuzz tests with the long budget (a few minutes; `make test` runs a small one).
fuzz: $(VENV)/.dev-installed
	FLASHTILE_FUZZ=long $(BIN)/python -m pytest -q -p no:cacheprovider tests/test_fuzz.py tests/test_fuzz_decode.py tests/test_fuzz_torch.py

bench: $(VENV)/.bench-installed
	$(BIN)/flashtile bench

clean:
	rm -rf $(VENV) build src/*.egg-info .pytest_cache .ruff_cache src/flashtile/cpu/__pycache__
