#!/usr/bin/env bash
# The side-by-side GPU run (issues 12 and 20): one script under one deadline. Needs no internet: run
# scripts/gpu/prepare.sh first on a machine with PyPI and carry .gpu-carry/ along (docs/benchmarks.md
# has the device call).
#
# The whole run ends by DEADLINE seconds after it starts (default 540: the device tool gives a
# command 600 s), kill grace included: every part's bound is its own default or what is left,
# whichever is less (kill grace and 10 s for the records kept back), and a part with under 15 s
# left is skipped. As each part ends its record
# (name, exit status, seconds, bound, and the JSON it printed) is appended to $OUT/parts.jsonl and
# $OUT/summary.json is rewritten, so a run killed at any moment has already left what finished.
# Nothing depends on the run's end: no tee (a group SIGTERM kills it first), logs go to files.
#
#   eager     our bench_train.py at the reference shape, one process per draft (DFlash, Eagle3, then DSpark): tokens/s, peak
#             memory (AdamW, and spectrain train's default optimizer when it differs), a host-device
#             sync census and one step under torch.cuda.set_sync_debug_mode("error")
#   peer      the peer's step (speculators 0.9.0, .gpu-carry/peer-bench/run.sh), AdamW, same shape
#   train     a short real `spectrain train` on a synthetic reference-shape store (store -> loader ->
#             step: tokens/s and data_wait_fraction); the store (5 GB: too big to carry) is written
#             on the host's cores in the background from the start, while the GPU parts run
#   serve     `hsgen serve --device cuda` of the carried tiny model, `hsgen generate` of 8 chats, verify
#   multi     `spectrain train` under torchrun three times on serve's store: NCCL over the GPUs when there
#             are two or more (else two gloo ranks on the host); fails unless every run exits 0 with a
#             complete checkpoint (issue 30: distributed runs end cleanly)
#   compiled  bench_train.py with the training forward compiled (AdamW, 5 steps), one process per draft
#   data      with the time left (not at the tiny shape): bench_loader.py and bench_online.py's
#             realistic mode, 4 reader threads, on the GPU host's cores (issue 14's ceiling)
#   vllm      DFlash, Eagle3 and DSpark drafts served by vLLM on the GPU (DSpark needs its V2 runner)
#             against spectrain eval (bench_vllm_parity.py --quick --dspark): only with VLLM_VENV naming
#             a venv of vLLM's CUDA build; the image has none and it is far over the carry limit
#
# $OUT (default ./gpu-results) gets summary.json (our figures, the peer's, the ratios, and `parts`:
# how each part ended), parts.jsonl, run_all.log and logs.tar.gz (every part's logs and JSON).
# TINY=1 DEVICE=cpu runs the same parts at a tiny shape on CPU (tests; the peer is skipped when
# .gpu-carry/peer-bench is absent). PARTS picks parts (default "eager peer train serve multi compiled
# data vllm"), e.g. PARTS="compiled data" for a rerun of what a first run did not reach.
set -u
trap '' PIPE  # a closed stderr must not kill the run: everything also goes to files
cd "$(dirname "$0")/../.."
ROOT=$PWD
OUT=${OUT:-$ROOT/gpu-results}
WORK=${WORK:-$(mktemp -d /tmp/gpu-run.XXXXXX)}
PY=${PYTHON:-python3}
DEVICE=${DEVICE:-cuda}
TINY=${TINY:-0}
CARRY=${CARRY:-$ROOT/.gpu-carry}
DEADLINE=${DEADLINE:-540}
RESERVE=10  # seconds kept back from every bound for the records and the last publish
PARTS=" ${PARTS:-eager peer train serve multi compiled data vllm} "
want() { [[ "$PARTS" == *" $1 "* ]]; }
mkdir -p "$OUT" "$WORK/logs"
LOG=$OUT/run_all.log
: > "$LOG"
T0=$(date +%s)
log() {
  local line="[run_all +$(( $(date +%s) - T0 ))s] $*"
  echo "$line" >> "$LOG"
  echo "$line" >&2 2>/dev/null || true
}
left() { echo $(( DEADLINE - ($(date +%s) - T0) )); }

# summary.json, parts.jsonl and logs.tar.gz under $OUT, each replaced whole (bounded: never the
# reason a run overruns)
publish() {
  timeout -k 2 20 "$PY" scripts/gpu/summarize.py "$WORK" --out "$OUT" 2>> "$WORK/logs/summarize.log" \
    || log "summarize failed (see logs/summarize.log)"
  pack
}
pack() {
  cp "$LOG" "$WORK/logs/run_all.log" 2>/dev/null
  tar -czf "$OUT/.logs.tar.gz" -C "$WORK" logs 2>/dev/null && mv -f "$OUT/.logs.tar.gz" "$OUT/logs.tar.gz"
}
# record NAME RC SECONDS BOUND [JSON FILE...]: one line in parts.jsonl, then publish (one interpreter)
record() {
  local name=$1 rc=$2 secs=$3 bound=$4; shift 4
  timeout -k 2 20 "$PY" scripts/gpu/summarize.py "$WORK" --record "$name" --rc "$rc" --seconds "$secs" \
    --bound "$bound" --out "$OUT" "$@" 2>> "$WORK/logs/summarize.log" || log "recording $name failed"
  pack
}
# part NAME DEFAULT_BOUND KILL_GRACE OUT_JSON CMD...: CMD under `timeout` with the lesser of its
# bound and the time left, stdout to OUT_JSON, stderr to logs/NAME.log; skipped under 15 s left
part() {
  local name=$1 default=$2 grace=$3 json=$4; shift 4
  local b=$(( $(left) - grace - RESERVE ))
  (( b > default )) && b=$default
  if (( b < 15 )); then
    log "$name skipped: $(left)s left"
    record "$name" skipped 0 0
    return 0
  fi
  log "$name (bound ${b}s)"
  CUR_NAME=$name CUR_JSON=$json CUR_T=$(date +%s) CUR_BOUND=$b
  # in the background and waited for, so a signal's trap runs at once (`timeout` starts its own
  # process group: the trap passes the signal on)
  timeout -k "$grace" "$b" "$@" > "$json" 2> "$WORK/logs/$name.log" &
  CUR_PID=$!
  wait "$CUR_PID"
  local rc=$?
  CUR_PID=
  log "$name rc=$rc in $(( $(date +%s) - CUR_T ))s: $(tail -c 300 "$json" 2>/dev/null)"
  record "$name" "$rc" $(( $(date +%s) - CUR_T )) "$b" "$json"
}
CUR_PID= REF_PID=
on_signal() {
  log "stopped by a signal${CUR_PID:+ during $CUR_NAME}"
  for p in $CUR_PID $REF_PID; do kill -TERM "$p" 2>/dev/null; done
  [ -n "$CUR_PID" ] && record "$CUR_NAME" interrupted $(( $(date +%s) - CUR_T )) "$CUR_BOUND" "$CUR_JSON"
  publish
  exit 143
}
trap on_signal TERM INT

# our dependencies the image lacks (zarr, numcodecs, donfig, google-crc32c, tenacity), then our sources
SITE=$WORK/site
if ls "$CARRY"/whl/*.whl >/dev/null 2>&1; then
  log "installing $(ls "$CARRY"/whl/*.whl | wc -l) carried wheels into $SITE"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$CARRY"/whl/*.whl \
    > "$WORK/logs/pip.log" 2>&1 || log "pip install of the carried wheels failed (see logs/pip.log)"
fi
export PYTHONPATH="$ROOT/packages/hsgen/src:$ROOT/packages/spectrain/src:$SITE${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
# the tiny model prepare.sh built (a fresh machine would spend minutes training it)
[ -d "$CARRY/hsgen-cache" ] && export HSGEN_CACHE=$CARRY/hsgen-cache
# versions, then every module the parts import, in one interpreter: a missing wheel ends the run
# here, in seconds, leaving device time for a rerun, instead of failing every part
date -u > "$WORK/logs/env.txt"
command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,power.limit \
  --format=csv >> "$WORK/logs/env.txt" 2>&1
if ! "$PY" - >> "$WORK/logs/env.txt" 2>&1 <<'PY'
import sys
print("python", sys.version.split()[0])
import torch
gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no gpu"
print("torch", torch.__version__, "cuda", torch.version.cuda, gpu)
import zarr, hsgen, spectrain
print("zarr", zarr.__version__, hsgen.__file__, spectrain.__file__)
import hsgen.cli, hsgen.client.fetch, hsgen.serve, spectrain.cli, spectrain.train.loop
PY
then
  cat "$WORK/logs/env.txt" >> "$LOG"
  log "imports failed, stopping: $(tail -n 1 "$WORK/logs/env.txt")"
  publish
  exit 3
fi
cat "$WORK/logs/env.txt" >> "$LOG"
log "imports ok"

TINY_FLAG=(); PEER_DEFAULT="--loss-impl eager --optimizers adamw"; COMPILE_BACKEND=inductor
if [ "$TINY" = 1 ]; then
  TINY_FLAG=(--tiny); PEER_DEFAULT="--tiny --loss-impl eager --optimizers adamw"
  COMPILE_BACKEND=${COMPILE_BACKEND_TINY:-aot_eager}
  REF_ARGS=(--tiny --samples 12 --tokens 256)
  TRAIN_ARGS=(--block-size 4 --max-anchors 16 --num-layers 1 --total-seq-len 512 --max-steps 4)
else
  REF_ARGS=(--samples 40 --tokens 2048); TRAIN_ARGS=(--max-steps 10)
fi

# the reference store for `train`, on the host's cores while the GPU parts run
if want train; then
  REF_BOUND=$(( DEADLINE - 30 )); (( REF_BOUND > ${REFERENCE_TIMEOUT:-150} )) && REF_BOUND=${REFERENCE_TIMEOUT:-150}
  log "writing the synthetic reference store in the background (bound ${REF_BOUND}s)"
  REF_T0=$(date +%s)
  timeout -k 5 "$REF_BOUND" "$PY" scripts/gpu/synthetic_reference.py "$WORK/ref" "${REF_ARGS[@]}" \
    > "$WORK/logs/reference.json" 2> "$WORK/logs/reference.log" &
  REF_PID=$!
fi

if want eager; then
  for m in dflash eagle3 dspark; do
    part "eager-$m" "${OURS_TIMEOUT:-100}" 10 "$WORK/logs/ours-$m.json" "$PY" scripts/bench_train.py --models "$m" \
      --device "$DEVICE" --no-loader --sync-census --compile off "${TINY_FLAG[@]}" --json-out "$WORK/logs/ours-$m.json"
  done
fi

if ! want peer; then
  :
elif [ -f "$CARRY/peer-bench/run.sh" ]; then
  # its own two bounds (DFlash, then Eagle3) shrink to fit what is left (install ~20 s)
  b=$(( $(left) - 20 )); (( b > 210 )) && b=210
  PD=$(( b * 11 / 20 )); PE=$(( b - PD - 25 ))
  RESULTS="$WORK/logs/peer" PEER_SITE="$WORK/peer-site" PYTHON="$PY" BENCH_ARGS="${PEER_ARGS:-$PEER_DEFAULT}" \
    DFLASH_TIMEOUT="${PEER_DFLASH_TIMEOUT:-$PD}" EAGLE3_TIMEOUT="${PEER_EAGLE3_TIMEOUT:-$PE}" \
    part peer "$b" 10 "$WORK/logs/peer-run.log" bash "$CARRY/peer-bench/run.sh"
else
  log "peer skipped: $CARRY/peer-bench missing (run scripts/gpu/prepare.sh)"
  record peer skipped 0 0
fi

if want train; then
  wait "$REF_PID"  # bounded by its own timeout
  rc=$?
  REF_PID=
  log "synthetic store rc=$rc ($(( $(date +%s) - REF_T0 ))s since it started): $(cat "$WORK/logs/reference.json")"
  record reference "$rc" $(( $(date +%s) - REF_T0 )) "$REF_BOUND" "$WORK/logs/reference.json"
  part train "${TRAIN_TIMEOUT:-75}" 10 "$WORK/logs/train.json" "$PY" -m spectrain.cli train --store "$WORK/ref/store" \
    --verifier "$WORK/ref/verifier" --speculator-type dflash "${TRAIN_ARGS[@]}" --log-every 1 --save-every 0 \
    --no-save-final --val-fraction 0 --device "$DEVICE" --save-path "$WORK/train"
  cp "$WORK/train/metrics.jsonl" "$WORK/logs/train-metrics.jsonl" 2>/dev/null && publish
fi

if want serve; then
  part serve "${SERVE_TIMEOUT:-60}" 5 "$WORK/logs/serve.json" bash scripts/gpu/serve_smoke.sh "$WORK/serve" "$DEVICE"
fi

if ! want multi; then
  :
elif [ -d "$WORK/serve/store" ]; then
  part multi "${MULTI_TIMEOUT:-120}" 10 "$WORK/logs/multi.json" bash scripts/gpu/multi_rank.sh "$WORK/serve/store" \
    "$("$PY" -c 'from hsgen.hf.tiny import ensure_tiny_model; print(ensure_tiny_model())')" "$WORK/multi" "$DEVICE"
  cp "$WORK"/multi/run-*.log "$WORK/logs/" 2>/dev/null
else
  log "multi skipped: no store from the serve part"
  record multi skipped 0 0
fi

if want compiled; then
  for m in dflash eagle3 dspark; do
    part "compiled-$m" "${OURS_COMPILED_TIMEOUT:-110}" 10 "$WORK/logs/ours-compiled-$m.json" "$PY" scripts/bench_train.py \
      --models "$m" --device "$DEVICE" --no-loader --sync-census --compile on --compile-backend "$COMPILE_BACKEND" \
      --adamw-only --steps 5 "${TINY_FLAG[@]}" --json-out "$WORK/logs/ours-compiled-$m.json"
  done
fi

# the data path on the GPU host (issue 14: the online ceiling per training process must exceed
# 1.8 GB/s there), in at most 2 minutes of what is left; not at the tiny shape
if ! want data; then
  :
elif [ "$TINY" = 1 ]; then
  log "data skipped at the tiny shape"
  record loader skipped 0 0
else
  b=$(( $(left) / 3 )); (( b > 40 )) && b=40
  part loader "$b" 5 "$WORK/logs/loader.json" "$PY" scripts/bench_loader.py --quick --threads 4
  part online 80 5 "$WORK/logs/online.json" "$PY" scripts/bench_online.py --quick --mode realistic --threads 4
fi
if ! want vllm; then
  :
elif [ -n "${VLLM_VENV:-}" ] && [ -x "$VLLM_VENV/bin/python" ] && [ "$DEVICE" = cuda ]; then
  part vllm "${VLLM_TIMEOUT:-300}" 10 "$WORK/logs/vllm.json" "$PY" scripts/bench_vllm_parity.py --quick --dspark \
    --work "$WORK/vllm" --vllm-venv "$VLLM_VENV"
else
  log "vllm skipped: no VLLM_VENV with vLLM's CUDA build on this machine"
  record vllm skipped 0 0
fi
log "done in $(( $(date +%s) - T0 ))s; results in $OUT"
publish
