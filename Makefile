# rlsync: `make run` runs the default job, `make test` runs every test. Each does all of its own set-up.
SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c

CACHE      ?= $(HOME)/.cache/rlsync
VENV       ?= $(CACHE)/venv
PYTHON     := $(VENV)/bin/python
SHARED     ?= ../shared
CONFORMANCE ?= $(SHARED)/conformance
CARGO      ?= cargo
BIN        := target/release/rlsync
VENV_STAMP := $(VENV)/.rlsync-venv-v1

.PHONY: all build run test test-rust conformance bench venv clean

all: build

# The Python venv (outside the checkout, reused across runs): real Hydra for the conformance harness.
venv: $(VENV_STAMP)
$(VENV_STAMP):
	mkdir -p $(CACHE)
	test -x $(PYTHON) || python3 -m venv $(VENV)
	$(PYTHON) -m pip install -q --disable-pip-version-check hydra-core==1.3.8 pyyaml
	touch $@

build:
	$(CARGO) build --release --locked

run: build
	$(BIN) train_embodied

test: venv test-rust conformance

test-rust:
	$(CARGO) test --release --locked

conformance: build venv
	$(PYTHON) $(CONFORMANCE)/run.py --bin "$(abspath $(BIN))" -j 2

bench: build
	$(CARGO) bench --locked

clean:
	$(CARGO) clean
