#!/usr/bin/env bash
# The multi-process part of the GPU run (issue 30): `spectrain train` under torchrun RUNS times in a row
# (default 3) on the store the serve part wrote, each run's exit code and checkpoint recorded. NCCL across
# the GPUs when there are two or more; on one GPU (NCCL refuses two ranks on one device) or none, two gloo
# ranks on the host. Prints one JSON line; exits 1 when any run exited non-zero, aborted or left no
# complete checkpoint.
#   bash scripts/gpu/multi_rank.sh STORE VERIFIER WORKDIR [DEVICE]      (DEVICE default cuda)
set -u
STORE=$1 VERIFIER=$2 WORK=$3 DEVICE=${4:-cuda}
PY=${PYTHON:-python3}
RUNS=${RUNS:-3}
mkdir -p "$WORK"
NGPU=0
[ "$DEVICE" = cuda ] && NGPU=$("$PY" -c 'import torch; print(torch.cuda.device_count())' 2>/dev/null || echo 0)
if (( NGPU >= 2 )); then NPROC=$NGPU DEV=cuda BACKEND=nccl; else NPROC=2 DEV=cpu BACKEND=gloo; fi
for i in $(seq 1 "$RUNS"); do
  OMP_NUM_THREADS=1 "$PY" -m torch.distributed.run --standalone --nproc_per_node "$NPROC" -m spectrain.cli train \
    --store "$STORE" --verifier "$VERIFIER" --save-path "$WORK/run-$i" --device "$DEV" --total-seq-len 96 \
    --block-size 4 --max-anchors 16 --num-layers 1 --max-steps 2 --val-fraction 0 --log-every 1 \
    > "$WORK/run-$i.out" 2> "$WORK/run-$i.log"
  echo $? > "$WORK/run-$i.rc"
done
"$PY" - "$WORK" "$RUNS" "$BACKEND" "$NPROC" <<'PY'
import json, sys
from pathlib import Path
work, runs, backend, nproc = Path(sys.argv[1]), int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
codes, complete, aborted = [], [], []
for i in range(1, runs + 1):
    codes.append(int((work / f"run-{i}.rc").read_text()))
    err = (work / f"run-{i}.log").read_text(errors="replace")
    aborted.append(any(m in err for m in ("terminate called", "SIGABRT", "exitcode: -6", "Fatal Python error")))
    save = work / f"run-{i}"
    latest = save / "latest"
    ckpt = save / latest.read_text().strip() if latest.is_file() else None
    complete.append(ckpt is not None and all((ckpt / p).is_file() for p in ("config.json", "model.safetensors",
                                                                         "trainer/state.pt")))
ok = all(c == 0 for c in codes) and all(complete) and not any(aborted)
print(json.dumps({"multi_backend": backend, "multi_ranks": nproc, "multi_exit_codes": codes,
                  "multi_complete_checkpoints": complete, "multi_aborted": aborted, "multi_ok": ok}))
sys.exit(0 if ok else 1)
PY
