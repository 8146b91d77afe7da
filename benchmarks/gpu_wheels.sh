#!/usr/bin/env bash
# Download, where pip can reach PyPI, the wheels gpu_throughput.sh installs on a GPU machine without a package
# registry: meshforge's dependencies beyond torch, and torchao for FP8, for CPython 3.12 on x86-64 Linux.
#   benchmarks/gpu_wheels.sh [DIR]     (default benchmarks/.wheels, git-ignored; carry it to the GPU machine)
set -euo pipefail
cd "$(dirname "$0")/.."
DIR=${1:-benchmarks/.wheels}
python -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 -d "$DIR" \
  "pydantic>=2.5,<3" pydantic-core annotated-types typing-inspection typing-extensions "PyYAML>=6" "rich>=13" \
  markdown-it-py mdurl pygments "safetensors>=0.4" "numpy>=1.24" "torchao==0.18.0"
ls "$DIR"
