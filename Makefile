# rlsync: `make run` runs the default job, `make test` runs every test. Each does all of its own set-up:
# Rust crates (cargo), and a cached Python venv (outside the checkout) with torch==2.13.0 (libtorch for the
# learner crate, as tch 0.26 needs) and hydra-core (the conformance oracle and harness); maturin + pytest for the
# Python package; torchrl/tensordict (python/bench), gymnasium[mujoco]/mujoco/tensorboard (examples/gym_ppo);
# safetensors (the test that runs README's checkpoint loader); ray (rlsync.ray_launch's tests, on a local
# three-raylet cluster).
SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c

CACHE       ?= $(HOME)/.cache/rlsync
VENV        ?= $(CACHE)/venv
PYTHON      := $(VENV)/bin/python
SHARED      ?= ../shared
CONFORMANCE ?= $(SHARED)/conformance
CARGO       ?= cargo
BIN         := target/release/rlsync
VENV_STAMP  := $(VENV)/.rlsync-venv-v6
# The pinned NVRTC (pip wheel) that compiles the CUDA kernels to the committed PTX (scripts/gen_ptx.py).
NVRTC_REL   := 12.4.127
NVRTC_DIR   := $(CACHE)/nvrtc-$(NVRTC_REL)
NVRTC_STAMP := $(NVRTC_DIR)/.rlsync-nvrtc
# The pinned ptxas (pip wheel, the same CUDA release) that assembles the committed PTX as a driver would
# (scripts/ptxas_check.py).
PTXAS_REL   := 12.4.131
PTXAS_DIR   := $(CACHE)/ptxas-$(PTXAS_REL)
PTXAS_STAMP := $(PTXAS_DIR)/.rlsync-ptxas
# tch builds against the torch of the venv (LIBTORCH_USE_PYTORCH); the learner's build.rs rpaths its lib dir
# into its binary and tests.
TORCH_ENV   := LIBTORCH_USE_PYTORCH=1 PYTHON_SYS_EXECUTABLE=$(PYTHON) PATH="$(VENV)/bin:$$PATH"

.PHONY: all build run run-gym test lint doc test-rust conformance bench venv python test-python clean nvrtc ptxas ptx test-ptx gpu-dist

all: build

venv: $(VENV_STAMP)
$(VENV_STAMP):
	mkdir -p $(CACHE)
	test -x $(PYTHON) || python3 -m venv $(VENV)
	$(PYTHON) -m pip install -q --disable-pip-version-check torch==2.13.0 hydra-core==1.3.8 pyyaml \
		maturin==1.16.0 pytest==9.2.0 pytest-xdist==3.8.0 numpy==2.4.6 \
		torchrl==0.14.1 tensordict==0.14.3 "gymnasium[mujoco]==1.4.0" mujoco==4.0.0 tensorboard==2.21.0 safetensors==0.8.0 \
		ray==2.60.0
	touch $@

# The shipped product: `rlsync` (the app, no libtorch: every command that does not train starts in
# milliseconds) and, next to it, `rlsync-learner` (the `rlsync-learner` crate, the only one linked with libtorch),
# from which the supervisor starts learner workers. One workspace, one target dir: the crates below the learner
# are compiled once and shared by both binaries, the tests and the Python binding.
build: venv
	$(TORCH_ENV) $(CARGO) build --release --locked -p rlsync -p rlsync-learner

run: build python
	$(BIN) train_embodied

# PPO on MuJoCo Reacher-v5 with Python workers: a PyTorch trainer and Gymnasium rollouts (examples/gym_ppo).
run-gym: build python
	VIRTUAL_ENV=$(VENV) $(BIN) train_embodied --config-name gym_reacher

# The `rlsync` Python package (python/: PyO3 + maturin, abi3) built in release mode and installed into the venv
# (editable: the extension module lands in python/rlsync/, which git ignores).
python: venv
	VIRTUAL_ENV=$(VENV) PATH="$(VENV)/bin:$$PATH" $(VENV)/bin/maturin develop --release --locked -q -m python/Cargo.toml

# What a session on a GPU machine carries with the tree (scripts/gpu_check.sh; that machine has no Rust and no
# network, and the carried files must stay under 64 MiB): dist/rlsync (stripped), the stripped abi3 wheel in
# dist/, and gymnasium/mujoco wheels in .whl/. Then, there: `scripts/gpu_check.sh --out FILE --budget SECONDS`.
gpu-dist: venv
	$(CARGO) build --release --locked -p rlsync
	rm -rf dist && mkdir -p dist
	strip -o dist/rlsync $(BIN)
	VIRTUAL_ENV=$(VENV) PATH="$(VENV)/bin:$$PATH" $(VENV)/bin/maturin build --release --locked --strip -q -m python/Cargo.toml -o dist
	PYTHON=$(PYTHON) scripts/gpu_wheels.sh >/dev/null
	du -ch dist .whl | tail -1

# Formatting and clippy first (they fail in a minute, the tests take many), then the Rust tests of every crate,
# the Hydra conformance kit, then the Python package's tests (last, so CI's last line is pytest's summary).
test: lint test-ptx test-rust conformance test-python

# rustfmt.toml's style, and clippy with warnings as errors on every target of every crate of the workspace
# (the shipped feature set: rlsync-core with `cuda`), then rlsync-core alone without it (the GPU dummy), then
# the contributors' docs with every intra-doc link resolving (`make doc` opens nothing, it writes target/doc).
lint: venv
	$(CARGO) fmt --all --check
	$(TORCH_ENV) $(CARGO) clippy --workspace --all-targets --release --locked -- -D warnings
	$(CARGO) clippy -p rlsync-core --all-targets --release --locked -- -D warnings
	$(MAKE) doc

# In the release profile, as clippy's: the dependencies' metadata and the build scripts clippy made serve
# rustdoc too (the dev profile would compile them all again: 8.5 of a cold `make test`'s minutes).
doc: venv
	RUSTDOCFLAGS="-D warnings" $(TORCH_ENV) $(CARGO) doc --release --no-deps --workspace --document-private-items --locked

# Every crate's unit tests and integration tests in one cargo invocation (the learner's runs need both
# binaries, which `build` makes). One build: rlsync-core without `cuda` is compiled and linted by `lint`, and
# its dummy backend's answers are tested in this build's unit tests (a second test build of the core took 3.4
# of a cold run's minutes). The binding has no Rust tests of its own: its pure parts live in the crates below
# it, and test-python tests its extension module. cargo-nextest, where installed, runs them with per-test
# timings and the slow ones flagged (.config/nextest.toml); plain `cargo test` otherwise. `--tests`: the targets
# that have tests (libraries, binaries, integration tests, the `held_worker` example), not the other examples,
# which `cargo test` would otherwise compile in full only to see that they build (`chain_bench`: a minute of a
# cold run's CPU); clippy checks them.
test-rust: build
	$(TORCH_ENV) $(CARGO) build --release --locked -p rlsync --example held_worker
	if $(CARGO) nextest --version >/dev/null 2>&1; then \
		$(TORCH_ENV) $(CARGO) nextest run --release --locked --workspace --exclude rlsync-python --tests --profile ci; \
	else \
		$(TORCH_ENV) $(CARGO) test --release --locked --workspace --exclude rlsync-python --tests; \
	fi
	$(TORCH_ENV) $(CARGO) test --release --locked --workspace --exclude rlsync-python --doc

# The conformance kit (2720 process starts) runs against the shipped `rlsync`.
conformance: build
	$(PYTHON) $(CONFORMANCE)/run.py --bin "$(abspath $(BIN))" -j 2
	$(PYTHON) tests/hydra_fixtures/check.py run --bin "$(abspath $(BIN))" --kit $(CONFORMANCE) -j 2

# The worker tests run the rlsync binary with Python workers (python -m rlsync.worker from the venv). Two
# pytest processes (pytest-xdist), each taking whole files (a file's module fixtures, such as the Ray cluster,
# are made once): most tests wait on child processes, so two keep CI's two cores busy (17 min -> 11.5-13 on this
# 2-core VM). PYTEST_WORKERS=0 runs them in this process, one after another.
PYTEST_WORKERS ?= 2
test-python: build python
	$(PYTHON) -m pytest -q -n $(PYTEST_WORKERS) --dist loadfile python/tests

# NVRTC from PyPI's wheel, installed once outside the checkout (no CUDA toolkit, no GPU needed).
nvrtc: $(NVRTC_STAMP)
$(NVRTC_STAMP):
	mkdir -p $(CACHE)
	python3 -m pip install -q --disable-pip-version-check --target $(NVRTC_DIR) nvidia-cuda-nvrtc-cu12==$(NVRTC_REL)
	touch $@

# Regenerate the committed PTX of crates/rlsync-core/kernels/rlsync.cu (after editing the kernels).
ptx: nvrtc
	python3 scripts/gen_ptx.py --nvrtc-dir $(NVRTC_DIR)/nvidia/cuda_nvrtc/lib

# The committed PTX is exactly what the pinned NVRTC makes of the kernel source, and it assembles for sm_80
# and sm_90 (as the driver's JIT would; no spills on sm_90).
test-ptx: nvrtc ptxas
	python3 scripts/gen_ptx.py --check --nvrtc-dir $(NVRTC_DIR)/nvidia/cuda_nvrtc/lib
	python3 scripts/ptxas_check.py --ptxas $(PTXAS_DIR)/nvidia/cuda_nvcc/bin/ptxas

# ptxas from PyPI's nvcc wheel, installed once outside the checkout (no GPU needed).
ptxas: $(PTXAS_STAMP)
$(PTXAS_STAMP):
	mkdir -p $(CACHE)
	python3 -m pip install -q --disable-pip-version-check --target $(PTXAS_DIR) nvidia-cuda-nvcc-cu12==$(PTXAS_REL)
	chmod +x $(PTXAS_DIR)/nvidia/cuda_nvcc/bin/ptxas
	touch $@

bench: venv
	$(TORCH_ENV) $(CARGO) bench --locked -p rlsync

clean:
	$(CARGO) clean
