"""The hidden-state store: zarr v3 shards of whole samples plus per-writer manifests.

Open with :meth:`HiddenStateStore.create` / :meth:`HiddenStateStore.open` (or :func:`open_existing`,
which says when no store is there yet); add samples through a
:class:`ShardWriter`; read :class:`Sample` objects by id. Byte layout: ``docs/format.md``.
"""

from hsgen.store.errors import CorruptSample, NotAStore, StoreError, StoreHeaderMismatch
from hsgen.store.header import CODECS, FORMAT_VERSION, LOGICAL_DTYPES, STORAGE_DTYPES, StoreHeader
from hsgen.store.integrity import check_sample, sample_matches
from hsgen.store.opening import check_matches, open_existing
from hsgen.store.records import Sample, SampleRecord
from hsgen.store.store import HiddenStateStore
from hsgen.store.view import StoreView
from hsgen.store.writer import ShardWriter

__all__ = [
    "CODECS",
    "CorruptSample",
    "FORMAT_VERSION",
    "LOGICAL_DTYPES",
    "NotAStore",
    "STORAGE_DTYPES",
    "HiddenStateStore",
    "Sample",
    "SampleRecord",
    "ShardWriter",
    "StoreError",
    "StoreHeader",
    "StoreHeaderMismatch",
    "StoreView",
    "check_matches",
    "check_sample",
    "open_existing",
    "sample_matches",
]
