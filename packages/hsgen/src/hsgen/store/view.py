"""The store as its helpers see it: :class:`StoreView`, what ``maintenance``, ``verify``, ``remote``
and ``writer`` may use of a :class:`~hsgen.store.store.HiddenStateStore` beyond its public reading API.

The helpers are typed against this protocol and read nothing else of the store (``tests/test_house.py``
holds that no module reads the store's private attributes).
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from hsgen.store.backend import Backend
    from hsgen.store.header import StoreHeader
    from hsgen.store.manifest import ManifestReplay, ShardInfo
    from hsgen.store.records import Sample
    from hsgen.store.shard import ShardReader


class StoreView(Protocol):
    """What a store helper may use: the store's place and header, its replayed manifests, its shards."""

    path: Path
    header: StoreHeader

    @property
    def replay(self) -> ManifestReplay:
        """The manifests as replayed so far: ``shards`` committed, ``deleted``, ``damaged``, ``problems``."""

    @property
    def backend(self) -> Backend | None:
        """The object store holding the bytes; ``None`` for a directory."""

    def refresh(self) -> None:
        """Replay what the manifests gained since the last refresh."""

    def reload(self) -> None:
        """Forget the replay and read every manifest again (after one was rewritten)."""

    def live_shards(self) -> list[ShardInfo]:
        """The committed shards not deleted, in commit order."""

    def placement(self, sample_id: str) -> tuple[ShardInfo, int] | None:
        """The live copy of ``sample_id`` (its shard and row), or ``None``."""

    def shard_reader(self, shard: str) -> ShardReader:
        """A reader of the committed shard ``shard``."""

    def read_many(self, sample_ids: Iterable[str], *, verify: bool = True) -> list[Sample]:
        """Whole samples, by id (the public reading API)."""

    def delete_shard(self, shard: str) -> None:
        """Mark ``shard`` deleted with a tombstone record (its files are removed after)."""


__all__ = ["StoreView"]
