"""How one sample's bytes reach its slot of a packed sequence.

A source's ``locate(sample_id)`` returns a :class:`SampleRead`: the sample's length and a way to
read its rows into buffers the loader hands it. The loader gives it the slot of the packed
(pinned) sequence itself when the sample's rows are the slot's rows (all stored layers, in
order, same dtype, not truncated), so the bytes land once; otherwise a staging copy selects
layers and rows. Reads check what they read (a store's checksum, finite values) piece by piece
while the bytes are in cache, and raise :class:`SampleRefused` for a sample that fails: the
loader turns its slot into padding and trains on the rest.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import numpy as np
import torch

from hsgen.protocol.dtypes import STORAGE, all_finite
from spectrain.data.batch import TORCH_DTYPES, numpy_view

if TYPE_CHECKING:
    from hsgen.store import HiddenStateStore


PIECE_BYTES = 1 << 20
"""Bytes read and checked at a time: small enough to stay in a core's cache between the two."""


class SampleRefused(Exception):
    """A sample whose bytes failed a check (checksum, non-finite values): skipped, not trained."""


class SampleRead(Protocol):
    """One located sample, ready to be read (see the module docstring)."""

    sample_id: str
    length: int
    """Stored tokens."""
    dtype: str
    """Logical dtype of the hidden states."""
    row_shape: tuple[int, int]
    """(stored layers, hidden size)."""

    def read_into(self, hidden: np.ndarray, token_ids: np.ndarray, loss_mask: np.ndarray,
                  target_ids: np.ndarray | None = None) -> None:  # fmt: skip
        """Fill ``hidden`` ``[length, L, H]`` (storage dtype), ``token_ids`` int64, ``loss_mask`` uint8,
        and ``target_ids`` int32 (the verifier's argmax per token) when given: a sample without
        them then raises ``ValueError``.

        Raises:
            SampleRefused: the bytes failed their check (the message names where they came from).
        """
        ...


@dataclass
class ArrayRead:
    """A sample already in memory: a :class:`hsgen.store.Sample` from a source's ``get``, a
    worker's tensors, or a fetched sample as the client mapped the server's file (or left its
    rows in that file: ``hidden`` is then a :class:`hsgen.client.hidden_file.FileRows`, read with ``preadv``).

    With ``check_finite`` the values are checked piece by piece as they are copied (a fetched
    sample whose client skipped that pass); ``origin`` names where they came from in the refusal.
    """

    sample_id: str
    hidden: np.ndarray  # [T, L, H] storage dtype (T >= length)
    token_ids: np.ndarray
    loss_mask: np.ndarray | None
    dtype: str
    check_finite: bool = False
    origin: str = ""
    target_ids: np.ndarray | None = None

    @classmethod
    def of(cls, sample, **kw) -> ArrayRead:
        """From anything with ``sample_id``, ``hidden_states``, ``token_ids``, ``loss_mask``, ``dtype``
        (and ``target_ids``, when it has them)."""
        kw.setdefault("target_ids", getattr(sample, "target_ids", None))
        return cls(
            sample.sample_id, sample.hidden_states, sample.token_ids, sample.loss_mask, sample.dtype, **kw
        )

    @property
    def length(self) -> int:
        return int(self.token_ids.shape[0])

    @property
    def row_shape(self) -> tuple[int, int]:
        return tuple(self.hidden.shape[1:])  # type: ignore[return-value]

    def read_into(self, hidden: np.ndarray, token_ids: np.ndarray, loss_mask: np.ndarray,
                  target_ids: np.ndarray | None = None) -> None:  # fmt: skip
        if target_ids is not None:
            if self.target_ids is None:
                raise ValueError(
                    f"sample {self.sample_id!r} from {self.origin or 'memory'} has no target ids"
                )
            np.copyto(target_ids, self.target_ids[: self.length])
        if self.hidden.ndim != 3 or self.hidden.shape[0] < self.length:
            raise ValueError(
                f"sample {self.sample_id!r}: hidden states {tuple(self.hidden.shape)} do not match "
                f"{self.length} tokens"
            )

        def check(piece: np.ndarray) -> None:  # while the piece is in cache
            if not all_finite(piece, self.dtype):
                raise SampleRefused(
                    f"sample {self.sample_id!r} from {self.origin or 'memory'}: hidden states contain NaN or Inf"
                )

        rows = self.hidden[: self.length]
        if not isinstance(
            rows, np.ndarray
        ):  # rows still in the server's file: hsgen.client.hidden_file.FileRows
            try:
                rows.read_into(hidden, piece_bytes=PIECE_BYTES, check=check if self.check_finite else None)
            except (OSError, EOFError, ValueError) as e:
                raise SampleRefused(f"sample {self.sample_id!r} from {self.origin or 'a file'}: {e}") from e
        else:
            src = rows.reshape(-1).view(hidden.dtype)
            dst = hidden.reshape(-1)
            step = dst.size if not self.check_finite else max(1, PIECE_BYTES // dst.itemsize)
            for lo in range(0, dst.size, step):
                np.copyto(dst[lo : lo + step], src[lo : lo + step])
                if self.check_finite:
                    check(dst[lo : lo + step])
        np.copyto(token_ids, self.token_ids)
        if self.loss_mask is None:
            loss_mask[...] = 1
        else:
            np.copyto(loss_mask, np.asarray(self.loss_mask[: self.length]).astype(np.uint8, copy=False))


@dataclass
class StoreRead:
    """A sample of a :class:`hsgen.store.HiddenStateStore`, read straight into the slot.

    With ``verify`` the checksum of the manifest is checked as the bytes land
    (:func:`verify_sample_read`).
    """

    store: HiddenStateStore
    sample_id: str
    length: int
    verify: bool = True

    @property
    def dtype(self) -> str:
        return self.store.header.dtype

    @property
    def row_shape(self) -> tuple[int, int]:
        return (self.store.header.num_layers, self.store.header.hidden_size)

    def read_into(self, hidden: np.ndarray, token_ids: np.ndarray, loss_mask: np.ndarray,
                  target_ids: np.ndarray | None = None) -> None:  # fmt: skip
        if target_ids is not None and not self.store.header.target_ids_stored:
            raise ValueError(f"store {self.store.path} keeps no target ids")
        verify_sample_read(self.store, self.sample_id, hidden, token_ids, loss_mask, verify=self.verify,
                           target_ids=target_ids)  # fmt: skip


def verify_sample_read(store: HiddenStateStore, sample_id: str, hidden: np.ndarray, token_ids: np.ndarray,
                       loss_mask: np.ndarray, *, verify: bool, target_ids: np.ndarray | None = None) -> None:  # fmt: skip
    """Read a store sample into the buffers, its checksum checked piece by piece when ``verify``.

    The one place the loader asks the store to check a sample (``HiddenStateStore.read_into``
    with ``verify``, against the manifest's checksum; see ``docs/format.md``).

    Raises:
        SampleRefused: the checksum does not match, or the rows cannot be read (the message
            names the store, the shard and the sample).
    """
    from hsgen.store import StoreError

    try:
        store.read_into(sample_id, hidden, token_ids, loss_mask, verify=verify, target_ids=target_ids)
    except KeyError as e:  # deleted since it was located: no shard holds it any more
        raise SampleRefused(
            f"store {store.path}: sample {sample_id!r} is no longer in it (its shard was deleted)"
        ) from e
    except StoreError as e:  # the store's message names the store, the shard and the sample
        raise SampleRefused(str(e)) from e
    except (OSError, EOFError) as e:
        raise SampleRefused(f"store {store.path}: sample {sample_id!r}: {e}") from e


def fill_slot(read: SampleRead, hidden: torch.Tensor, input_ids: torch.Tensor, loss_mask: torch.Tensor,
              layers: Sequence[int] | None, target_ids: torch.Tensor | None = None) -> None:  # fmt: skip
    """Read ``read`` into one slot of a packed sequence: its first ``len(hidden)`` tokens.

    ``hidden`` ``[n, n_sel, H]``, ``input_ids`` ``[n]`` int64, ``loss_mask`` ``[n]`` bool and
    ``target_ids`` ``[n]`` int64 (a store of target ids only) are views of the sequence's buffers. The rows land in them directly when they are the sample's
    stored rows; otherwise a staging buffer takes the whole sample (its check covers every
    stored byte) and the kept layers and tokens are copied from it.
    """
    n = int(hidden.shape[0])
    L, H = read.row_shape
    direct = (
        n == read.length
        and (layers is None or list(layers) == list(range(L)))
        and hidden.dtype == TORCH_DTYPES[read.dtype]
        and tuple(hidden.shape[1:]) == (L, H)
        and hidden.is_contiguous()
    )
    mask = numpy_view(loss_mask, np.uint8)
    targets = None if target_ids is None else np.empty(read.length, dtype=np.int32)
    if direct:
        _read(read, numpy_view(hidden, STORAGE[read.dtype]), numpy_view(input_ids, np.int64), mask, targets)
        np.minimum(mask, 1, out=mask)  # bool storage must hold 0 or 1
        if target_ids is not None:
            target_ids.copy_(torch.from_numpy(targets))
        return
    stage = np.empty((read.length, L, H), dtype=STORAGE[read.dtype])
    ids = np.empty(read.length, dtype=np.int64)
    m = np.empty(read.length, dtype=np.uint8)
    _read(read, stage, ids, m, targets)
    if target_ids is not None:
        target_ids.copy_(torch.from_numpy(targets[:n]))
    hs = torch.from_numpy(stage[:n])
    if read.dtype == "bfloat16":
        hs = hs.view(torch.bfloat16)
    if layers is not None and list(layers) != list(range(L)):
        hs = hs[:, list(layers)]
    if tuple(hs.shape[1:]) != tuple(hidden.shape[1:]):
        raise ValueError(
            f"sample {read.sample_id!r}: hidden states {tuple(hs.shape)} differ from the batch's"
        )
    hidden.copy_(hs)
    input_ids.copy_(torch.from_numpy(ids[:n]))
    mask[...] = np.minimum(m[:n], 1)


def _read(
    read: SampleRead, hidden: np.ndarray, ids: np.ndarray, mask: np.ndarray, targets: np.ndarray | None
) -> None:
    """``read.read_into``, passing ``target_ids`` only when wanted (reads that predate them take three buffers)."""
    if targets is None:
        read.read_into(hidden, ids, mask)
    else:
        read.read_into(hidden, ids, mask, targets)
