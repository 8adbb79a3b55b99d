"""Fake CUDA tensors on a CPU-only build of torch: the device checks of a GPU run without a GPU.

Under :func:`fake_cuda` tensors created on ``"cuda"`` are :class:`FakeTensorMode` tensors with
a CUDA device (shapes, dtypes, devices; no data), so an operation mixing a host tensor with a
device tensor raises as it would on a GPU (``FakeTensorDeviceMismatchError``), while the host
tensors stay fake CPU tensors. Three things a CPU build of torch cannot do even on fake tensors
are stood in for: copies from the host to the device (``.to("cuda")``, ``.cuda()``, a
cross-device ``copy_``) make an empty device tensor of the same shape, and random fills and
draws on the device (``normal_``, ``rand`` ...) return an uninitialised tensor (CUDA random
generators need the CUDA library). Values are never read, so nothing else changes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten

_RANDOM_FILLS = {aten.uniform_.default, aten.normal_.default, aten.bernoulli_.float, aten.exponential_.default,
                 aten.random_.default}  # fmt: skip
_RANDOM_DRAWS = {aten.rand.default, aten.rand.generator, aten.randn.default, aten.randn.generator,
                 aten.randint.default, aten.randint.low, aten.randperm.default}  # fmt: skip


def _is_cuda(device) -> bool:
    return device is not None and torch.device(device).type == "cuda"


class _HostToDevice(TorchFunctionMode):
    """What a CPU build refuses on CUDA tensors before the fake tensor mode sees it (it sets a CUDA
    device guard first): copies to CUDA (an empty device tensor, or a dtype cast when already
    there), ``torch.tensor(..., device="cuda")``, and indexing (rewritten as the aten ops)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (torch.Tensor.to, torch.Tensor.cuda) and args and isinstance(args[0], torch.Tensor):
            x = args[0]
            rest = [*args[1:], kwargs.get("device")]
            device = "cuda" if func is torch.Tensor.cuda else next(
                (a for a in rest if isinstance(a, str | torch.device)), None)  # fmt: skip
            if _is_cuda(device):
                dtype = next(
                    (a for a in args[1:] if isinstance(a, torch.dtype)), kwargs.get("dtype") or x.dtype
                )
                if x.device.type == "cuda":
                    return x if dtype == x.dtype else x.to(dtype)
                return torch.empty(x.shape, dtype=dtype, device="cuda")
        if func in (torch.tensor, torch.as_tensor) and _is_cuda(kwargs.get("device")):
            host = func(*args, **{**kwargs, "device": "cpu"})
            return torch.empty(host.shape, dtype=host.dtype, device="cuda")
        if func in _GUARDED and isinstance(args[0], torch.Tensor) and args[0].device.type == "cuda":
            return _GUARDED[func](*args, **kwargs)
        if func is torch.Tensor.__getitem__ and args[0].device.type == "cuda":
            return _getitem(*args)
        if func is torch.Tensor.__setitem__ and args[0].device.type == "cuda":
            x, index, value = args
            if not isinstance(value, torch.Tensor):
                value = torch.full((), value, dtype=x.dtype, device="cuda")
            view, advanced = _basic(x, index)
            if advanced is None:
                aten.copy_.default(view, value.expand_as(view))
            else:
                aten.index_put_(view, advanced, value.to(x.dtype))
            return None
        return func(*args, **kwargs)


_GUARDED = {torch.Tensor.__invert__: aten.bitwise_not.default, torch.Tensor.copy_: aten.copy_.default}
"""Tensor methods whose Python binding sets a device guard, and the aten op to call instead."""


def _basic(x: torch.Tensor, index) -> tuple[torch.Tensor, list | None]:
    """``x`` after the basic part of ``index`` (ints, slices, None, ...) and the advanced part
    (a list for ``aten.index``, None where there is none)."""
    index = index if isinstance(index, tuple) else (index,)

    def width(i) -> int:  # dimensions of x an index entry consumes
        return i.dim() if isinstance(i, torch.Tensor) and i.dtype == torch.bool else 1

    used = sum(width(i) for i in index if i is not None and i is not Ellipsis)
    dim, consumed, advanced = 0, 0, []
    for i in index:
        if i is not None and i is not Ellipsis:
            consumed += width(i)
        if i is Ellipsis:
            skip = max(0, x.dim() - dim - (used - consumed))
            advanced.extend([None] * skip)
            dim += skip
        elif i is None:
            x = x.unsqueeze(dim)
            advanced.append(None)
            dim += 1
        elif isinstance(i, int):
            x = x.select(dim, i)
        elif isinstance(i, slice):
            x = aten.slice.Tensor(x, dim, i.start, i.stop, i.step or 1)
            advanced.append(None)
            dim += 1
        else:
            advanced.append(i if isinstance(i, torch.Tensor) else torch.tensor(i, device="cuda"))
            dim += width(i)
    if all(a is None for a in advanced):
        return x, None
    while advanced and advanced[-1] is None:
        advanced.pop()
    return x, advanced


def _getitem(x: torch.Tensor, index) -> torch.Tensor:
    view, advanced = _basic(x, index)
    return view if advanced is None else aten.index.Tensor(view, advanced)


class _DeviceStandIns(TorchDispatchMode):
    """Random ops on fake CUDA tensors and cross-device ``copy_`` (values are never read)."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _RANDOM_FILLS:
            return args[0]
        if func in _RANDOM_DRAWS:
            if func is aten.randperm.default:
                size, dtype = [args[0]], kwargs.get("dtype") or torch.int64
            elif func in (aten.randint.default, aten.randint.low):
                size, dtype = args[-1], kwargs.get("dtype") or torch.int64
            else:
                size, dtype = args[0], kwargs.get("dtype")
            return torch.empty(size, dtype=dtype, device=kwargs.get("device"))
        if func is aten.copy_.default and args[0].device != args[1].device:
            return args[0]
        return func(*args, **kwargs)


@contextlib.contextmanager
def fake_cuda() -> Iterator[FakeTensorMode]:
    """Fake tensors, with ``cuda`` the default device (host tensors need ``device="cpu"``)."""
    with FakeTensorMode() as mode, _HostToDevice(), _DeviceStandIns(), torch.device("cuda"):
        yield mode
