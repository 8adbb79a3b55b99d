#!/usr/bin/env bash
# The side-by-side GPU run of issue 12, one script, about 8 minutes on an H200 (each part has a
# time bound; all of them end by 9.5 minutes, under the device tool's 10). Needs no internet: run
# scripts/gpu/prepare.sh first on a machine with PyPI and carry .gpu-carry/ along (see
# docs/benchmarks.md for the device call).
#
#   1. our bench_train.py at the reference shape: tokens/s and peak memory (AdamW; and the default
#      optimizer of spectrain train when it is not AdamW), a host-device sync census and one step
#      under torch.cuda.set_sync_debug_mode("error"); then the same with the training forward
#      compiled (AdamW), so compile on and off are timed side by side (summary: *_compile_speedup)
#   2. the peer's step (speculators 0.9.0, .gpu-carry/peer-bench/run.sh): same shape, same GPU
#   3. a short real `spectrain train` on a synthetic store at the reference shape (store -> loader
#      -> step, so the loader's cost shows in tokens/s and data_wait_fraction)
#   4. an `hsgen serve --device cuda` smoke: the tiny model served on the GPU, `hsgen generate`
#      of 8 chats into a store, `hsgen verify`
#   5. with the time left (not at the tiny shape): bench_loader.py and bench_online.py's realistic
#      mode, 4 reader threads, on the GPU host's cores (issue 14's per-process ceiling)
#
# Everything lands in $OUT (default ./gpu-results): summary.json (one JSON object: our figures,
# the peer's, the ratios), run_all.log, and logs.tar.gz (every part's logs and JSON).
# TINY=1 DEVICE=cpu runs the same parts at a tiny shape on CPU (tests; the peer is skipped when
# .gpu-carry/peer-bench is absent). PARTS picks parts for a rerun of the ones that failed (default
# "eager compiled peer train serve data"; e.g. PARTS="peer data"): a rerun must fit in the
# session's device time, which a whole run (~8 minutes) does not.
set -u
cd "$(dirname "$0")/../.."
ROOT=$PWD
OUT=${OUT:-$ROOT/gpu-results}
WORK=${WORK:-$(mktemp -d /tmp/gpu-run.XXXXXX)}
PY=${PYTHON:-python3}
DEVICE=${DEVICE:-cuda}
TINY=${TINY:-0}
CARRY=${CARRY:-$ROOT/.gpu-carry}
PARTS=" ${PARTS:-eager compiled peer train serve data} "
want() { [[ "$PARTS" == *" $1 "* ]]; }
mkdir -p "$OUT" "$WORK/logs"
exec > >(tee "$OUT/run_all.log") 2>&1
T0=$(date +%s)
log() { echo "[run_all +$(( $(date +%s) - T0 ))s] $*"; }

package() {
  log "summarising"
  "$PY" scripts/gpu/summarize.py "$WORK" > "$OUT/summary.json" 2> "$WORK/logs/summarize.log" \
    || log "summarize failed (see logs/summarize.log)"
  cat "$OUT/summary.json" 2>/dev/null
  tar -czf "$OUT/logs.tar.gz" -C "$WORK" logs 2>/dev/null
  log "done; results in $OUT"
}
trap package EXIT

# 0. our dependencies the image lacks (zarr, numcodecs, donfig, google-crc32c, tenacity), then our sources
SITE=$WORK/site
if ls "$CARRY"/whl/*.whl >/dev/null 2>&1; then
  log "installing $(ls "$CARRY"/whl/*.whl | wc -l) carried wheels into $SITE"
  "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$SITE" "$CARRY"/whl/*.whl \
    > "$WORK/logs/pip.log" 2>&1 || log "pip install of the carried wheels failed (see logs/pip.log)"
fi
export PYTHONPATH="$ROOT/packages/hsgen/src:$ROOT/packages/spectrain/src:$SITE${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
{
  date -u; "$PY" -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__,
"cuda", torch.version.cuda, torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no gpu")'
  nvidia-smi --query-gpu=name,memory.total,clocks.max.sm,power.limit --format=csv 2>&1 | head -3
  "$PY" -c 'import zarr, hsgen, spectrain; print("zarr", zarr.__version__, hsgen.__file__, spectrain.__file__)'
} > "$WORK/logs/env.txt" 2>&1
cat "$WORK/logs/env.txt"
# every module the parts import: a missing wheel ends the run here, in seconds, leaving device time
# for a rerun, instead of failing every part
if ! "$PY" -c 'import hsgen.cli, hsgen.client, hsgen.serve, spectrain.cli, spectrain.train' > "$WORK/logs/imports.txt" 2>&1; then
  log "imports failed, stopping: $(tail -n 1 "$WORK/logs/imports.txt")"
  exit 3
fi
log "imports ok"

TINY_FLAG=(); PEER_DEFAULT="--loss-impl eager --optimizers adamw"
if [ "$TINY" = 1 ]; then TINY_FLAG=(--tiny); PEER_DEFAULT="--tiny --loss-impl eager --optimizers adamw"; fi

# 1. ours, eager then compiled (bounds 90 + 140 s)
COMPILE_BACKEND=inductor
if [ "$TINY" = 1 ]; then COMPILE_BACKEND=${COMPILE_BACKEND_TINY:-aot_eager}; fi
if want eager; then
  log "1/5 bench_train.py at the reference shape (eager)"
  timeout -k 10 "${OURS_TIMEOUT:-90}" "$PY" scripts/bench_train.py --device "$DEVICE" --no-loader --sync-census \
    --compile off "${TINY_FLAG[@]}" > "$WORK/logs/ours.json" 2> "$WORK/logs/ours.log"
  log "bench_train rc=$?: $(tail -c 400 "$WORK/logs/ours.json")"
fi
if want compiled; then
  log "1/5 bench_train.py at the reference shape (torch.compile, $COMPILE_BACKEND)"
  timeout -k 10 "${OURS_COMPILED_TIMEOUT:-140}" "$PY" scripts/bench_train.py --device "$DEVICE" --no-loader \
    --sync-census --compile on --compile-backend "$COMPILE_BACKEND" --adamw-only --steps 5 "${TINY_FLAG[@]}" \
    > "$WORK/logs/ours-compiled.json" 2> "$WORK/logs/ours-compiled.log"
  log "bench_train --compile on rc=$?: $(tail -c 400 "$WORK/logs/ours-compiled.json")"
fi

# 2. the peer, AdamW (its headline; its Muon figures are in shared/peer-bench/README.md) (bounds 110 + 80 s,
#    install ~20 s)
if ! want peer; then
  :
elif [ -f "$CARRY/peer-bench/run.sh" ]; then
  log "2/5 the peer's step (speculators)"
  RESULTS="$WORK/logs/peer" PEER_SITE="$WORK/peer-site" PYTHON="$PY" BENCH_ARGS="${PEER_ARGS:-$PEER_DEFAULT}" \
    DFLASH_TIMEOUT="${PEER_DFLASH_TIMEOUT:-110}" EAGLE3_TIMEOUT="${PEER_EAGLE3_TIMEOUT:-80}" \
    timeout -k 10 210 bash "$CARRY/peer-bench/run.sh" > "$WORK/logs/peer-run.log" 2>&1
  log "peer rc=$?: $(tail -n 3 "$WORK/logs/peer-run.log")"
else
  log "2/5 skipped: $CARRY/peer-bench missing (run scripts/gpu/prepare.sh)"
fi

# 3. spectrain train on a synthetic store at the reference shape (bounds 30 + 65 s)
if want train; then
  log "3/5 spectrain train on a synthetic store"
  if [ "$TINY" = 1 ]; then
    REF_ARGS=(--tiny --samples 12 --tokens 256); TRAIN_ARGS=(--block-size 4 --max-anchors 16 --num-layers 1
      --total-seq-len 512 --max-steps 4)
  else
    REF_ARGS=(--samples 40 --tokens 2048); TRAIN_ARGS=(--max-steps 10)
  fi
  timeout -k 5 30 "$PY" scripts/gpu/synthetic_reference.py "$WORK/ref" "${REF_ARGS[@]}" \
    > "$WORK/logs/reference.json" 2> "$WORK/logs/reference.log"
  log "synthetic store rc=$?: $(cat "$WORK/logs/reference.json")"
  timeout -k 10 65 "$PY" -m spectrain.cli train --store "$WORK/ref/store" --verifier "$WORK/ref/verifier" \
    --speculator-type dflash "${TRAIN_ARGS[@]}" --log-every 1 --save-every 0 --val-fraction 0 --device "$DEVICE" \
    --save-path "$WORK/train" > "$WORK/logs/train.json" 2> "$WORK/logs/train.log"
  log "train rc=$?"
  cp "$WORK/train/metrics.jsonl" "$WORK/logs/train-metrics.jsonl" 2>/dev/null
fi

# 4. hsgen serve on the device (bound 35 s)
if want serve; then
  log "4/5 hsgen serve --device $DEVICE smoke"
  timeout -k 5 35 bash scripts/gpu/serve_smoke.sh "$WORK/serve" "$DEVICE" > "$WORK/logs/serve.json" \
    2> "$WORK/logs/serve.log"
  log "serve smoke rc=$?: $(tail -c 300 "$WORK/logs/serve.json")"
fi

# 5. the data path on the GPU host (issue 14: the online ceiling per training process must exceed
#    1.8 GB/s there), at most 2 minutes of the time the bounds above left unused; not at the tiny shape
left=$(( 560 - ($(date +%s) - T0) ))
if ! want data; then
  :
elif [ "$TINY" = 1 ]; then
  log "5/5 data path skipped at the tiny shape"
elif [ "$left" -lt 60 ]; then
  log "5/5 data path skipped: ${left}s left"
else
  log "5/5 bench_loader.py and bench_online.py --mode realistic, --threads 4 (${left}s left)"
  timeout -k 5 $(( left / 4 < 40 ? left / 4 : 40 )) "$PY" scripts/bench_loader.py --quick --threads 4 \
    > "$WORK/logs/loader.json" 2> "$WORK/logs/loader.log"
  log "bench_loader rc=$?: $(tail -c 300 "$WORK/logs/loader.json")"
  left=$(( 560 - ($(date +%s) - T0) ))
  left=$(( left > 85 ? 80 : left - 5 ))
  timeout -k 5 $(( left > 5 ? left : 5 )) "$PY" scripts/bench_online.py --quick --mode realistic --threads 4 \
    > "$WORK/logs/online.json" 2> "$WORK/logs/online.log"
  log "bench_online rc=$?: $(tail -c 300 "$WORK/logs/online.json")"
fi
