# normlab: `make demo` and `make test` set themselves up on a fresh machine.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.normlab-installed
DEV    := $(VENV)/.normlab-dev
DOCS_VENV ?= .venv-docs
DOCS   := $(DOCS_VENV)/.normlab-docs
# torchtitan's own trainer and timm, for tests/torchtitan and tests/timm: a second venv, since torchtitan 0.3.0 needs
# torch 2.14 and timm torchvision (CUDA builds, run here on the CPU), and the main venv is pinned to the 2.13 CPU wheel
TITAN_VENV ?= .venv-titan
TITAN  := $(TITAN_VENV)/.normlab-titan

.PHONY: setup dev titan test lint demo docs clean

# what `normlab` needs to run (make demo): torch, the package and its kernel build
setup: $(STAMP)

# and what the tests, ruff and the docs need on top (pytest, ruff, Triton, transformers, mkdocs: 1.3 GB more)
dev: $(DEV)

# torch goes in first, pinned, so that the permissive `torch>=2.4` of pyproject.toml
# is already satisfied and pip does not pull a CUDA build.
$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install --quiet "torch==2.13.0"
	$(PY) -m pip install --quiet -e .
	-$(VENV)/bin/normlab build-kernels
	@touch $(STAMP)

$(DEV): $(STAMP)
	$(PY) -m pip install --quiet -e ".[dev]"
	@touch $(DEV)

titan: $(TITAN)

$(TITAN): pyproject.toml
	@test -x $(TITAN_VENV)/bin/python || $(PYTHON) -m venv $(TITAN_VENV)
	$(TITAN_VENV)/bin/python -m pip install --quiet "torch==2.14.1" "torchvision==0.29.1" "torchtitan==0.3.0" \
		"timm==1.0.31"
	@# normlab from the source tree by a path file, not a second editable build: the main venv builds in the same
	@# tree at the same time (make test's -j2), and two setuptools builds there would share build/ and egg-info
	$(TITAN_VENV)/bin/python -c "import site, pathlib; pathlib.Path(site.getsitepackages()[0], 'normlab-src.pth')\
		.write_text('$(CURDIR)/src\n')"
	$(TITAN_VENV)/bin/python -m pip install --quiet "numpy>=1.24" "scipy>=1.10" "matplotlib>=3.7" "tqdm>=4.60"
	@touch $(TITAN)

lint: dev
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .

# the two venvs are built side by side (-j2: pip waits on disk and unpacking as much as on the CPU), then one pytest
# worker per core (pytest-xdist): the tests split between them, an idle worker taking from a busy one's queue; the 15
# slowest are printed at the end
test:
	@$(MAKE) --no-print-directory -j2 lint titan
	$(PY) -m pytest -q -n auto --dist worksteal --durations=15

demo: setup
	$(VENV)/bin/normlab reproduce

# the documentation site, into site/; --strict fails on a broken link or a missing API reference. mkdocstrings
# reads the sources statically (griffe), so the site needs only the docs extra, in a venv of its own: no torch, no
# kernel build. The extra's packages are read from pyproject.toml, the one place they are written.
docs: $(DOCS)
	NO_MKDOCS_2_WARNING=1 $(DOCS_VENV)/bin/python -m mkdocs build --strict

$(DOCS): pyproject.toml
	@test -x $(DOCS_VENV)/bin/python || $(PYTHON) -m venv $(DOCS_VENV)
	$(DOCS_VENV)/bin/python -m pip install --quiet $$($(PYTHON) -c "import tomllib; print(' '.join(\
		tomllib.load(open('pyproject.toml', 'rb'))['project']['optional-dependencies']['docs']))")
	@touch $(DOCS)

clean:  # removes the venv only where it is one (a pyvenv.cfg inside), never whatever path VENV names
	@if [ -f "$(DOCS_VENV)/pyvenv.cfg" ]; then rm -rf "$(DOCS_VENV)"; fi
	@if [ -f "$(TITAN_VENV)/pyvenv.cfg" ]; then rm -rf "$(TITAN_VENV)"; fi
	@if [ -f "$(VENV)/pyvenv.cfg" ]; then rm -rf "$(VENV)"; elif [ -e "$(VENV)" ]; then \
		echo "make clean: $(VENV) is not a virtual environment (no pyvenv.cfg); left as it is"; fi
	rm -rf site build *.egg-info src/*.egg-info .pytest_cache .ruff_cache
