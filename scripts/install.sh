#!/usr/bin/env bash
# Install both packages (editable) with every extra the tests and the demo need, at the exact versions of
# requirements-lock.txt (regenerate it with `bash scripts/lock.sh`; SPECTRAIN_LOCK= installs from the packages'
# own ranges instead, SPECTRAIN_LOCK=FILE from another lock).
# torch is pinned to the CPU build that CI machines carry; on a GPU box install your CUDA torch first.
set -euo pipefail
cd "$(dirname "$0")/.."
LOCK="${SPECTRAIN_LOCK-requirements-lock.txt}"
C=()
if [ -n "$LOCK" ]; then
    [ -f "$LOCK" ] || { echo "install.sh: no lock file $LOCK (SPECTRAIN_LOCK)" >&2; exit 1; }
    C=(-c "$LOCK")
fi
python -m pip install -q "torch==2.13.0" || python -m pip install -q torch
python -m pip install -q "${C[@]}" -e "packages/hsgen[serve,render,parquet,datasets,s3,dev]" -e "packages/spectrain[tensorboard]"
# The reference implementation the differential tests and `bench_quality.py --peer` compare against: speculators'
# model, loss and trainer code, without its dependency pins (it asks for transformers<=5.19; its code runs on ours),
# plus exactly what that code imports.
python -m pip install -q "${C[@]}" --no-deps "speculators==0.9.0" "hs-connectors==0.9.0"
python -m pip install -q "${C[@]}" "openai==3.57.0" "datasets==5.2.0" "loguru==0.7.3" "pydantic>=2.10" "pydantic-settings==2.14.1" \
    "httpx==0.28.1" typer rich
