#!/usr/bin/env bash
# Fill .gpu-carry/ (git-ignored) on a machine that reaches PyPI, for scripts/gpu/run_all.sh on the
# offline GPU machine (the device tool's `carry: [".gpu-carry"]` takes it along):
#   .gpu-carry/peer-bench/       a copy of the shared peer-bench folder, its wheels in whl/ (fetch_wheels.sh)
#   .gpu-carry/whl/              cp312 manylinux wheels of what our packages need beyond the GPU image
#                                (Python 3.12, torch 2.11, transformers 5.17: it lacks zarr and its deps)
#   .gpu-carry/hsgen-cache/      the built-in tiny model (`hsgen serve --model tiny`; minutes to build on a
#                                fresh machine, under a megabyte), run_all.sh's $HSGEN_CACHE
# The synthetic reference store of the `train` part (5.2 GB) cannot be carried: run_all.sh writes it there.
# Needs this checkout's packages installed (bash scripts/install.sh) for the tiny model.
#   bash scripts/gpu/prepare.sh [PEER_BENCH_DIR]     (default: the shared/peer-bench beside the checkout)
set -euo pipefail
cd "$(dirname "$0")/../.."
CARRY=.gpu-carry
PEER=${1:-}
if [ -z "$PEER" ]; then
  common=$(git rev-parse --path-format=absolute --git-common-dir 2>/dev/null || echo .git)
  for d in ../shared/peer-bench "$(dirname "$common")/../shared/peer-bench"; do
    [ -f "$d/run.sh" ] && PEER=$d && break
  done
fi
[ -n "$PEER" ] && [ -f "$PEER/run.sh" ] || { echo "prepare.sh: no peer-bench folder found; pass its path" >&2; exit 2; }
rm -rf "$CARRY"
mkdir -p "$CARRY/whl"
cp -r "$PEER" "$CARRY/peer-bench"
rm -rf "$CARRY/peer-bench/results" "$CARRY/peer-bench/__pycache__"
[ -n "$(ls "$CARRY"/peer-bench/whl/*.whl 2>/dev/null)" ] || bash "$CARRY/peer-bench/fetch_wheels.sh" "$CARRY/peer-bench/whl"
# ours: hsgen's store needs zarr (and numcodecs, donfig, google-crc32c), its client tenacity; the image
# (device/KINDS.md, read 2026-11-17) has every other runtime dependency: aiohttp, xxhash, ml-dtypes, click, ...
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$CARRY/whl" zarr==3.1.6 numcodecs==0.16.6 donfig==0.8.1.post1 google-crc32c==1.9.0 \
  tenacity==9.2.1
# built in (or taken from) this machine's own cache, then copied: a second prepare costs nothing
TINY_MODEL=$("${PYTHON:-python3}" -c 'from hsgen.hf.tiny import ensure_tiny_model; print(ensure_tiny_model())')
mkdir -p "$CARRY/hsgen-cache" && cp -r "$TINY_MODEL" "$CARRY/hsgen-cache/"
du -sh "$CARRY" "$CARRY"/peer-bench/whl "$CARRY"/whl "$CARRY"/hsgen-cache
ls "$CARRY/whl" "$CARRY/peer-bench/whl"
