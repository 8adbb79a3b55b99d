"""Exceptions raised by :mod:`hsgen.store`."""

from __future__ import annotations


class StoreError(Exception):
    """A store that cannot be opened, read or written as asked; the message names the path."""


class NotAStore(StoreError):
    """Nothing at the path is a store: no header there (a directory or prefix may still exist)."""


class SampleRejected(ValueError):
    """A sample whose rows failed a check as they were written (values not finite, a source file
    cut short): nothing of it is in the shard, which goes on taking samples.

    Attributes:
        reason: ``non_finite`` or ``truncated_file`` (the failures file's words for them).
    """

    def __init__(self, message: str, reason: str):
        super().__init__(message)
        self.reason = reason


class StoreHeaderMismatch(StoreError):
    """Samples with a different data meaning (header) were offered to an existing store.

    Attributes:
        problems: one human-readable line per differing field.
    """

    def __init__(self, message: str, problems: list[str]):
        super().__init__(message)
        self.problems = problems


class CorruptSample(StoreError):
    """A sample whose stored bytes do not match the checksum its manifest record holds.

    Attributes:
        sample_id: the sample.
        shard: its shard, relative to the store.
    """

    def __init__(self, message: str, sample_id: str, shard: str):
        super().__init__(message)
        self.sample_id = sample_id
        self.shard = shard
