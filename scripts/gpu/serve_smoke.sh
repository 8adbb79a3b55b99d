#!/usr/bin/env bash
# hsgen serve on a device, end to end: the tiny model served with --device DEVICE, `hsgen generate`
# of 8 sample chats into a store through it, `hsgen verify` of that store. Prints one JSON line.
#   bash scripts/gpu/serve_smoke.sh WORKDIR [DEVICE]      (DEVICE default cuda; port $SMOKE_PORT or a free one)
set -euo pipefail
WORK=$1
DEVICE=${2:-cuda}
PY=${PYTHON:-python3}
PORT=${SMOKE_PORT:-$("$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')}
LAYERS=1,2,3,4
mkdir -p "$WORK/shared"
MODEL=$("$PY" -c 'from hsgen.hf.tiny import ensure_tiny_model; print(ensure_tiny_model())')
CHATS=$("$PY" -c 'from hsgen.inputs.sample_data import sample_chats_path; print(sample_chats_path())')
head -n 8 "$CHATS" > "$WORK/chats.jsonl"
"$PY" -m hsgen.cli serve --model tiny --layers "$LAYERS" --device "$DEVICE" --shared-storage-path "$WORK/shared" \
  --port "$PORT" > "$WORK/serve.log" 2>&1 &
SERVER=$!
trap 'kill $SERVER 2>/dev/null || true; wait $SERVER 2>/dev/null || true' EXIT
"$PY" "$(dirname "$0")/../wait_healthy.py" "$PORT" "$SERVER" "${SMOKE_HEALTH_TIMEOUT:-45}"
T0=$(date +%s.%N)
"$PY" -m hsgen.cli generate "$WORK/chats.jsonl" --endpoint "http://127.0.0.1:$PORT" --shared-dir "$WORK/shared" \
  --store "$WORK/store" --layer-ids "$LAYERS" --tokenizer "$MODEL" --max-len 1024 > "$WORK/generate.json"
T1=$(date +%s.%N)
"$PY" -m hsgen.cli verify "$WORK/store" --json > "$WORK/verify.json"
"$PY" - "$WORK" "$DEVICE" "$T0" "$T1" <<'PY'
import json, sys
work, device, t0, t1 = sys.argv[1], sys.argv[2], float(sys.argv[3]), float(sys.argv[4])
gen = json.loads(open(f"{work}/generate.json").read().strip().splitlines()[-1])
ver = json.loads(open(f"{work}/verify.json").read().strip().splitlines()[-1])
print(json.dumps({"serve_device": device, "generate_seconds": round(t1 - t0, 2), "generate": gen, "verify": ver}))
PY
