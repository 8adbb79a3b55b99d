"""Where a training step would make the host wait for the GPU, found on any device.

On CUDA, :func:`census` runs the step under ``torch.cuda.set_sync_debug_mode("warn")`` and
counts the warnings by source line. Elsewhere it runs the step under :class:`SyncOps`, a
dispatch mode that records the operations that synchronise on CUDA: reading a value on the host
(``.item()``, ``float()``, ``int()``, ``bool()``, ``.tolist()``), and the operations whose output
size depends on the data (``nonzero``, boolean-mask indexing, ``masked_select``, ``unique``,
``repeat_interleave`` without an output size).
"""

from __future__ import annotations

import traceback
import warnings
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

_DATA_SIZED = {
    aten.nonzero.default, aten.masked_select.default, aten._unique2.default, aten.unique_dim.default,
    aten.unique_consecutive.default, aten.repeat_interleave.Tensor,
}  # fmt: skip


def _bool_index(func, args) -> bool:
    if func not in (aten.index.Tensor, aten.index_put_.default, aten.index_put.default):
        return False
    return any(i is not None and i.dtype == torch.bool for i in args[1])


class SyncOps(TorchDispatchMode):
    """Records ``(operation, first project frame)`` of every operation that syncs on CUDA."""

    def __init__(self, roots: tuple[str, ...] = ("spectrain", "hsgen", "bench_")):
        super().__init__()
        self.roots = roots
        self.hits: Counter[str] = Counter()

    def _where(self) -> str:
        for frame in reversed(traceback.extract_stack()[:-2]):
            if any(r in frame.filename for r in self.roots) and "sync_census" not in frame.filename:
                return f"{Path(frame.filename).name}:{frame.lineno} {frame.line}"
        return "?"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is aten._local_scalar_dense.default:
            self.hits[f"item  {self._where()}"] += 1
        elif func in _DATA_SIZED:
            self.hits[f"{func.__name__.split('.')[0]}  {self._where()}"] += 1
        elif _bool_index(func, args):
            self.hits[f"bool-index  {self._where()}"] += 1
        return func(*args, **(kwargs or {}))


def census(step: Callable[[], object], device: torch.device) -> dict[str, int]:
    """``{"<kind> <file>:<line> <code>": count}`` of the syncs ``step`` makes (see module docstring)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                step()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        return dict(Counter(f"sync  {Path(w.filename).name}:{w.lineno}" for w in caught
                            if "synchroniz" in str(w.message)))  # fmt: skip
    mode = SyncOps()
    with mode:
        step()
    return dict(mode.hits)
