# Two commands on a fresh machine: `make demo` (the main job) and `make test` (lint + tests).
# The virtualenv sees system site-packages so an existing torch (CPU or CUDA) is reused as it is;
# only when no torch is importable, or one older than mixprec's floor (mixprec/torch_floor.py: pip would
# otherwise "upgrade" it to a CUDA build from PyPI), do we install the pinned CPU build. A plain `torch` requirement would
# pull several GB of CUDA packages on Linux, so the CPU build is asked for by name: first as `+cpu` from
# the places pip already knows (a local wheel, on our CI machines: no network needed), then from
# PyTorch's CPU index (Linux elsewhere), then plain (macOS, whose wheels on PyPI are CPU builds).
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_PIN := torch==2.13.0
TORCH_CPU_INDEX := https://download.pytorch.org/whl/cpu
STAMP := $(VENV)/.installed

.PHONY: demo test lint bench clean

# editable_mode=compat: the clone's root goes on the path (a .pth file), not an import hook. With the
# hook, a script in the folder holding a clone named mixprec/ imported that folder as an empty namespace
# package ("module 'mixprec' has no attribute 'GradScaler'"); a path entry lets the real package win.
$(STAMP): pyproject.toml Makefile mixprec/torch_floor.py
	python3 -m venv --system-site-packages $(VENV)
	$(PY) mixprec/torch_floor.py || $(PY) -m pip install --quiet "$(TORCH_PIN)+cpu" 2>/dev/null \
		|| $(PY) -m pip install --quiet $(TORCH_PIN) --index-url $(TORCH_CPU_INDEX) \
		|| $(PY) -m pip install --quiet $(TORCH_PIN)
	$(PY) -m pip install --quiet -e ".[test]" --config-settings editable_mode=compat
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/mixprec compare --out runs/compare

lint: $(STAMP)
	$(PY) -m ruff check mixprec tests benchmarks examples tools

test: lint
	$(PY) -m pytest -q

bench: $(STAMP)
	$(PY) benchmarks/master_step.py

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
