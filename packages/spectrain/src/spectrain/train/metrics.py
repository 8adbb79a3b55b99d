"""Metrics: the JSONL log and trackers (:class:`MetricsLog`), the metric sums reduced across
ranks (:class:`MetricSums`), and the window of steps one log record covers (:class:`LogWindow`)."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from spectrain.train.distributed import DistInfo, collective_device, gather
from spectrain.train.step import StepResult, add_sums


class MetricsLog:
    """JSONL and the ``report_to`` trackers (:mod:`spectrain.train.trackers`), on rank 0."""

    def __init__(self, save_path: Path, enabled: bool, report_to: Sequence[str] = (),
                 config: dict[str, Any] | None = None):  # fmt: skip
        from spectrain.train.trackers import Trackers

        self.enabled = enabled
        self.path = save_path / "metrics.jsonl"
        self.trackers = Trackers(list(report_to) if enabled else [], save_path, config)

    def write(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        with self.path.open("a") as f:
            f.write(json.dumps(record) + "\n")
        self.trackers.log(record)

    def close(self) -> None:
        """Finish the trackers' runs (idempotent)."""
        trackers, self.trackers = self.trackers, None
        if trackers is not None:
            trackers.close()


class MetricSums:
    """Accumulates the metric sums models return (on the device, no sync); reduces across ranks.

    Ranks may hold different keys (a rank whose sequences had no anchors or no loss tokens, or
    one that added nothing): :meth:`summary` first agrees on the union of keys and their sizes,
    so every rank enters the same all-reduce with the same vector, zeros for what it lacks.
    """

    def __init__(self):
        self.sums: dict[str, torch.Tensor] = {}

    def add(self, metrics: dict[str, torch.Tensor], keep: torch.Tensor | None = None) -> None:
        """Add ``metrics`` (device tensors; ``keep`` a 0-d bool: false adds zeros, as for a skipped step)."""
        add_sums(self.sums, metrics, keep)

    def _schema(self, info: DistInfo) -> dict[str, tuple[int, ...]]:
        """Every rank's keys and shapes, merged (identical on all ranks)."""
        union: dict[str, tuple[int, ...]] = {}
        for rank, shapes in enumerate(gather({k: tuple(v.shape) for k, v in self.sums.items()}, info)):
            for k, shape in shapes.items():
                if union.setdefault(k, shape) != shape:
                    raise ValueError(
                        f"metric {k!r} has shape {shape} on rank {rank} but {union[k]} on another"
                    )
        return dict(sorted(union.items()))

    def summary(self, info: DistInfo) -> dict[str, Any]:
        """Loss, per-position accuracy and tau over all ranks (a collective when distributed)."""
        if info.enabled:
            shapes = self._schema(info)
            device = collective_device()
        else:
            shapes = {k: tuple(v.shape) for k, v in sorted(self.sums.items())}
            device = next(iter(self.sums.values())).device if self.sums else torch.device("cpu")
        if not shapes:
            return {}
        parts = [self.sums[k] if k in self.sums else torch.zeros(shape, dtype=torch.float64) for k, shape in
                 shapes.items()]  # fmt: skip
        flat = torch.cat([p.reshape(-1).to(device) for p in parts])
        if info.enabled:
            dist.all_reduce(flat)
        flat = flat.cpu()
        out, i = {}, 0
        vals = {}
        for k, shape in shapes.items():
            n = torch.Size(shape).numel()
            vals[k] = flat[i : i + n].reshape(shape)
            i += n
        if "acc_correct" in vals:
            tot = vals["acc_total"].clamp_min(1)
            out["acc"] = [round(float(x), 6) for x in (vals["acc_correct"] / tot)]
        if "chains" in vals:
            out["tau"] = round(1.0 + float(vals["accepted_sum"]) / max(1.0, float(vals["chains"])), 6)
        if "loss_sum" in vals:
            out["loss"] = float(vals["loss_sum"]) / max(1e-9, float(vals["weight_sum"]))
        for k in vals:  # an algorithm's own means: NAME_sum over NAME_total (DSpark's accept_rate, ...)
            name = k.removesuffix("_sum")
            if k != name and f"{name}_total" in vals and name not in out:
                out[name] = round(float(vals[k]) / max(1e-9, float(vals[f"{name}_total"])), 6)
        return out


class LogWindow:
    """The steps since the last log record: metric sums and FLOPs on the device, tokens, data
    waits and wall time on the host (validation and checkpoints excluded)."""

    def __init__(self):
        self.sums = MetricSums()
        self.flops: torch.Tensor | float = 0.0
        self.tokens = 0
        self.wait = 0.0
        self.steps = 0
        self.last: StepResult | None = None
        self._t0 = time.perf_counter()
        self._excluded = 0.0

    def add(self, result: StepResult, tokens: int, wait: float) -> None:
        self.sums.add(result.sums, keep=result.applied)  # a skipped step's metrics are not counted
        self.flops = result.flops + self.flops
        self.tokens += tokens
        self.wait += wait
        self.steps += 1
        self.last = result

    def exclude(self, seconds: float) -> None:
        """Leave ``seconds`` (a validation, a checkpoint) out of the window's time."""
        self._excluded += seconds

    def elapsed(self) -> float:
        return time.perf_counter() - self._t0 - self._excluded


def train_record(window: LogWindow, info: DistInfo, *, step: int, epoch: int, position: int, lr: float,
                 skipped: int, source: Any = None) -> dict[str, Any]:  # fmt: skip
    """The ``split: train`` log record of ``window`` (reads the device: the log-interval sync; a
    collective when distributed). ``source.stats()``, when the source has it, goes in ``data``."""
    summ = window.sums.summary(info)
    last = window.last
    grad_norm, loss, flops = torch.stack(
        [last.grad_norm.double(), last.loss.double(), torch.as_tensor(window.flops, dtype=torch.float64,
                                                                     device=last.loss.device)]
    ).tolist()  # fmt: skip
    elapsed = window.elapsed()  # after the reads: the device has done the window's work
    world_tokens = window.tokens * info.world_size
    rec = {
        "split": "train",
        "step": step,
        "epoch": epoch,
        "position": position,
        "loss": summ.get("loss", loss),
        "lr": lr,
        "grad_norm": grad_norm,
        "tokens_per_s": world_tokens / max(elapsed, 1e-9),
        "data_wait_s": window.wait / max(window.steps, 1),
        "step_time_s": elapsed / max(window.steps, 1),
        "data_wait_fraction": min(1.0, window.wait / max(elapsed, 1e-9)),
        "flops_per_s": flops / max(elapsed, 1e-9),
        "nonfinite_steps_skipped": skipped,
    }
    stats = getattr(source, "stats", None)
    if callable(stats):
        rec["data"] = stats()
    rec.update((k, v) for k, v in summ.items() if k != "loss")  # acc, tau and an algorithm's own means
    return rec
