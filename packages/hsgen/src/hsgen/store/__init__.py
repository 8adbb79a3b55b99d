"""The hidden-state store: zarr v3 shards of whole samples plus per-writer manifests.

Open with :meth:`HiddenStateStore.create` / :meth:`HiddenStateStore.open`; add samples through a
:class:`ShardWriter`; read :class:`Sample` objects by id. Byte layout: ``docs/format.md``.
"""

from hsgen.store.errors import CorruptSample, StoreError, StoreHeaderMismatch
from hsgen.store.header import CODECS, FORMAT_VERSION, LOGICAL_DTYPES, STORAGE_DTYPES, StoreHeader
from hsgen.store.integrity import check_sample, sample_matches
from hsgen.store.records import Sample, SampleRecord
from hsgen.store.store import HiddenStateStore
from hsgen.store.writer import ShardWriter

__all__ = [
    "CODECS",
    "CorruptSample",
    "FORMAT_VERSION",
    "LOGICAL_DTYPES",
    "STORAGE_DTYPES",
    "HiddenStateStore",
    "Sample",
    "SampleRecord",
    "ShardWriter",
    "StoreError",
    "StoreHeader",
    "StoreHeaderMismatch",
    "check_sample",
    "sample_matches",
]
