"""A hostile server (or a hostile writer of the shared directory) against the client.

Issue 13, points 1 and 2: a path component swapped for a symlink after the response must not
make the client store another file's bytes nor delete a file outside ``--shared-dir``; a FIFO
at the ``.lock`` or file path must not hang the client.
"""

from __future__ import annotations

import asyncio
import os
import threading

import numpy as np
import pytest
from fake_vllm import FakeConfig, FakeVLLM
from test_client import client_cfg

from hsgen.client.fetch import FetchError, HiddenStateClient
from hsgen.inputs.render import RenderedPrompt

PROMPT = RenderedPrompt("s1", [5, 6, 7, 8], [0, 0, 1, 1])


def cfg(url, shared):
    return client_cfg(url, shared, max_retries=0)


async def test_symlink_swapped_directory_is_neither_read_nor_deleted_through(tmp_path):
    shared, outside = tmp_path / "shm", tmp_path / "secret"
    fake = FakeVLLM(
        FakeConfig(str(shared), faults=["symlink_swap"], outside_dir=str(outside), write_delay_s=0.05)
    )
    async with fake as url, HiddenStateClient(cfg(url, shared)) as c:
        with pytest.raises(FetchError) as ei:
            sample = await c.fetch(PROMPT)
            # the old client got here: it stored the outside file's bytes (all 99)
            assert not np.all(sample.hidden_states == 99), "stored another file's bytes"
        await asyncio.sleep(0.1)
    assert ei.value.reason == "unsafe_path" and not ei.value.transient
    assert "symlink" in ei.value.message
    left = os.listdir(outside)
    assert len(left) == 1 and left[0].endswith(".safetensors"), "a file outside --shared-dir was deleted"


def _fetch_in_thread(url, shared, box):
    async def go():
        async with HiddenStateClient(cfg(url, shared)) as c:
            await c.fetch(PROMPT)

    try:
        asyncio.run(go())
        box["result"] = "ok"
    except BaseException as e:  # noqa: BLE001 - reported to the test thread
        box["result"] = e


@pytest.mark.parametrize("fault", ["fifo_lock", "fifo_file"])
def test_fifo_in_the_shared_directory_does_not_hang(tmp_path, fault):
    shared = tmp_path / "shm"
    fake = FakeVLLM(FakeConfig(str(shared), faults=[fault]))
    with fake.in_thread() as url:
        box: dict = {}
        t = threading.Thread(target=_fetch_in_thread, args=(url, shared, box), daemon=True)
        t.start()
        t.join(15)
        hung = t.is_alive()
        if hung:  # the old client blocks in open(2) on the FIFO: give it a writer so the test ends
            for name in os.listdir(shared):
                fd = os.open(shared / name, os.O_WRONLY | os.O_NONBLOCK)
                os.close(fd)
            t.join(15)
    assert not hung, "the client hung on a FIFO"
    err = box["result"]
    assert isinstance(err, FetchError) and err.reason == "unsafe_path", err
    assert "not a regular file" in err.message
    assert os.listdir(shared) == [], "the FIFO named after our request is removed"


def test_shared_dir_refuses_links_and_leaves_targets(tmp_path):
    from hsgen.client.shared_dir import SharedDir, UnsafePath

    shared, outside = tmp_path / "shm", tmp_path / "out"
    shared.mkdir()
    outside.mkdir()
    (outside / "f").write_bytes(b"secret")
    (shared / "link").symlink_to(outside)
    (shared / "flink").symlink_to(outside / "f")
    sd = SharedDir(str(shared))
    with pytest.raises(UnsafePath):
        sd.open_regular(sd.relative(str(shared / "link" / "f")))
    with pytest.raises(UnsafePath):
        sd.open_regular(sd.relative(str(shared / "flink")))
    with pytest.raises(UnsafePath):
        sd.relative(str(outside / "f"))
    with pytest.raises(UnsafePath):
        sd.relative(str(shared / ".." / "out" / "f"))
    assert sd.remove(sd.relative(str(shared / "link" / "f"))) is False
    assert sd.remove(sd.relative(str(shared / "flink"))) is True  # the link goes, not its target
    assert (outside / "f").read_bytes() == b"secret"
    sd.close()
