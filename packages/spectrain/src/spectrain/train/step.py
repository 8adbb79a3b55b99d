"""One optimizer step that never waits for the device, and the checks the host reads later.

:func:`train_step` runs forward and backward over a step's packed sequences, clips the
gradients, decides on the device whether the step is finite and applies the update only if it
is (:meth:`spectrain.train.optim.Optimizers.step` with ``skip``). Everything it returns stays on the
device: the loss, the gradient norm, the ``applied`` flag, the metric sums and the FLOP count.
Nothing in it reads a device value on the host, so the host runs ahead and queues the next
step while the device computes (``python scripts/bench_train.py --sync-census`` lists what
would synchronise; the tests assert nothing does).

:class:`StepChecks` keeps each step's flags and reads them all at once when the trainer asks
(at log intervals, before a checkpoint, at the end): skipped steps are then logged with their
samples and counted, and too many in a row raise :class:`NonFiniteTraining`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from spectrain.data.batch import Batch

log = logging.getLogger(__name__)


class NonFiniteTraining(ValueError):
    """The loss or the gradients stayed NaN/inf for ``max_nonfinite_steps`` steps in a row."""


@dataclasses.dataclass
class StepResult:
    """What one step leaves on the device (read it only when a value is needed)."""

    loss: torch.Tensor
    """Mean loss over the step's sequences (0-d)."""
    grad_norm: torch.Tensor
    """Global gradient norm before clipping (0-d)."""
    applied: torch.Tensor
    """0-d bool: loss and gradient norm were finite (on every rank), so the update was applied."""
    sums: dict[str, torch.Tensor]
    """Metric sums of the step's sequences (float64)."""
    flops: torch.Tensor
    """Matmul FLOPs of forward, backward and the optimizer (float64, 0-d)."""
    vocab_over: torch.Tensor | None = None
    """0-d bool: a token id was beyond the vocabulary (only when ``vocab_size`` was given)."""


def add_sums(
    into: dict[str, torch.Tensor], metrics: dict[str, torch.Tensor], keep: torch.Tensor | None = None
) -> None:
    """``into[k] += metrics[k]`` in float64 on the device; ``keep`` (0-d bool) false adds zeros."""
    for k, v in metrics.items():
        v = v.detach().double()
        if keep is not None:
            v = torch.where(keep, v, torch.zeros_like(v))
        into[k] = into[k] + v if k in into else v.clone()


def train_step(
    module: torch.nn.Module,
    wrapped: torch.nn.Module,
    optimizer,
    batches: Sequence[Batch],
    generators: Sequence[torch.Generator | None],
    *,
    autocast: Callable[[], contextlib.AbstractContextManager],
    max_grad_norm: float,
    device: torch.device,
    distributed: bool = False,
    vocab_size: int | None = None,
) -> StepResult:
    """Forward and backward over ``batches`` (gradients averaged), clipping, the update.

    Args:
        module: the draft (its ``last_flops`` is read after each forward).
        wrapped: what is called: the draft, or its DDP/FSDP wrapper.
        optimizer: :class:`spectrain.train.optim.Optimizers`.
        batches: the step's packed sequences (moved to ``device`` when they are not there).
        generators: one per batch, for the draft's random draws (on ``device``).
        autocast: a factory of the precision context of forward passes.
        max_grad_norm: clip to this global norm (0: no clipping, the norm is still computed).
        device: where the draft lives.
        distributed: agree on ``applied`` across ranks (one all-reduce on the device).
        vocab_size: when given, token ids at or beyond it are clamped (the embedding never sees
            them) and flagged in ``vocab_over``: the caller reads the flag later and refuses the
            batch (a batch on the host is better checked before it is sent).
    """
    wrapped.train()
    n = len(batches)
    total = torch.zeros((), dtype=torch.float32, device=device)
    flops = torch.zeros((), dtype=torch.float64, device=device)
    over = torch.zeros((), dtype=torch.bool, device=device) if vocab_size is not None else None
    sums: dict[str, torch.Tensor] = {}
    for i, b in enumerate(batches):
        b = b.to(device, non_blocking=True)
        if vocab_size is not None:
            over = over | (b.input_ids >= vocab_size).any()
            b = dataclasses.replace(b, input_ids=b.input_ids.clamp(max=vocab_size - 1))
        last = i == n - 1
        no_sync = getattr(wrapped, "no_sync", None)
        ctx = no_sync() if (not last and no_sync is not None) else contextlib.nullcontext()
        with ctx:
            with autocast():
                loss, metrics = wrapped(b, generators[i])
            (loss / n).backward()
        total = total + loss.detach().float()
        add_sums(sums, metrics)
        flops = flops + module.last_flops
    params = [p for p in wrapped.parameters() if p.requires_grad]
    if max_grad_norm > 0:
        grad_norm = torch.nn.utils.clip_grad_norm_(params, max_grad_norm)
    else:
        grad_norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
    grad_norm = _local(grad_norm).detach()
    applied = torch.isfinite(total) & torch.isfinite(grad_norm)
    if distributed:  # every rank skips the same steps
        flag = applied.to(torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        applied = flag.bool()
    optimizer.step(skip=~applied)
    optimizer.zero_grad()
    flops = flops + optimizer.flops_per_step
    return StepResult(total / n, grad_norm, applied, sums, flops, over)


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's full value (FSDP's gradient norm), else ``t``."""
    full = getattr(t, "full_tensor", None)
    return full() if callable(full) else t


@dataclasses.dataclass
class _Pending:
    step: int
    loss: torch.Tensor
    grad_norm: torch.Tensor
    applied: torch.Tensor
    vocab_over: torch.Tensor | None
    sample_ids: list[str]


class StepChecks:
    """The steps' device flags, read in one transfer by :meth:`check`.

    Args:
        max_nonfinite_steps: this many skipped steps in a row raise :class:`NonFiniteTraining`.
        vocab_error: builds the error for samples whose token ids were beyond the vocabulary.
    """

    def __init__(self, max_nonfinite_steps: int, vocab_error: Callable[[list[str]], Exception] | None = None):
        self.limit = max_nonfinite_steps
        self.vocab_error = vocab_error
        self.pending: list[_Pending] = []
        self.skipped = 0
        self.streak = 0
        self._last_loss: torch.Tensor | None = None

    def record(self, step: int, result: StepResult, sample_ids: list[str]) -> None:
        """Keep step ``step``'s flags (no sync)."""
        self.pending.append(_Pending(step, result.loss, result.grad_norm, result.applied, result.vocab_over,
                                     list(sample_ids)))  # fmt: skip
        nan = torch.full_like(result.loss, float("nan"))
        prev = self._last_loss if self._last_loss is not None else nan
        self._last_loss = torch.where(result.applied, result.loss, prev)

    def check(self) -> None:
        """Read the pending flags (one sync): log and count skipped steps, raise on a bad vocabulary
        or when ``max_nonfinite_steps`` were skipped in a row."""
        if not self.pending:
            return
        pending, self.pending = self.pending, []
        cols = [torch.stack([p.applied.float() for p in pending]), torch.stack([p.loss.float() for p in pending]),
                torch.stack([p.grad_norm.float() for p in pending])]  # fmt: skip
        if pending[0].vocab_over is not None:
            cols.append(torch.stack([p.vocab_over.float() for p in pending]))
        values = torch.stack(cols).cpu().tolist()
        if len(values) > 3 and self.vocab_error is not None:
            bad = [sid for p, over in zip(pending, values[3], strict=True) if over for sid in p.sample_ids]
            if bad:
                raise self.vocab_error(bad)
        for p, ok, loss, norm in zip(pending, *values[:3], strict=True):
            if ok:
                self.streak = 0
                continue
            self.skipped += 1
            self.streak += 1
            ids = p.sample_ids
            shown = ", ".join(repr(i) for i in ids[:4]) + (
                f" and {len(ids) - 4} more" if len(ids) > 4 else ""
            )
            log.warning("step %d: loss %s, gradient norm %s: not finite, the step is skipped (samples %s; %d "
                        "skipped so far)", p.step, loss, norm, shown, self.skipped)  # fmt: skip
            if self.streak >= self.limit:
                raise NonFiniteTraining(
                    f"the loss or gradients were NaN/inf for {self.limit} steps in a row (up to step {p.step}, "
                    f"last samples {shown}): nothing of them was applied or saved; check the store with "
                    "hsgen verify, or lower --lr (--max-nonfinite-steps sets the limit)"
                )

    def last_loss(self) -> float | None:
        """The loss of the last applied step (None when none was); reads the device."""
        if self._last_loss is None:
            return None
        value = float(self._last_loss)
        return None if value != value else value


def step_generator(
    seed: int, step: int, rank: int, micro: int, device: torch.device | str = "cpu"
) -> torch.Generator:
    """The RNG of one micro-step (anchors) on ``device``: a pure function of the step, so resume
    repeats it (seeding a CUDA generator sets host-side state only: no sync)."""
    g = torch.Generator(device=device)
    g.manual_seed((seed * 1_000_003 + step * 9_176 + rank * 131 + micro) % (2**63))
    return g
