"""Hidden states left in the server's file (``ClientConfig.rows_in_file``): read once, with ``preadv``."""

from __future__ import annotations

import os

import numpy as np
import pytest

from hsgen.client.hidden_file import FileRows, read_hidden_states_fd
from hsgen.protocol import extraction as protocol


def _write(path, hidden: np.ndarray, tokens: np.ndarray) -> None:
    header, _ = protocol.safetensors_header_bytes(
        [("hidden_states", "bfloat16", hidden.shape), ("token_ids", "int64", tokens.shape)]
    )
    path.write_bytes(header + hidden.tobytes() + tokens.tobytes())


@pytest.fixture
def sample(tmp_path):
    rng = np.random.default_rng(0)
    hidden = (rng.standard_normal((37, 3, 40), dtype=np.float32).view(np.uint32) >> 16).astype(np.uint16)
    tokens = rng.integers(0, 1000, 37)
    path = tmp_path / "cmpl-x-0-abc.safetensors"
    _write(path, hidden, tokens)
    return path, hidden, tokens


def test_rows_left_in_the_file_read_like_the_mapping(sample):
    path, hidden, tokens = sample
    fd = os.open(path, os.O_RDONLY)
    mapped, mapped_tokens, dtype = read_hidden_states_fd(fd, map_file=True)
    rows, row_tokens, dtype2 = read_hidden_states_fd(fd, rows_in_file=True)
    os.close(fd)
    path.unlink()  # as the client removes the name: the rows stay readable until closed
    assert isinstance(rows, FileRows) and dtype == dtype2 == "bfloat16"
    assert rows.shape == mapped.shape == (37, 3, 40) and rows.ndim == 3 and rows.nbytes == mapped.nbytes
    assert np.array_equal(row_tokens, tokens) and np.array_equal(mapped_tokens, tokens)
    assert np.array_equal(np.asarray(rows), hidden) and np.array_equal(mapped, hidden)
    out = np.zeros((20, 3, 40), np.uint16)
    pieces = []
    rows[:20].read_into(out, piece_bytes=1000, check=pieces.append)  # 1000 B: rounded to whole items
    assert np.array_equal(out, hidden[:20])
    assert sum(p.size for p in pieces) == out.size and len(pieces) == -(-out.nbytes // 1000)
    rows.close()
    with pytest.raises(ValueError, match="released"):
        rows[:20].read_into(out)  # slices share the file


def test_a_check_can_refuse_rows_as_they_land(sample):
    path, hidden, _ = sample
    fd = os.open(path, os.O_RDONLY)
    rows, _, _ = read_hidden_states_fd(fd, rows_in_file=True)
    os.close(fd)

    def refuse_nonzero_third_piece(piece, seen=[]):  # noqa: B006 - counts calls
        seen.append(piece)
        if len(seen) == 3:
            raise RuntimeError("bad piece")

    with pytest.raises(RuntimeError, match="bad piece"):
        rows.read_into(np.zeros(hidden.shape, np.uint16), piece_bytes=2048, check=refuse_nonzero_third_piece)
    with pytest.raises(ValueError, match="does not hold"):
        rows.read_into(np.zeros((36, 3, 40), np.uint16))
    rows.close()


def test_a_short_file_is_an_error_not_garbage(sample, tmp_path):
    path, hidden, tokens = sample
    fd = os.open(path, os.O_RDONLY)
    rows, _, _ = read_hidden_states_fd(fd, rows_in_file=True)
    os.close(fd)
    os.truncate(path, 100 + hidden.nbytes // 2)  # the file shrank under us
    with pytest.raises(EOFError):
        rows.read_into(np.zeros(hidden.shape, np.uint16))
    rows.close()


def test_out_of_descriptors_reads_instead(sample, monkeypatch):
    import errno

    path, hidden, _ = sample
    fd = os.open(path, os.O_RDONLY)

    real_dup, calls = os.dup, []

    def no_more(fd_):  # the header is read through one duplicate; holding the rows needs another
        calls.append(fd_)
        if len(calls) > 1:
            raise OSError(errno.EMFILE, "Too many open files")
        return real_dup(fd_)

    monkeypatch.setattr(os, "dup", no_more)
    got, _, _ = read_hidden_states_fd(fd, rows_in_file=True)
    os.close(fd)
    assert isinstance(got, np.ndarray) and np.array_equal(got, hidden)
