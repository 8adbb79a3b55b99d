#!/usr/bin/env bash
# Regenerate requirements-lock.txt, the exact versions scripts/install.sh installs (and so CI and a new user):
#
#   bash scripts/lock.sh
#
# Builds a throwaway virtual environment, runs scripts/install.sh there with the lock switched off
# (SPECTRAIN_LOCK=, so pip resolves the packages' own ranges from their pyproject.toml files to today's
# newest versions), and writes what got installed, less our two editable packages and torch (install.sh
# pins torch itself: the CPU build on disk here, your CUDA build on a GPU box), to requirements-lock.txt.
# Re-measure the benchmarks (docs/benchmarks.md) when the lock changes: the quality benchmark's target and
# data depend on transformers, tokenizers and torch, and its result JSON names their versions.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${LOCK_PYTHON:-$(command -v python3.11 || command -v python3)}"
TMP="$(mktemp -d /tmp/spectrain-lock.XXXXXX)"
trap 'rm -rf "$TMP"' EXIT
"$PY" -m venv "$TMP/venv"
"$TMP/venv/bin/python" -m pip install -q --upgrade pip >/dev/null
PATH="$TMP/venv/bin:$PATH" SPECTRAIN_LOCK= bash scripts/install.sh
{
    echo "# Exact versions scripts/install.sh installs (pip constraints). Regenerate with: bash scripts/lock.sh"
    echo "# Resolved $(date -u +%Y-%m-%d) on $("$TMP/venv/bin/python" -c 'import platform, sys; print(f"Python {sys.version.split()[0]}, {platform.system()} {platform.machine()}")')."
    echo "# torch is pinned by install.sh, not here; the packages' pyproject.toml files keep ranges for library users."
    "$TMP/venv/bin/python" -m pip freeze --exclude-editable |
        grep -viE '^(pip|setuptools|wheel|torch|triton|nvidia-[a-z0-9_-]+)==' |
        sort -f
} >requirements-lock.txt.new
mv requirements-lock.txt.new requirements-lock.txt
echo "wrote requirements-lock.txt ($(grep -vc '^#' requirements-lock.txt) packages)" >&2
