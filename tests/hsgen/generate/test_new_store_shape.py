"""A new store's shape comes from what the user named, not from the first file (issue 33, item 1).

``hsgen generate`` into a new store used to take the server's shape on trust: files of hidden size
80 for a model whose config says 64 made a store whose header says 80 (also with ``--verifier`` or
``--tokenizer`` naming that model), and a 1 GiB sparse file declaring 1024 layers was read whole
before it was refused. Now the layer count is ``--layer-ids``', the hidden size the model config's,
the dtype ``--dtype``'s, each checked on every file's header before its payload is read.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from fake_vllm import FakeConfig, FakeVLLM

from hsgen.store import HiddenStateStore, StoreHeader
from hsgen.store.store import HEADER_FILE

LAYERS = "1,2,4"


def _tokens(path, n=3):
    path.write_text(
        "".join(json.dumps({"id": f"p{i}", "input_ids": [i + 1, 5, 6, 7]}) + "\n" for i in range(n))
    )
    return path


def _generate(tmp_path, url, shared, *extra, store=None):
    """``hsgen generate`` in its own process; returns (result, its peak RSS in MB)."""
    store = store or tmp_path / "store"
    cmd = [sys.executable, "-m", "hsgen.cli", "generate", str(_tokens(tmp_path / "d.jsonl")), "--store", str(store),
           "--endpoint", url, "--shared-dir", str(shared), "--no-progress", "--retries", "0", *map(str, extra)]  # fmt: skip
    probe = (
        "import resource, subprocess, sys; r = subprocess.run(sys.argv[1:], capture_output=True, text=True); "
        "sys.stdout.write(r.stdout); sys.stderr.write(r.stderr); "
        "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss, file=sys.stderr); sys.exit(r.returncode)"
    )
    r = subprocess.run([sys.executable, "-c", probe, *cmd], capture_output=True, text=True, timeout=300)
    *lines, rss = r.stderr.rstrip("\n").split("\n")
    r.stderr = "\n".join(lines)
    return r, int(rss) / 1024


def _lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.strip()]


def _model(tmp_path, tiny_model_dir, hidden: int):
    """A copy of the tiny model's files whose config says ``hidden``."""
    import shutil

    d = tmp_path / f"model-{hidden}"
    shutil.copytree(tiny_model_dir, d)
    config = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**config, "hidden_size": hidden}))
    return d


@pytest.mark.parametrize("flag", ["--verifier", "--tokenizer"])
@pytest.mark.parametrize("sent", [80, 65536])
def test_a_new_store_refuses_a_hidden_size_the_named_model_does_not_have(
    tmp_path, tiny_model_dir, flag, sent
):
    shared = tmp_path / "shm"
    with FakeVLLM(FakeConfig(str(shared), hidden=sent)).in_thread() as url:
        r, _ = _generate(tmp_path, url, shared, "--layer-ids", LAYERS, flag, tiny_model_dir)
    assert r.returncode == 1, r.stderr
    fatal = json.loads(r.stdout)["fatal"]
    assert f"sends hidden size {sent}, the model's is 64" in fatal and str(tiny_model_dir) in fatal, fatal
    assert fatal in r.stderr and "Traceback" not in r.stderr
    assert not (tmp_path / "store" / HEADER_FILE).exists()


def test_the_served_model_names_the_hidden_size_when_it_is_a_directory(tmp_path, tiny_model_dir):
    shared = tmp_path / "shm"
    with FakeVLLM(FakeConfig(str(shared), hidden=80, model=str(tiny_model_dir))).in_thread() as url:
        r, _ = _generate(tmp_path, url, shared, "--layer-ids", LAYERS)
    assert r.returncode == 1, r.stderr
    assert "the model's is 64" in json.loads(r.stdout)["fatal"] and "the served model" in r.stderr
    assert not (tmp_path / "store" / HEADER_FILE).exists()


def test_a_huge_file_with_another_layer_count_is_refused_before_it_is_read(tmp_path):
    """1 GiB sparse file declaring 1024 layers: the old client read it whole (about 2 GB of RSS)."""
    shared = tmp_path / "shm"
    with FakeVLLM(FakeConfig(str(shared), faults=["huge_layers"] * 8)).in_thread() as url:
        r, rss_mb = _generate(tmp_path, url, shared, "--layer-ids", LAYERS)
    assert r.returncode == 1, r.stderr
    assert "sends 1024 layers, 3 were asked for" in json.loads(r.stdout)["fatal"]
    assert rss_mb < 400, f"peak RSS {rss_mb:.0f} MB: the file was read"
    assert not (tmp_path / "store" / HEADER_FILE).exists()


def test_dtype_asked_for_is_checked_on_the_header(tmp_path):
    shared = tmp_path / "shm"
    with FakeVLLM(FakeConfig(str(shared), dtype="float32")).in_thread() as url:
        r, _ = _generate(tmp_path, url, shared, "--layer-ids", LAYERS, "--dtype", "bfloat16")
    assert r.returncode == 1
    assert "sends float32 hidden states, bfloat16 was asked for (--dtype)" in json.loads(r.stdout)["fatal"]


def test_nothing_naming_the_model_says_in_one_line_which_shape_the_store_takes(tmp_path, tiny_model_dir):
    shared = tmp_path / "shm"
    with FakeVLLM(FakeConfig(str(shared), hidden=8)).in_thread() as url:
        r, _ = _generate(tmp_path, url, shared, "--layer-ids", LAYERS, "--log-level", "WARNING")
        named, _ = _generate(tmp_path, url, shared, "--layer-ids", LAYERS, "--verifier", _model(tmp_path, tiny_model_dir, 8),
                             "--log-level", "WARNING", store=tmp_path / "named")  # fmt: skip
    assert r.returncode == 0, r.stderr
    lines = _lines(r.stderr)
    assert len(lines) == 1, r.stderr
    assert "3 layers (--layer-ids 1,2,4), hidden size 8 and float32 from the servers' first file" in lines[0]
    assert "nothing names the model" in lines[0] and "--verifier" in lines[0]
    assert HiddenStateStore.open(tmp_path / "store").header.hidden_size == 8
    assert named.returncode == 0 and _lines(named.stderr) == [], named.stderr  # named: nothing to warn of


def test_a_named_model_whose_config_cannot_be_read_is_said_so(tmp_path, hub_cache):
    """The audit: ``--verifier ORG/NAME`` neither a directory nor in the hub cache (offline here; a
    hub out of reach does the same after its retries) made the store from the first file with the
    line 'nothing names the model (pass --verifier ...)', to a user who had passed --verifier."""
    shared = tmp_path / "shm"
    with FakeVLLM(FakeConfig(str(shared), hidden=8)).in_thread() as url:
        r, _ = _generate(tmp_path, url, shared, "--layer-ids", LAYERS, "--verifier", "org/not-cached",
                         "--log-level", "WARNING")  # fmt: skip
    assert r.returncode == 0, r.stderr
    lines = _lines(r.stderr)
    assert len(lines) == 1, r.stderr
    assert "hidden size 8 and float32 from the servers' first file" in lines[0], lines[0]
    assert "--verifier org/not-cached gave no config.json" in lines[0] and "nothing names" not in lines[0]


def test_an_existing_store_says_its_own_figures_are_the_stores(tmp_path):
    shared = tmp_path / "shm"
    HiddenStateStore.create(tmp_path / "store", StoreHeader("fake-model", (1, 2, 4), 64, "float32"))
    with FakeVLLM(FakeConfig(str(shared), hidden=80)).in_thread() as url:
        r, _ = _generate(tmp_path, url, shared, "--layer-ids", LAYERS)
        dtype, _ = _generate(tmp_path, url, shared, "--dtype", "bfloat16")
    assert r.returncode == 1
    assert "sends hidden size 80, the store's is 64" in json.loads(r.stdout)["fatal"]
    assert dtype.returncode == 1 and "holds float32 hidden states, --dtype says bfloat16" in dtype.stderr


def test_the_shape_from_the_flags(tiny_model_dir, hub_cache):
    from hsgen.generate.store_shape import StoreShape

    with pytest.raises(ValueError, match="layer id 9 exceeds the model's 4 layers"):
        StoreShape.named([1, 9], verifier=str(tiny_model_dir))
    shape = StoreShape.named([1, 2, 4], tokenizer_dir=str(tiny_model_dir), dtype="float32")
    e = shape.expected()
    assert (e.num_layers, e.hidden_size, e.dtype) == (3, 64, "float32") and "--tokenizer" in e.hidden_from
    assert StoreShape.named([1, 2, 4], verifier="org/not-cached").expected().hidden_size is None  # offline
