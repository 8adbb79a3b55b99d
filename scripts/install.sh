#!/usr/bin/env bash
# Install both packages (editable) with every extra the tests and the demo need.
# torch is pinned to the CPU build that CI machines carry; on a GPU box install your CUDA torch first.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q "torch==2.13.0" || python -m pip install -q torch
python -m pip install -q -e "packages/hsgen[serve,render,parquet,datasets,dev]" -e "packages/spectrain[tensorboard]"
