#!/usr/bin/env bash
# Wheels the GPU machine's image lacks for the gym_ppo stage of scripts/gpu_check.sh, downloaded into .whl/
# (git-ignored; carry it with the tree): gymnasium[mujoco] and mujoco at the Makefile venv's versions, for
# CPython 3.12 on manylinux x86_64, and the requirements that image does not have (checked against
# /work/.library/device/KINDS.md's package list: numpy, cloudpickle, typing-extensions, imageio, packaging and
# absl-py are there). mujoco-studio (the interactive viewer, 13 MB, needs websockets) is left out: `import
# mujoco` and the MuJoCo envs do not use it. About 14 MB in all.
#   scripts/gpu_wheels.sh [DIR]      (default: .whl in the repository root)
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DIR="${1:-$ROOT/.whl}"
PY="${PYTHON:-python3}"
mkdir -p "$DIR"
"$PY" -m pip download -q --disable-pip-version-check --no-deps --only-binary=:all: \
    --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
    -d "$DIR" \
    gymnasium==1.4.0 mujoco==4.0.0 mujoco-core==4.0.0 \
    farama-notifications==0.0.6 glfw==2.11.0 pyopengl==3.1.10
ls -la "$DIR"
du -sh "$DIR"
