#!/usr/bin/env bash
# Install both packages (editable) with every extra the tests and the demo need.
# torch is pinned to the CPU build that CI machines carry; on a GPU box install your CUDA torch first.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q "torch==2.13.0" || python -m pip install -q torch
python -m pip install -q -e "packages/hsgen[serve,render,parquet,datasets,s3,dev]" -e "packages/spectrain[tensorboard]"
# The reference implementation the differential tests compare against (tests/spectrain/test_differential_*.py):
# speculators' model and loss code, without its dependency pins (it asks for transformers<=5.19; its model code
# runs on ours), plus exactly what that code imports.
python -m pip install -q --no-deps "speculators==0.9.0" "hs-connectors==0.9.0"
python -m pip install -q "openai==3.57.0" "datasets==5.2.0" "loguru==0.7.3" "pydantic>=2.10" "pydantic-settings==2.14.1" "httpx==0.28.1"
