"""One packed training sequence (:class:`Batch`) and the zero-copy views of stored hidden states."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from hsgen.protocol.dtypes import HIDDEN_DTYPES

TORCH_DTYPES = {name: getattr(torch, name) for name in HIDDEN_DTYPES}
"""Logical hidden-state dtype (store header) -> torch dtype of a batch's states."""

BATCH_TENSORS = ("input_ids", "loss_mask", "position_ids", "doc_ids", "doc_ends", "hidden_states")


@dataclass
class Batch:
    """One packed sequence of ``S`` token slots (no batch dimension).

    ``hidden_states[:, :-1]`` are the auxiliary layers (draft input), ``hidden_states[:, -1]``
    the last layer (targets); from a store of target ids (``targets = "argmax"``) every layer of
    ``hidden_states`` is auxiliary and ``target_ids[t]`` is the verifier's greedy token after
    slot ``t`` (-1 in padding). Slots past ``num_tokens`` are padding: ``doc_ids == -1``,
    ``loss_mask == 0``, zero states; a sample the reader refused (a checksum or value check
    failed) is padding of the same kind inside the sequence. Token ``t`` of a document is
    predicted from the verifier's state at ``t - 1``; ``loss_mask[t] == 1`` trains that prediction.
    """

    input_ids: torch.Tensor  # [S] int64
    loss_mask: torch.Tensor  # [S] bool
    position_ids: torch.Tensor  # [S] int64, restart at 0 per document
    doc_ids: torch.Tensor  # [S] int64, 0.. per document, -1 padding
    doc_ends: torch.Tensor  # [S] int64, exclusive end slot of the token's document (own slot + 1 for padding)
    hidden_states: torch.Tensor  # [S, n_aux + 1, H] in the store's dtype ([S, n_aux, H] with target_ids)
    target_ids: torch.Tensor | None = None  # [S] int64, the verifier's argmax after each slot, -1 = none
    sample_ids: list[str] = field(default_factory=list)
    plan_start: int = 0
    plan_end: int = 0
    num_tokens: int = 0

    @property
    def aux_hidden(self) -> torch.Tensor:
        return self.hidden_states if self.target_ids is not None else self.hidden_states[:, :-1]

    @property
    def last_hidden(self) -> torch.Tensor:
        if self.target_ids is not None:
            raise ValueError("this batch carries target ids, not the verifier's last layer")
        return self.hidden_states[:, -1]

    @property
    def seq_len(self) -> int:
        return int(self.input_ids.shape[0])

    def to(self, device: torch.device | str, non_blocking: bool = False) -> Batch:
        move = {k: getattr(self, k).to(device, non_blocking=non_blocking) for k in BATCH_TENSORS}
        targets = None if self.target_ids is None else self.target_ids.to(device, non_blocking=non_blocking)
        return Batch(**move, target_ids=targets, sample_ids=self.sample_ids, plan_start=self.plan_start,
                     plan_end=self.plan_end, num_tokens=self.num_tokens)  # fmt: skip

    def tensors(self) -> list[torch.Tensor]:
        """The six tensors, in :data:`BATCH_TENSORS` order, then ``target_ids`` when present."""
        return [getattr(self, k) for k in BATCH_TENSORS] + (
            [self.target_ids] if self.target_ids is not None else []
        )

    def drop(self, start: int, end: int) -> None:
        """Turn slots ``[start, end)`` into padding (a refused sample: trained on nothing)."""
        zero_rows(self.hidden_states[start:end])
        self.input_ids[start:end] = 0
        self.loss_mask[start:end] = False
        self.position_ids[start:end] = 0
        self.doc_ids[start:end] = -1
        self.doc_ends[start:end] = torch.arange(start + 1, end + 1)
        if self.target_ids is not None:
            self.target_ids[start:end] = -1


def empty_batch(S: int, plan_start: int, plan_end: int, ids: list[str], dtype: torch.dtype,
                target_ids: bool = False) -> Batch:  # fmt: skip
    """A sequence of padding only (every sample of its plan range failed)."""
    return Batch(
        torch.zeros(S, dtype=torch.int64),
        torch.zeros(S, dtype=torch.bool),
        torch.zeros(S, dtype=torch.int64),
        torch.full((S,), -1, dtype=torch.int64),
        torch.arange(1, S + 1, dtype=torch.int64),
        torch.zeros((S, 1, 1), dtype=dtype),
        target_ids=torch.full((S,), -1, dtype=torch.int64) if target_ids else None,
        sample_ids=ids,
        plan_start=plan_start,
        plan_end=plan_end,
        num_tokens=0,
    )


def storage_to_torch(array: np.ndarray, dtype: str) -> torch.Tensor:
    """Zero-copy torch view of stored hidden states (``uint16`` storage -> ``bfloat16``)."""
    t = torch.from_numpy(np.ascontiguousarray(array))
    if dtype == "bfloat16":
        if t.dtype not in (torch.uint16, torch.int16):
            if t.dtype == torch.bfloat16:
                return t
            raise ValueError(f"bfloat16 states must be stored as uint16, got {array.dtype}")
        return t.view(torch.bfloat16)
    want = {"float16": torch.float16, "float32": torch.float32}.get(dtype)
    if want is None:
        raise ValueError(f"unsupported hidden-state dtype {dtype!r}")
    return t if t.dtype == want else t.to(want)


def numpy_view(t: torch.Tensor, np_dtype: np.dtype) -> np.ndarray:
    """A numpy array sharing ``t``'s (contiguous) memory, read as ``np_dtype`` (same item size)."""
    np_dtype = np.dtype(np_dtype)
    if t.element_size() != np_dtype.itemsize:
        raise ValueError(f"{t.dtype} and {np_dtype} differ in item size")
    return t.view(torch.uint8).numpy().view(np_dtype).reshape(tuple(t.shape))


def zero_rows(t: torch.Tensor) -> None:
    """Zero ``t`` in place; a contiguous CPU tensor through ``memset`` (numpy's fill of its bytes),
    which streams past the cache: ~10x faster than ``Tensor.zero_`` on rows not in cache."""
    if t.device.type != "cpu" or not t.is_contiguous():
        t.zero_()
    elif t.numel():
        t.view(torch.uint8).numpy().fill(0)
