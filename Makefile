# Two commands on a fresh machine:
#   make demo   set up .venv (if needed) and run `hp-functional demo` (TP=2 on two local gloo ranks)
#   make test   the same set-up, then the test suite
# and `make test-newest`: the fast subset again on the newest torch tested (.venv-newest; docs/testing.md)
# Set-up is idempotent: it runs again only when pyproject.toml or the torch pin changes (or .venv
# is removed); otherwise it is a stamp-file check.  `pip install torch` alone pulls the CUDA build
# on an ordinary Linux machine; for the CPU build:
#   make demo TORCH_INDEX=https://download.pytorch.org/whl/cpu
# (TORCH_INDEX is passed as --index-url to the torch install only.)

ROOT := $(patsubst %/,%,$(dir $(abspath $(lastword $(MAKEFILE_LIST)))))

PYTHON      ?= python3
VENV        ?= $(ROOT)/.venv
TORCH       ?= torch==2.13.0
TORCH_INDEX ?=
PYTEST_ARGS ?=
# extras the set-up installs: `make test EXTRAS=test,titan` adds torchtitan's models (~1.3 GB: docs/torchtitan.md)
EXTRAS      ?= test

VENV  := $(abspath $(VENV))
BIN   := $(VENV)/bin
# the stamp's name is keyed on what the set-up installs: pyproject.toml and the torch pin
KEY   := $(shell (cat "$(ROOT)/pyproject.toml"; echo "$(TORCH) $(EXTRAS)") | sha256sum | cut -c1-16)
STAMP := $(VENV)/.hpf-setup-$(KEY)

.PHONY: demo test test-fast test-newest setup-newest mutation-check setup clean-setup titan3-venv diffusers timm-newest

demo: $(STAMP)
	cd "$(ROOT)" && "$(BIN)/hp-functional" demo

# pytest exits 5 when it collects nothing: that fails here too, and `tests` is named so it cannot happen quietly
test: $(STAMP)
	cd "$(ROOT)" && "$(BIN)/python" -m pytest tests $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test: pytest collected no tests" >&2; fi; exit $$rc

# the fast subset (under 2 minutes on 2 cores): every test not marked slow (pyproject.toml's markers)
test-fast: $(STAMP)
	cd "$(ROOT)" && "$(BIN)/python" -m pytest tests -m "not slow" $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test-fast: pytest collected no tests" >&2; fi; exit $$rc

# every seeded mutation of tests/mutations.py applied alone to a scratch copy, its tests run (docs/testing.md)
mutation-check: $(STAMP)
	cd "$(ROOT)" && "$(BIN)/python" -m tests.mutation_check $(MUTATION_ARGS)

setup: $(STAMP)

$(STAMP):
	test -x "$(BIN)/python" || $(PYTHON) -m venv "$(VENV)"
	"$(BIN)/python" -m pip install $(if $(TORCH_INDEX),--index-url "$(TORCH_INDEX)") "$(TORCH)"
	cd "$(ROOT)" && "$(BIN)/python" -m pip install -e ".[$(EXTRAS)]"
	rm -f "$(VENV)"/.hpf-setup-*
	touch "$@"

# a separate venv with torchtitan 0.3.0 (the titan3 extra; it cannot share .venv with titan's 0.2.2), the torch pin
# kept by a constraint; then: $(TITAN3_VENV)/bin/python -m pytest tests/models/test_torchtitan3.py (docs/torchtitan.md)
TITAN3_VENV ?= $(ROOT)/.venv-titan3
titan3-venv:
	test -x "$(TITAN3_VENV)/bin/python" || $(PYTHON) -m venv "$(TITAN3_VENV)"
	echo "$(TORCH)" > "$(TITAN3_VENV)/torch-pin.txt"
	"$(TITAN3_VENV)/bin/python" -m pip install $(if $(TORCH_INDEX),--index-url "$(TORCH_INDEX)") "$(TORCH)"
	cd "$(ROOT)" && "$(TITAN3_VENV)/bin/python" -m pip install -c "$(TITAN3_VENV)/torch-pin.txt" -e ".[test,titan3]"

# The newest torch this project is tested on (pyproject.toml caps torch below 2.15), in a second venv set up like
# .venv and stamped the same way; its torch pin is kept by a constraint while the project installs.  torch 2.14.1 is
# a CUDA build (~5.4 GB with its dependencies; the set-up took 5.5 min on this project's machines, which have its
# files on disk; with TORCH_INDEX, the CPU build) that runs on the CPU.  test-newest runs the fast subset there:
# .ci/run calls it after `make test`.
NEWEST_TORCH ?= torch==2.14.1
NEWEST_VENV  ?= $(ROOT)/.venv-newest
NEWEST_VENV  := $(abspath $(NEWEST_VENV))
NEWEST_KEY   := $(shell (cat "$(ROOT)/pyproject.toml"; echo "$(NEWEST_TORCH) test") | sha256sum | cut -c1-16)
NEWEST_STAMP := $(NEWEST_VENV)/.hpf-setup-$(NEWEST_KEY)

test-newest: $(NEWEST_STAMP)
	cd "$(ROOT)" && "$(NEWEST_VENV)/bin/python" -m pytest tests -m "not slow" $(PYTEST_ARGS); rc=$$?; \
	if [ $$rc -eq 5 ]; then echo "make test-newest: pytest collected no tests" >&2; fi; exit $$rc

setup-newest: $(NEWEST_STAMP)

$(NEWEST_STAMP):
	test -x "$(NEWEST_VENV)/bin/python" || $(PYTHON) -m venv "$(NEWEST_VENV)"
	echo "$(NEWEST_TORCH)" > "$(NEWEST_VENV)/torch-pin.txt"
	"$(NEWEST_VENV)/bin/python" -m pip install $(if $(TORCH_INDEX),--index-url "$(TORCH_INDEX)") "$(NEWEST_TORCH)"
	cd "$(ROOT)" && "$(NEWEST_VENV)/bin/python" -m pip install -c "$(NEWEST_VENV)/torch-pin.txt" -e ".[test]"
	rm -f "$(NEWEST_VENV)"/.hpf-setup-*
	touch "$@"

clean-setup:
	rm -f "$(VENV)"/.hpf-setup-* "$(NEWEST_VENV)"/.hpf-setup-*

# The optional extras' models (docs/diffusion-and-timm.md): diffusers' DiT, PixArt, SD3 and Flux in .venv (the
# diffusers extra, ~87 MB; torch kept by a constraint), and timm's ViT in .venv-newest, since timm imports
# torchvision and the torchvision wheels this project installs are built for torch 2.14.1.  Each runs its tests,
# slow ones included (the suite skips them where the extra is not installed).
diffusers: $(STAMP)
	"$(BIN)/python" -c "import torch; print(f'torch=={torch.__version__}')" > "$(VENV)/torch-now.txt"
	cd "$(ROOT)" && "$(BIN)/python" -m pip install -c "$(VENV)/torch-now.txt" -e ".[test,diffusers]"
	cd "$(ROOT)" && "$(BIN)/python" -m pytest tests/models/test_diffusers.py $(PYTEST_ARGS)

timm-newest: $(NEWEST_STAMP)
	cd "$(ROOT)" && "$(NEWEST_VENV)/bin/python" -m pip install -c "$(NEWEST_VENV)/torch-pin.txt" -e ".[test,timm]"
	cd "$(ROOT)" && "$(NEWEST_VENV)/bin/python" -m pytest tests/models/test_timm.py tests/models/test_handwritten.py $(PYTEST_ARGS)
