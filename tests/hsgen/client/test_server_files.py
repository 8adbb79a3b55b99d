"""Reading a server's safetensors file: header checks held to the safetensors library, own memory.

The header parser (``hsgen.protocol.extraction.read_safetensors_header``) never accepts a file the
safetensors library refuses, and reads the same tensors from every file the library writes;
the states are read into this process's memory, so a writer truncating the file afterwards
cannot reach them (a mapping died of SIGBUS).
"""

from __future__ import annotations

import io
import json
import os
import struct
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from fake_vllm import expected_states, write_states_file
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hsgen.client.hidden_file import NotReady, read_hidden_states_fd
from hsgen.protocol import extraction as protocol

safetensors = pytest.importorskip("safetensors")

TAGS = sorted(protocol.SAFETENSORS_DTYPES)


def parse(data: bytes):
    return protocol.read_safetensors_header(io.BytesIO(data), len(data))


def library(data: bytes):
    """``{name: (tag, shape, data bytes)}`` as the safetensors library reads ``data``, or the error."""
    try:
        return {
            name: (t["dtype"], list(t["shape"]), bytes(t["data"]))
            for name, t in safetensors.deserialize(data)
        }
    except Exception as e:  # noqa: BLE001 - any refusal counts
        return e


def file_bytes(header: object, data_len: int, pad: bool = True) -> bytes:
    raw = json.dumps(header).encode()
    if pad:
        raw += b" " * ((8 - len(raw) % 8) % 8)
    return struct.pack("<Q", len(raw)) + raw + bytes(range(256)) * (data_len // 256) + bytes(data_len % 256)


tensors = st.dictionaries(
    st.text("abcé_.-", min_size=1, max_size=8),
    st.tuples(st.sampled_from(TAGS), st.lists(st.integers(0, 5), max_size=3)),
    max_size=4,
)


@settings(max_examples=150, deadline=None)
@given(tensors, st.randoms(use_true_random=False))
def test_reads_what_the_library_writes(spec, rnd):
    entries, pos = {}, 0
    names = list(spec)
    rnd.shuffle(names)  # offsets need not follow the header's key order
    for name in names:
        tag, shape = spec[name]
        n = int(np.prod(shape, dtype=np.int64)) * protocol.SAFETENSORS_DTYPES[tag][1]
        entries[name] = {"dtype": tag, "shape": shape, "data_offsets": [pos, pos + n]}
        pos += n
    data = file_bytes(entries, pos)
    want = library(data)
    assert not isinstance(want, Exception), want
    got = parse(data)
    assert set(got) == set(want)
    for name, t in got.items():
        tag, shape, payload = want[name]
        assert protocol.SAFETENSORS_DTYPES[tag][0] == t.dtype and list(t.shape) == shape
        assert data[t.start : t.end] == payload


def _mutations():
    good = {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]}
    anything = st.recursive(
        st.none() | st.booleans() | st.integers(-3, 30) | st.floats(-2, 30) | st.text("ab_é", max_size=4),
        lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text("ab", max_size=3), c, max_size=3),
        max_leaves=6,
    )
    entry = st.fixed_dictionaries(
        {},
        optional={
            "dtype": st.sampled_from([*TAGS, "F32", "X9", 3]) | anything,
            "shape": st.lists(st.integers(-2, 4) | anything, max_size=3) | anything,
            "data_offsets": st.lists(st.integers(-4, 40), min_size=0, max_size=3) | anything,
        },
    )
    header = st.dictionaries(
        st.sampled_from(["a", "b", "__metadata__"]), entry | st.just(good) | anything, max_size=3
    )
    return header | anything


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_mutations(), st.integers(0, 48), st.booleans())
def test_never_accepts_what_the_library_refuses(header, data_len, pad):
    data = file_bytes(header, data_len, pad)
    try:
        got = parse(data)
    except protocol.ProtocolError:
        return  # refusing more than the library is allowed; crashing with anything else is not
    want = library(data)
    assert not isinstance(want, Exception), f"accepted a file the library refuses ({want}): {header!r}"
    assert {n: (t.dtype, list(t.shape), data[t.start : t.end]) for n, t in got.items()} == {
        n: (protocol.SAFETENSORS_DTYPES[tag][0], shape, payload) for n, (tag, shape, payload) in want.items()
    }


@pytest.mark.parametrize(
    "header",
    [
        [1, 2],  # not an object: the old parser crashed with AttributeError
        {"t": {"dtype": "F32", "shape": [-1], "data_offsets": [8, 4]}},  # negative size
        {"t": {"dtype": "F32", "shape": ["2"], "data_offsets": [0, 8]}},  # a string dimension
        {"t": {"dtype": "F32", "shape": [2.5], "data_offsets": [0, 8]}},
        {"t": {"dtype": "U8", "shape": [4], "data_offsets": [4, 8]}},  # a gap before it
        {
            "a": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]},
            "b": {"dtype": "U8", "shape": [4], "data_offsets": [2, 6]},
        },  # overlapping
        {"__metadata__": {"k": 1}},
    ],
)
def test_malformed_headers_are_protocol_errors(header):
    with pytest.raises(protocol.ProtocolError):
        parse(file_bytes(header, 8))


def test_truncated_and_overlong_files(tmp_path):
    path = tmp_path / "f.safetensors"
    ids = np.arange(1, 5)
    write_states_file(str(path), expected_states(ids, 3, 8), ids, "float32")
    full = path.read_bytes()
    fd = os.open(path, os.O_RDONLY)
    try:
        hidden, tokens, dtype = read_hidden_states_fd(fd)
        os.truncate(path, len(full) - 1)
        with pytest.raises(NotReady):
            read_hidden_states_fd(fd)  # a writer still writing: wait for it
        path.write_bytes(full + b"\0" * 8)
        with pytest.raises(protocol.ProtocolError):
            read_hidden_states_fd(fd)  # more bytes than the header names: not vLLM's file
    finally:
        os.close(fd)
    assert dtype == "float32" and tokens.tolist() == [1, 2, 3, 4]
    np.testing.assert_array_equal(hidden, expected_states(ids, 3, 8))
    assert hidden.flags.writeable, "own memory, not a read-only mapping"


async def test_map_files_maps_and_the_default_reads(tmp_path):
    from fake_vllm import FakeConfig, FakeVLLM
    from test_client import PROMPT, client_cfg

    from hsgen.client.fetch import HiddenStateClient

    shared = tmp_path / "shm"
    async with FakeVLLM(FakeConfig(str(shared), dtype="bfloat16")) as url:
        for map_files in (False, True):
            async with HiddenStateClient(client_cfg(url, shared, map_files=map_files)) as c:
                s = await c.fetch(PROMPT)
            want = expected_states(PROMPT.token_ids, 3, 8, "bfloat16").view(np.uint16)
            np.testing.assert_array_equal(s.hidden_states, want)
            assert s.hidden_states.flags.writeable is not map_files
    assert os.listdir(shared) == []


def test_a_writer_truncating_the_file_later_cannot_reach_the_sample(tmp_path):
    """A hostile writer keeps a descriptor and truncates the file after the client read (and unlinked) it."""
    path = tmp_path / "cmpl-x.safetensors"
    script = textwrap.dedent(
        f"""
        import os, sys
        import numpy as np
        sys.path.insert(0, {os.path.dirname(os.path.dirname(__file__))!r})
        from fake_vllm import expected_states, write_states_file
        from hsgen.client.hidden_file import read_hidden_states_fd

        path = {str(path)!r}
        ids = np.arange(1, 1025)
        want = expected_states(ids, 4, 64)
        write_states_file(path, want, ids, "float32")
        writer = os.open(path, os.O_RDWR)
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        hidden, tokens, dtype = read_hidden_states_fd(fd)
        os.close(fd)
        os.unlink(path)
        os.ftruncate(writer, 0)
        assert np.array_equal(hidden, want) and tokens.tolist() == ids.tolist()
        print("intact")
        """
    )
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and r.stdout.strip() == "intact", (
        f"exit {r.returncode} (-7 is SIGBUS): {r.stderr}"
    )
