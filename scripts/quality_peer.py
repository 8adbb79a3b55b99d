"""The peer in the quality benchmark: speculators 0.9.0's own trainer on the benchmark's samples.

``train_peer()`` writes the benchmark's store in the layout speculators' trainer reads (its
``prepare-data`` dataset directory: ``input_ids``, ``loss_mask``, ``seq_len`` per row, and
``hidden_states/hs_<row>.safetensors`` as its ``generate-offline-data`` leaves them: vLLM's
``hidden_states [T, layers, H]``, the draft's input layers then the verifier's last, and
``token_ids``), copied from the store's arrays without a conversion, so both trainers read the same
bits. Rows are in sample-id order (as our trainer reads them); our training samples come first and
our validation samples last, so speculators' own split
(the last rows, ``--train-data-ratio``) trains on exactly ours. Then it runs speculators' trainer as
its CLI does (``speculators train`` = ``TrainConfig.resolve`` + ``speculators.train.cli.main``) in
a process of its own, at the benchmark's shapes (epochs, packed sequence length, layers, block (DSpark's
one slot shorter than DFlash's, as ours: its DSpark samples from the anchor, so both propose K tokens),
anchors, TTT steps, input layers, learning rate) and its own defaults otherwise (Muon, linear
schedule with 1% warmup, seed 42, loss, norms, sliding window ...). Its final checkpoint (the last
epoch's, as ours is our last step's) is what the benchmark evaluates.

On a CPU it cannot run as it is; :data:`CPU_CHANGES` names every change, flags of its own CLI first.
Its training compute is counted the way ours is not (no count of its own): matmul FLOPs of every
training step (forward, backward, optimizer) by ``torch.utils.flop_counter``, written with its step
count to ``<save>/peer_compute.json``. torch's counter has no formula for the CPU attention kernel
(``_scaled_dot_product_flash_attention_for_cpu``: it counted 0, so the first peer figures left
attention out); :func:`attention_formulas` counts it as ours is counted, over the pairs the mask allows
(``train_flops``), and dense as the CPU kernel computes it (``train_flops_dense_attention``).
Run as a script, this file is that launcher.
"""

from __future__ import annotations

import json
import logging
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

log = logging.getLogger("bench_quality")

PEER_ALGORITHMS = ("dflash", "dspark", "eagle3")
"""The algorithms trained by the peer's trainer beside ours (``--peer``)."""

CPU_CHANGES = {
    "--draft-attn-impl sdpa": "its default FlexAttention has no backward on a CPU (torch refuses); its CLI offers "
    "sdpa 'for hardware that doesn't support flex attention', with the same masks as dense tensors",
    "--loss-implementation eager": "its default fused losses are Triton kernels (GPU only); eager is the same "
    "loss, its own reference implementation",
    "--hidden-states-dtype float32": "the store's dtype (the benchmark's states are float32 on a CPU, where ours "
    "trains in fp32 too); its default bf16 autocast is for GPUs",
    "--num-workers 0": "data loading in the training process, as ours (its default 12 workers on 2 cores)",
    "patch: device": "its Trainer moves the model and batches to local rank 0, i.e. cuda:0; here to the CPU",
    "patch: autocast": "its Trainer autocasts on 'cuda' when no accelerator exists; here on the CPU (a no-op in fp32)",
    "patch: synchronize": "its step timer calls torch.accelerator.synchronize(), which raises without one; a no-op "
    "on a CPU, where every op is synchronous",
}
"""What differs from ``speculators train`` on a GPU, and why (none of it is applied on CUDA)."""


def cpu_seconds() -> float:
    """User + system CPU seconds of this process and its finished children so far."""
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime


# --------------------------------------------------------------------------- data


def write_peer_data(store_path: Path, layer_ids: list[int], out: Path, val_fraction: float) -> dict:
    """Write the store's samples under ``out`` as speculators' trainer reads them, with
    ``layer_ids`` (the draft's input layers, then the verifier's last) as the hidden states.
    Returns ``train_data_ratio`` (the flag that makes its split ours), the row counts and each
    row's sample id."""
    import datasets
    import numpy as np
    import torch
    from safetensors.torch import save_file

    from hsgen.store import HiddenStateStore
    from spectrain.data.sources import split_of

    store = HiddenStateStore.open(store_path)
    ids = sorted(
        store.sample_ids()
    )  # as our trainer orders them; the store's order is the writers' finishing order
    train = [i for i in ids if split_of(i, val_fraction) == "train"]
    val = [i for i in ids if split_of(i, val_fraction) != "train"]
    # speculators needs one validation row; with none of ours, it validates on a copy of a trained row
    order = train + (val or train[-1:])
    stored = list(store.header.layer_ids)
    missing = sorted(set(layer_ids) - set(stored))
    if missing:
        raise SystemExit(f"{store_path}: the store holds layers {stored}, not {missing}")
    columns = [stored.index(i) for i in layer_ids]
    hs_dir = out / "hidden_states"
    hs_dir.mkdir(parents=True, exist_ok=True)
    rows: dict[str, list] = {"input_ids": [], "loss_mask": [], "seq_len": []}
    for row, sid in enumerate(order):
        sample = store.read(sid)
        if store.header.dtype == "bfloat16":
            hs = torch.from_numpy(np.ascontiguousarray(sample.hidden_states[:, columns])).view(torch.bfloat16)
        else:
            hs = torch.from_numpy(np.ascontiguousarray(sample.hidden_states[:, columns]))
        tokens = torch.from_numpy(sample.token_ids.astype(np.int64))
        save_file({"hidden_states": hs, "token_ids": tokens}, str(hs_dir / f"hs_{row}.safetensors"))
        rows["input_ids"].append(tokens.tolist())
        rows["loss_mask"].append(sample.loss_mask.astype(np.int64).tolist())
        rows["seq_len"].append(len(tokens))
    ds = datasets.Dataset.from_dict(rows)
    ds.set_format(type="torch")
    ds.save_to_disk(str(out))
    return {"train_data_ratio": (len(train) + 0.5) / len(order), "train_rows": len(train),
            "val_rows": len(order) - len(train), "row_ids": order, "dtype": store.header.dtype}  # fmt: skip


# --------------------------------------------------------------------------- training


def peer_flags(algorithm: str, size, target: Path, data: Path, save: Path, aux: list[int], lr: float,
               ratio: float, dtype: str, device: str) -> list[str]:  # fmt: skip
    """The ``speculators train`` command line for one draft at the benchmark's shapes."""
    flags = [
        "--verifier-name-or-path", str(target), "--data-path", str(data), "--speculator-type", algorithm,
        "--save-path", str(save), "--log-dir", str(save / "logs"), "--epochs", str(size.draft_epochs),
        "--total-seq-len", str(size.draft_seq_len), "--lr", repr(lr), "--train-data-ratio", repr(ratio),
        "--target-layer-ids", *map(str, aux), "--on-missing", "raise",
    ]  # fmt: skip
    if algorithm in ("dflash", "dspark"):  # its DSpark is anchor-first: one slot fewer, the same K as DFlash
        block = size.dflash_block_size - (algorithm == "dspark")
        flags += ["--num-layers", str(size.dflash_layers), "--block-size", str(block),
                  "--max-anchors", str(size.dflash_max_anchors)]  # fmt: skip
    else:
        flags += ["--ttt-steps", str(size.eagle3_ttt_steps)]
    if not device.startswith("cuda"):
        flags += ["--draft-attn-impl", "sdpa", "--loss-implementation", "eager", "--hidden-states-dtype", dtype,
                  "--num-workers", "0"]  # fmt: skip
    elif dtype != "bfloat16":
        flags += ["--hidden-states-dtype", dtype]
    return flags


def train_peer(algorithm: str, size, target: Path, store: Path, aux: list[int], work: Path, device: str,
               lr: float, val_fraction: float, tag: str = "", keep_data: bool = False) -> tuple[Path, dict]:  # fmt: skip
    """Train one peer draft on ``store``; returns its final checkpoint directory and a summary
    (``step``, ``train_flops``, ``train_seconds``, ``cpu_seconds``, the command, the data split)."""
    suffix = f"{algorithm}-{tag}" if tag else algorithm
    data, save = work / f"peer-data-{algorithm}", work / f"peer-train-{suffix}"
    for d in (data, save):
        if d.exists():
            shutil.rmtree(d)
    t0 = time.perf_counter()
    facts = write_peer_data(store, [*aux, max(_store_layers(store))], data, val_fraction)
    log.info("peer data (%s): %d training + %d validation rows in %.0fs", algorithm, facts["train_rows"],
             facts["val_rows"], time.perf_counter() - t0)  # fmt: skip
    flags = peer_flags(
        algorithm, size, target, data, save, aux, lr, facts["train_data_ratio"], facts["dtype"], device
    )
    cmd = [sys.executable, str(Path(__file__).resolve()), *flags]
    log.info("speculators train (%s): %s", suffix, " ".join(cmd))
    t0, c0 = time.perf_counter(), cpu_seconds()
    proc = subprocess.run(cmd, cwd=work, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    seconds, cpu = time.perf_counter() - t0, cpu_seconds() - c0
    (work / f"peer-train-{suffix}.log").write_text(proc.stdout)
    if proc.returncode != 0:
        tail = "\n".join(proc.stdout.strip().splitlines()[-15:])
        raise SystemExit(f"speculators train ({suffix}) failed with exit status {proc.returncode} "
                         f"(log: {work / f'peer-train-{suffix}.log'}):\n{tail}")  # fmt: skip
    compute = json.loads((save / "peer_compute.json").read_text())
    final = save / str(size.draft_epochs - 1)
    if not compute.get("step") or not (final / "model.safetensors").is_file():
        raise SystemExit(
            f"speculators train ({suffix}) trained no step or left no final checkpoint in {final}"
        )
    if not keep_data:
        shutil.rmtree(data, ignore_errors=True)
    summary = {**compute, "train_seconds": round(seconds, 1), "cpu_seconds": round(cpu, 1), "lr": lr,
               "checkpoint": str(final), "command": ["speculators", "train", *flags],
               "train_rows": facts["train_rows"], "val_rows": facts["val_rows"]}  # fmt: skip
    return final, summary


def _store_layers(store: Path) -> list[int]:
    from hsgen.store import HiddenStateStore

    return list(HiddenStateStore.open(store).header.layer_ids)


# --------------------------------------------------------------------------- the launcher


def _patch_for_cpu() -> None:
    """The three ``patch:`` entries of :data:`CPU_CHANGES`."""
    import speculators.train.trainer as trainer
    import torch

    trainer.get_local_rank = lambda: "cpu"
    init = trainer.Trainer.__init__

    def cpu_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.device_type = "cpu"

    trainer.Trainer.__init__ = cpu_init
    torch.accelerator.synchronize = lambda device=None: None


COUNT_VERSION = 2
"""Bumped when the peer's count changes: a summary of another version is not reused (2: attention)."""


def attention_formulas(tally: dict[str, float]) -> dict:
    """``FlopCounterMode`` formulas for torch's CPU attention kernel, forward and backward: the FLOPs of
    the pairs the mask allows (``4 * heads * head_dim`` per pair forward, twice that backward, as
    torch counts attention and as ours counts its own), and in ``tally["dense"]`` / ``tally["allowed"]``
    the dense and allowed attention FLOPs seen so far. The backward's mask is the forward's."""
    import torch

    aten = torch.ops.aten

    def allowed(q, k, mask, is_causal) -> float:
        """The share of (query, key) pairs the call attends to (a broadcast mask has its own mean)."""
        if mask is not None:
            keep = (
                mask
                if mask.dtype == torch.bool
                else torch.isfinite(mask) & (mask > torch.finfo(mask.dtype).min)
            )
            return float(keep.float().mean())
        if is_causal:  # sdpa's causal mask is aligned top-left: query i sees keys 0..i
            return float(torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool).tril().float().mean())
        return 1.0

    def count(q, k, mask, is_causal, per_pair: float) -> int:
        dense = per_pair * q.shape[0] * q.shape[1] * q.shape[2] * k.shape[-2] * q.shape[-1]
        density = allowed(q, k, mask, is_causal)
        tally["dense"] += dense
        tally["allowed"] += dense * density
        return int(dense * density)

    def forward(q, k, v, dropout_p=0.0, is_causal=False, attn_mask=None, *args, out_val=None, **kwargs):
        return count(q, k, attn_mask, is_causal, 4.0)

    def backward(grad, q, k, v, out, lse, dropout_p=0.0, is_causal=False, attn_mask=None, *args, out_val=None,
                 **kwargs):  # fmt: skip
        return count(q, k, attn_mask, is_causal, 8.0)

    forward._get_raw = backward._get_raw = True  # type: ignore[attr-defined]
    return {aten._scaled_dot_product_flash_attention_for_cpu: forward,
            aten._scaled_dot_product_flash_attention_for_cpu_backward: backward}  # fmt: skip


def _count_training(save: Path) -> None:
    """Count the matmul FLOPs of every training epoch (not validation) and time the epochs; write
    the step count, FLOPs and mean step time (data loading included, as ours) to
    ``save/peer_compute.json`` when training ends."""
    import speculators.train.trainer as trainer
    from torch.utils.flop_counter import FlopCounterMode

    total, seconds = [0], [0.0]
    tally = {"dense": 0.0, "allowed": 0.0}
    formulas = attention_formulas(tally)
    train_epoch, run_training = trainer.Trainer.train_epoch, trainer.Trainer.run_training

    def counted_epoch(self, *args, **kwargs):
        counter = FlopCounterMode(display=False, custom_mapping=formulas)
        t0 = time.perf_counter()
        with counter:
            result = train_epoch(self, *args, **kwargs)
        seconds[0] += time.perf_counter() - t0
        total[0] += counter.get_total_flops()
        return result

    def counted_run(self, *args, **kwargs):
        result = run_training(self, *args, **kwargs)
        steps = self.global_step
        facts = {"step": steps, "train_flops": total[0], "attention_flops": tally["allowed"],
                 "train_flops_dense_attention": total[0] - tally["allowed"] + tally["dense"],
                 "step_time_s": round(seconds[0] / max(steps, 1), 4), "count_version": COUNT_VERSION}  # fmt: skip
        (save / "peer_compute.json").write_text(json.dumps(facts))
        return result

    trainer.Trainer.train_epoch, trainer.Trainer.run_training = counted_epoch, counted_run


def launch(argv: list[str]) -> None:
    """``speculators train ARGV`` in this process, with :data:`CPU_CHANGES`' patches where no
    accelerator exists, and its training counted (:func:`_count_training`)."""
    import torch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS") or 1))
    if not torch.accelerator.is_available():
        _patch_for_cpu()
    from speculators.train.cli import main
    from speculators.train.config import TrainConfig

    cfg = TrainConfig.resolve(argv)
    _count_training(Path(cfg.trainer.save_path))
    main(cfg)


if __name__ == "__main__":
    launch(sys.argv[1:])
