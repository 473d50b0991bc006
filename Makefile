# rlsync: `make run` runs the default job, `make test` runs every test. Each does all of its own set-up:
# Rust crates (cargo), and a cached Python venv (outside the checkout) with torch==2.13.0 (libtorch for the
# `torch` feature, as tch 0.26 needs), hydra-core (the conformance oracle and harness) and safetensors (the
# test that runs README's checkpoint loader).
SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c

CACHE       ?= $(HOME)/.cache/rlsync
VENV        ?= $(CACHE)/venv
PYTHON      := $(VENV)/bin/python
SHARED      ?= ../shared
CONFORMANCE ?= $(SHARED)/conformance
CARGO       ?= cargo
BIN         := target/release/rlsync
VENV_STAMP  := $(VENV)/.rlsync-venv-v3
# tch builds against the torch of the venv (LIBTORCH_USE_PYTORCH); build.rs rpaths its lib dir into the binary.
TORCH_ENV   := LIBTORCH_USE_PYTORCH=1 PYTHON_SYS_EXECUTABLE=$(PYTHON) PATH="$(VENV)/bin:$$PATH"

.PHONY: all build run test test-plain test-torch conformance bench venv clean

all: build

venv: $(VENV_STAMP)
$(VENV_STAMP):
	mkdir -p $(CACHE)
	test -x $(PYTHON) || python3 -m venv $(VENV)
	$(PYTHON) -m pip install -q --disable-pip-version-check torch==2.13.0 hydra-core==1.3.8 pyyaml safetensors==0.8.0
	touch $@

# The shipped binary: with the real learner (libtorch).
build: venv
	$(TORCH_ENV) $(CARGO) build --release --locked --features torch

run: build
	$(BIN) train_embodied

# Tests of the plain build (no libtorch) and of the torch build, then the Hydra conformance kit.
test: test-plain test-torch conformance

test-plain:
	$(CARGO) test --release --locked

test-torch: venv
	$(TORCH_ENV) $(CARGO) test --release --locked --features torch

# The config engine does not need libtorch, and a torch-linked binary pays ~0.5 s of shared-library loading at
# every start, so the conformance kit (2720 process starts) runs against the plain build.
PLAIN_BIN := target/release/rlsync-plain
conformance: venv
	$(CARGO) build --release --locked
	cp $(BIN) $(PLAIN_BIN)
	$(PYTHON) $(CONFORMANCE)/run.py --bin "$(abspath $(PLAIN_BIN))" -j 2

bench: venv
	$(TORCH_ENV) $(CARGO) bench --locked --features torch

clean:
	$(CARGO) clean
