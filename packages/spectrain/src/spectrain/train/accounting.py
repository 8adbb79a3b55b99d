"""FLOPs and peak memory of a training step, counted without running it (no GPU needed).

The draft, its optimizer and the batch are built under :class:`~torch._subclasses.FakeTensorMode`
(tensors with shapes and dtypes but no data), then whole steps run through the real model code
with three of torch's tools watching:

- :class:`torch.utils.flop_counter.FlopCounterMode` counts every matmul of forward and backward;
- :class:`torch.distributed._tools.mem_tracker.MemTracker` follows every tensor storage from
  creation to release (parameters, gradients, optimizer state, activations, temporaries) and
  keeps the peak;
- :class:`WorstCaseShapes` answers the data-dependent operations fake tensors cannot, should a
  step hold any (the built-in drafts' training steps have none since their shapes were fixed):
  ``nonzero`` and boolean indexing keep every element (an upper bound), a scalar read is 1.

Attention is the one kernel replaced (:func:`attention_stand_in`): a CPU build of torch refuses
FlexAttention's backward, even on fake tensors, and neither tool above follows its higher-order
operator outside ``torch.compile``. The stand-in allocates what FlexAttention
returns and keeps for backward (output, logsumexp, and q, k, v) and counts the FLOPs of the pairs
the mask allows (``4 * heads * head_dim`` per pair forward, twice that backward, as
``torch.utils.flop_counter`` counts attention), with the mask's density measured on real index
tensors by :func:`measure_mask_density`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from spectrain.models import layers

aten = torch.ops.aten

GIB = 2**30


class WorstCaseShapes(TorchDispatchMode):
    """Data-dependent operations under fake tensors: keep everything, read scalars as 1.

    ``nonzero`` returns every index, a boolean mask indexes every row (both upper bounds on the
    real sizes), and ``.item()`` returns 1 (the optimizers' step counter; model code that
    branches on a value must not rely on it).
    """

    supports_higher_order_operators = True

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if isinstance(func, torch._ops.HigherOrderOperator):
            return NotImplemented
        if func is aten.nonzero.default:
            x = args[0]
            idx = torch.arange(x.numel(), device=x.device)
            return torch.stack(torch.unravel_index(idx, x.shape), dim=1) if x.dim() else idx.view(-1, 0)
        if func is aten._local_scalar_dense.default:
            return 1
        if func is aten.index.Tensor and any(i is not None and i.dtype == torch.bool for i in args[1]):
            index = []
            for i in args[1]:
                if i is not None and i.dtype == torch.bool:
                    full = torch.arange(i.numel(), device=i.device)
                    index.extend(torch.unravel_index(full, i.shape))
                else:
                    index.append(i)
            return func(args[0], index)
        return func(*args, **kwargs)


def mask_pairs(spec: layers.MaskSpec, rows: int = 512) -> int:
    """Query-key pairs ``spec`` allows, evaluated on real tensors ``rows`` queries at a time."""
    kv = torch.arange(spec.kv_len, device=spec.device)[None, :]
    zero = torch.zeros((), dtype=torch.long, device=spec.device)
    total = 0
    for s in range(0, spec.q_len, rows):
        q = torch.arange(s, min(spec.q_len, s + rows), device=spec.device)[:, None]
        total += int(spec.mask_mod(zero, zero, q, kv).expand(q.shape[0], spec.kv_len).sum())
    return total


class _StandIn(torch.autograd.Function):
    """Attention's memory behaviour without computing it (fake tensors)."""

    @staticmethod
    def forward(ctx, q, k, v, counter):
        out = torch.empty_like(q)
        lse = torch.empty(q.shape[:-1], dtype=torch.float32, device=q.device)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.counter = counter
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, _, _ = ctx.saved_tensors
        ctx.counter.backward_calls += 1
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), None


@dataclass
class AttentionCounter:
    """Attention calls seen by the stand-in: ``(q_len, kv_len) -> density`` in, FLOPs out."""

    density: dict[tuple[int, int], float] = field(default_factory=dict)
    calls: list[tuple[int, int, int, int]] = field(default_factory=list)  # heads, q_len, kv_len, head_dim
    backward_calls: int = 0
    measure: bool = False
    """True: evaluate each call's mask on real tensors and record its density (no FLOPs)."""

    def dense_flops(self) -> float:
        return float(sum(4 * h * q * k * d for h, q, k, d in self.calls)) * 3

    def flops(self) -> float:
        """Forward + backward FLOPs over the allowed pairs (dense where no density is known)."""
        return float(sum(4 * h * q * k * d * self.density.get((q, k), 1.0) for h, q, k, d in self.calls)) * 3

    def missing(self) -> list[tuple[int, int]]:
        return sorted({(q, k) for _, q, k, _ in self.calls if (q, k) not in self.density})


@contextlib.contextmanager
def attention_stand_in(counter: AttentionCounter) -> Iterator[AttentionCounter]:
    """Route the drafts' masked attention through the stand-in (see the module docstring)."""
    saved = layers.attend, layers.block_mask_for

    def attend(q, k, v, spec, backend, *, block_mask=None, dense_mask=None):
        if counter.measure:
            counter.density[(spec.q_len, spec.kv_len)] = mask_pairs(spec) / (spec.q_len * spec.kv_len)
            return torch.zeros_like(q)
        counter.calls.append((int(q.shape[0]), int(q.shape[1]), int(k.shape[1]), int(q.shape[2])))
        return _StandIn.apply(q, k, v, counter)

    layers.attend, layers.block_mask_for = attend, lambda spec: None
    try:
        yield counter
    finally:
        layers.attend, layers.block_mask_for = saved


@dataclass
class StepAccount:
    """What one training step costs, as counted by :func:`account_steps`."""

    flops: float
    """Forward + backward FLOPs of one step: matmuls plus attention over the allowed pairs."""
    matmul_flops: float
    attention_flops: float
    attention_flops_dense: float
    peak_bytes: int
    """Highest total of live tensor storage over the steps (weights and batch included)."""
    peak_breakdown: dict[str, int]
    """The peak by kind: Parameter, Gradient, Optstate, Activation, Temp, Other (batch, verifier)."""
    flops_by_op: dict[str, float]

    def summary(self) -> dict:
        return {
            "flops": self.flops,
            "attention_flops": self.attention_flops,
            "attention_flops_dense": self.attention_flops_dense,
            "peak_bytes": self.peak_bytes,
            "tflop_per_step": round(self.flops / 1e12, 2),
            "matmul_tflop": round(self.matmul_flops / 1e12, 2),
            "attention_tflop": round(self.attention_flops / 1e12, 2),
            "attention_tflop_dense": round(self.attention_flops_dense / 1e12, 2),
            "est_peak_gib": round(self.peak_bytes / GIB, 2),
            "peak_gib_by_kind": {k: round(v / GIB, 2) for k, v in self.peak_breakdown.items() if v},
        }


def account_steps(
    step: Callable[[], None],
    track: Sequence[object],
    density: dict[tuple[int, int], float],
    *,
    steps: int = 2,
) -> StepAccount:
    """Run ``step`` ``steps`` times on fake tensors; FLOPs of the last step, peak over all.

    Args:
        step: one training step (forward, backward, optimizer step, zero_grad).
        track: what exists before the steps (modules, optimizers, tensors such as the batch and
            the verifier's heads): counted in the memory from the start.
        density: allowed-pair fraction per attention shape ``(q_len, kv_len)``
            (:func:`measure_mask_density`).
        steps: >= 2, so the peak includes the optimizer state a first step creates.
    """
    from torch.distributed._tools.mem_tracker import MemTracker
    from torch.utils.flop_counter import FlopCounterMode

    tracker = MemTracker()
    tracker.track_external(*track)
    for obj in track:  # MemTracker would hook the gradient of frozen parameters too, which torch refuses
        if isinstance(obj, torch.nn.Module):
            for p in obj.parameters():
                if not p.requires_grad:
                    tracker._param_to_grad_hook_handles[p] = (_NoHook(), _NoHook())
    counter = AttentionCounter(density=dict(density))
    flop_counter = FlopCounterMode(display=False)
    with tracker, attention_stand_in(counter):
        for i in range(steps):
            last = i == steps - 1
            if last:
                counter.calls.clear()
            tracker.reset_mod_stats()  # per-module stats; the global peak is kept
            with flop_counter if last else contextlib.nullcontext(), WorstCaseShapes():
                step()
    if counter.missing():
        raise ValueError(f"no mask density measured for attention shapes {counter.missing()}")
    by_op = {str(op): float(n) for op, n in flop_counter.get_flop_counts().get("Global", {}).items()}
    matmul = float(flop_counter.get_total_flops())
    attn = counter.flops()
    (peak,) = tracker.get_tracker_snapshot("peak").values()
    breakdown = {_kind(k): int(v) for k, v in peak.items() if _kind(k) != "Total"}
    return StepAccount(flops=matmul + attn, matmul_flops=matmul, attention_flops=attn,
                       attention_flops_dense=counter.dense_flops(), peak_bytes=int(peak["Total"]),
                       peak_breakdown=breakdown, flops_by_op=by_op)  # fmt: skip


class _NoHook:
    def remove(self) -> None:
        pass


def _kind(key) -> str:
    return getattr(key, "value", str(key))


def measure_mask_density(forward: Callable[[], object]) -> dict[tuple[int, int], float]:
    """Run ``forward`` (real tensors, typically a tiny-width copy of the draft on the same batch
    layout) and return the allowed-pair fraction of every attention mask it builds."""
    counter = AttentionCounter(measure=True)
    with attention_stand_in(counter), torch.no_grad():
        forward()
    return counter.density


@contextlib.contextmanager
def fake_tensors() -> Iterator[torch._subclasses.fake_tensor.FakeTensorMode]:
    """A FakeTensorMode to build the draft, optimizer and batch in (and to run the steps under)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        yield mode
