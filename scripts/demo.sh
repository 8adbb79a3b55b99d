#!/usr/bin/env bash
# The main job end to end on built-in defaults, on one CPU machine:
#   reference server (tiny Qwen3-style model) + shipped sample chats
#   -> hsgen generate -> verified store -> spectrain train (DFlash) -> exported vLLM checkpoint
#   -> spectrain eval (measured acceptance length on held-out chats).
#
#   bash scripts/demo.sh [WORKDIR]        (default ./demo; env: DEMO_SAMPLES, DEMO_PORT, DEMO_ALGORITHM)
#
# Re-running resumes: stored samples are skipped and training continues from its last checkpoint.
set -euo pipefail
WORK=${1:-demo}
SAMPLES=${DEMO_SAMPLES:-240}
PORT=${DEMO_PORT:-8765}
ALGORITHM=${DEMO_ALGORITHM:-dflash}
LAYERS=1,2,3,4   # tiny model has 4 layers: 1,2,3 feed the draft, 4 (last, before the final norm) gives the targets
mkdir -p "$WORK"
WORK=$(cd "$WORK" && pwd)
if [ -d /dev/shm ] && [ -w /dev/shm ]; then SHARED=/dev/shm/hsgen-demo-$$; else SHARED=$WORK/shared; fi
mkdir -p "$SHARED"

MODEL=$(python -c 'from hsgen.hf.tiny import ensure_tiny_model; print(ensure_tiny_model())')
CHATS=$(python -c 'from hsgen.inputs.sample_data import sample_chats_path; print(sample_chats_path())')

echo "[demo] 1/4 starting the reference server on port $PORT (log: $WORK/serve.log)" >&2
hsgen serve --model tiny --layers "$LAYERS" --shared-storage-path "$SHARED" --port "$PORT" >"$WORK/serve.log" 2>&1 &
SERVER=$!
cleanup() { kill "$SERVER" 2>/dev/null || true; wait "$SERVER" 2>/dev/null || true; rm -rf "$SHARED"; }
trap cleanup EXIT
python "$(dirname "$0")/wait_healthy.py" "$PORT" "$SERVER" 120

echo "[demo] 2/4 hsgen generate: $SAMPLES sample chats -> $WORK/store" >&2
head -n "$SAMPLES" "$CHATS" >"$WORK/train.jsonl"
hsgen generate "$WORK/train.jsonl" --endpoint "http://127.0.0.1:$PORT" --shared-dir "$SHARED" \
    --store "$WORK/store" --layer-ids "$LAYERS" --tokenizer "$MODEL" --max-len 1024 \
    >"$WORK/generate.json"
cat "$WORK/generate.json"
hsgen verify "$WORK/store" --json >"$WORK/verify.json"
hsgen status "$WORK/store"

echo "[demo] 3/4 spectrain train --speculator-type $ALGORITHM" >&2
case "$ALGORITHM" in
    dflash) ALGORITHM_FLAGS=(--block-size 4 --max-anchors 64 --num-layers 1) ;;
    eagle3) ALGORITHM_FLAGS=(--ttt-steps 3) ;;
    *) echo "DEMO_ALGORITHM must be dflash or eagle3" >&2; exit 2 ;;
esac
spectrain train --store "$WORK/store" --verifier "$MODEL" --verifier-name hsgen/tiny-qwen3 \
    --speculator-type "$ALGORITHM" "${ALGORITHM_FLAGS[@]}" --save-path "$WORK/draft" --epochs 2 \
    --total-seq-len 1024 --draft-vocab-size 512 --lr 3e-3 --save-every 50 --val-fraction 0.05 \
    --num-workers 0 >"$WORK/train.json"
cat "$WORK/train.json"

echo "[demo] 4/4 spectrain eval: speculative decoding with the exported draft on 16 held-out chats" >&2
CKPT="$WORK/draft/$(cat "$WORK/draft/latest")"
tail -n 16 "$CHATS" >"$WORK/heldout.jsonl"   # not among the first $SAMPLES used for training
spectrain eval --draft "$CKPT" --verifier "$MODEL" --prompts "$WORK/heldout.jsonl" \
    --max-new-tokens 32 --json >"$WORK/eval.json"
ls -l "$CKPT"
python - "$CKPT" "$WORK/eval.json" <<'PY'
import json, sys
cfg = json.load(open(f"{sys.argv[1]}/config.json"))
ev = json.loads(open(sys.argv[2]).read().strip().splitlines()[-1])
print(json.dumps({"checkpoint": sys.argv[1], "speculators_model_type": cfg["speculators_model_type"],
                  "architectures": cfg["architectures"],
                  "speculative_tokens": cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"],
                  "tau": round(ev["tau"], 3), "exact_match": ev["exact_match"]}))
PY
