"""Opening the store a run will fill: none yet, the one there, or one that holds something else."""

from __future__ import annotations

import pytest

from hsgen.store import HiddenStateStore, NotAStore, StoreError, StoreHeader, StoreHeaderMismatch
from hsgen.store.opening import check_matches, open_existing

HEADER = StoreHeader(verifier="tiny", layer_ids=(1, 2, 3), hidden_size=16, dtype="bfloat16",
                     tokenizer_fingerprint="a" * 64)  # fmt: skip


def test_no_store_yet_is_none_and_a_foreign_directory_is_an_error(tmp_path):
    assert open_existing(tmp_path / "absent") is None
    (tmp_path / "leased").mkdir()
    (tmp_path / "leased" / ".lease-w0").write_text("")  # a first run's lease: still no store
    assert open_existing(tmp_path / "leased") is None
    (tmp_path / "foreign").mkdir()
    (tmp_path / "foreign" / "notes.txt").write_text("mine")
    with pytest.raises(NotAStore, match="not an hsgen store"):
        open_existing(tmp_path / "foreign")


def test_the_store_there_opens_and_every_differing_field_is_named(tmp_path):
    HiddenStateStore.create(tmp_path / "s", HEADER).close()
    store = open_existing(tmp_path / "s")
    assert store is not None and store.header == HEADER
    check_matches(store, layer_ids=[1, 2, 3], dtype="bfloat16", fingerprint="a" * 64, targets="states")
    check_matches(store)  # nothing asked, nothing compared
    with pytest.raises(StoreHeaderMismatch) as e:
        check_matches(store, layer_ids=[1, 2], dtype="float32", fingerprint="b" * 64, targets="argmax")
    assert [p.split(":")[0] for p in e.value.problems] == ["layer ids", "dtype", "tokenizer", "targets"]
    assert str(tmp_path / "s") in str(e.value) and isinstance(e.value, StoreError)
