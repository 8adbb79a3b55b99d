"""Distributed set-up under torchrun: the process group, the host-side control group, the
collectives the loop decides with, the DDP / FSDP2 wrapping of the draft, and the teardown."""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NoReturn

import torch
import torch.distributed as dist

if TYPE_CHECKING:
    from spectrain.models.registry import DraftModel
    from spectrain.train.config import TrainConfig

log = logging.getLogger(__name__)


@dataclass
class DistInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    control: Any = None
    """The process group of host-side decisions (gloo; None: the default group is gloo already)."""
    owns_default: bool = False
    """Whether :func:`init_distributed` created the default group (then :func:`teardown_distributed`
    destroys it; a group the caller made is the caller's)."""

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(device: torch.device) -> DistInfo:
    """Join the torchrun process group (``WORLD_SIZE`` > 1): nccl on CUDA, gloo on CPU."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return DistInfo()
    owns = not dist.is_initialized()
    if owns:
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    # per-step decisions (out of data? a stop signal?) go over gloo on host tensors: an NCCL
    # collective read back with .tolist() would wait for every queued kernel each step
    control = dist.new_group(backend="gloo") if dist.get_backend() != "gloo" else None
    return DistInfo(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", "0")), control,
                    owns_default=owns)  # fmt: skip


def teardown_distributed(info: DistInfo, *, clean: bool) -> None:
    """Undo :func:`init_distributed` on this rank: the control group, then the default group if it
    made it; idempotent, a no-op on one process.

    ``clean`` (every rank ended the same way: finished, out of data, stopped by a signal): a
    barrier first, so no rank closes its connections while a peer still reads from them. After
    an error no barrier (a peer may be gone or stuck elsewhere): the groups are destroyed at once.

    Destroying a group joins its gloo worker threads when nothing else holds the group; DDP does
    hold it, so a distributed command also ends with :func:`exit_process` (which says why).
    """
    if not info.enabled or not (dist.is_available() and dist.is_initialized()):
        return
    try:
        if clean:
            dist.barrier(group=info.control)
    except Exception as e:  # a peer that is gone: tear down regardless, the exit code tells
        log.warning("rank %d: the closing barrier failed (%s); tearing down regardless", info.rank, e)
    finally:
        if info.control is not None:
            dist.destroy_process_group(info.control)
            info.control = None
        if info.owns_default and dist.is_initialized():
            dist.destroy_process_group()
        info.owns_default = False


def exit_process(code: int) -> NoReturn:
    """End this rank with ``code``: exit handlers run and output is flushed, then the process exits
    without the interpreter's finalization.

    Under DDP the process group outlives :func:`teardown_distributed`: DDP's reducer keeps it, and
    torch 2.13 has no call that joins gloo's worker threads (``destroy_process_group``, the
    backend's ``shutdown`` and ``abort`` leave them running; measured). A worker thread that frees a
    collective's tensors while the interpreter finalizes aborts the rank (SIGABRT). Everything that
    must outlive the run is closed before this (checkpoints synced, trackers finished, loader threads
    joined), so skipping finalization loses nothing and the exit status is exactly ``code``.
    """
    try:
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):  # a closed pipe: nothing more can be said
                stream.flush()
        os._exit(code)


def resolve_device(cfg: TrainConfig) -> torch.device:
    if cfg.device == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        return torch.device("cpu")
    if cfg.device == "cuda":
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device(cfg.device)


def gather(obj: Any, info: DistInfo) -> list[Any]:
    """``obj`` of every rank, in rank order (``[obj]`` on one process), over the gloo control
    group: an object collective over NCCL pickles into CUDA tensors and reads them back (a copy
    each way and a sync on the queued work)."""
    if not info.enabled:
        return [obj]
    out: list[Any] = [None] * info.world_size
    dist.all_gather_object(out, obj, group=info.control)
    return out


def all_min(value: int, info: DistInfo) -> int:
    """The minimum of ``value`` over ranks (a host-side collective)."""
    return all_min_each([value], info)[0]


def all_min_each(values: list[int], info: DistInfo) -> list[int]:
    """Element-wise minimum over ranks, in one host-side collective (no device sync)."""
    if not info.enabled:
        return list(values)
    t = torch.tensor(values, dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=info.control)
    return [int(x) for x in t.tolist()]


def collective_device() -> torch.device:
    """Where a reduction runs: NCCL needs the current CUDA device, gloo the CPU."""
    if dist.is_available() and dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def wrap_model(
    model: DraftModel, info: DistInfo, device: torch.device, strategy: str, compile: bool
) -> torch.nn.Module:
    """``model`` compiled if asked, then wrapped for ``strategy`` (``ddp`` or ``fsdp``) when distributed.

    FSDP2 shards every draft layer and the model in place (the model is returned); DDP wraps it.
    """
    fsdp = info.enabled and strategy == "fsdp"
    if compile:
        if fsdp:  # FSDP2's hooks run around each layer: compile the layers, as torchtitan does
            for layer in model.layers:
                if type(layer).forward is not torch.nn.Module.forward:
                    layer.compile(dynamic=False)
        else:
            model.compile_training()
    if not info.enabled:
        return model
    if fsdp:
        from torch.distributed.fsdp import fully_shard

        for layer in model.layers:
            fully_shard(layer)
        fully_shard(model)
        return model
    from torch.nn.parallel import DistributedDataParallel as DDP

    ids = [device.index] if device.type == "cuda" else None
    return DDP(model, device_ids=ids, broadcast_buffers=False)
