"""hsgen.hf.hub: Hugging Face model ids resolved from a cache laid out as huggingface_hub lays it out."""

from __future__ import annotations

import json

import pytest

from _hub_util import lay_out_hub_cache, sharded_model_files
from hsgen.hf.hub import HubError, head_tensor_files, looks_like_hub_id, resolve

REPO = "hsgen-test/tiny-qwen3"


def test_a_directory_is_itself(tiny_model_dir):
    assert resolve(str(tiny_model_dir)) == tiny_model_dir


def test_tokenizer_from_an_offline_cache(hub_cache, tiny_model_dir):
    files = sharded_model_files(tiny_model_dir)
    snap = lay_out_hub_cache(
        hub_cache, REPO, {k: v for k, v in files.items() if not k.endswith("safetensors")}
    )
    got = resolve(REPO, need="tokenizer")
    assert got == snap
    assert json.loads((got / "tokenizer_config.json").read_text()) == json.loads(
        (tiny_model_dir / "tokenizer_config.json").read_text()
    )


def test_heads_need_only_the_shard_with_embeddings_norm_and_head(hub_cache, tiny_model_dir):
    files = sharded_model_files(tiny_model_dir)
    layers_shard = "model-00001-of-00002.safetensors"
    lay_out_hub_cache(hub_cache, REPO, {k: v for k, v in files.items() if k != layers_shard})
    snap = resolve(REPO, need="heads")
    assert not (snap / layers_shard).exists()
    with pytest.raises(HubError, match=f"{layers_shard} is not in the Hugging Face cache .* HF_HUB_OFFLINE"):
        resolve(REPO, need="full")


def test_revision_picks_its_snapshot(hub_cache, tiny_model_dir):
    files = {k: v for k, v in sharded_model_files(tiny_model_dir).items() if not k.endswith("safetensors")}
    lay_out_hub_cache(hub_cache, REPO, files, commit="a" * 40)
    lay_out_hub_cache(hub_cache, REPO, files, commit="b" * 40, ref="v2")
    assert resolve(REPO).name == "a" * 40
    assert resolve(REPO, revision="v2").name == "b" * 40
    assert resolve(REPO, revision="b" * 40).name == "b" * 40


def test_uncached_id_offline_names_the_cache(hub_cache):
    with pytest.raises(
        HubError, match=r"org/missing: config.json is not in the Hugging Face cache .*hf-home/hub"
    ):
        resolve("org/missing")


def test_not_a_directory_nor_an_id(tmp_path):
    with pytest.raises(HubError, match="no such directory"):
        resolve(str(tmp_path / "nope"))
    assert looks_like_hub_id("Qwen/Qwen3-8B") and looks_like_hub_id("gpt2")
    assert not looks_like_hub_id("./x") and not looks_like_hub_id("a/b/c")


def test_online_downloads_only_what_is_read(tmp_path, monkeypatch, tiny_model_dir):
    """Online, with an empty cache: the files fetched are the tokenizer's, the index and the head shard."""
    import huggingface_hub
    from huggingface_hub.errors import EntryNotFoundError, LocalEntryNotFoundError

    files = sharded_model_files(tiny_model_dir)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    fetched = []

    def fake_download(repo_id, filename, *, revision=None, cache_dir=None, local_files_only=False, **kw):
        snap = tmp_path / "hf" / "hub" / "snap"
        if local_files_only:
            if (snap / filename).exists():
                return str(snap / filename)
            raise LocalEntryNotFoundError(filename)
        if filename not in files:
            raise EntryNotFoundError(filename)
        fetched.append(filename)
        lay_out_hub_cache(tmp_path / "hf" / "hub", repo_id, {filename: files[filename]})
        snap.mkdir(parents=True, exist_ok=True)
        (snap / filename).write_bytes(files[filename])
        return str(snap / filename)

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fake_download)
    resolve(REPO, need="heads")
    assert "model-00001-of-00002.safetensors" not in fetched
    assert {
        "config.json",
        "tokenizer.json",
        "model.safetensors.index.json",
        "model-00002-of-00002.safetensors",
    } <= set(fetched)
    fetched.clear()
    resolve(REPO, need="heads")  # cache first: nothing fetched twice
    assert fetched == []


def test_head_tensor_files_skip_layers_and_towers():
    wm = {"model.layers.0.input_layernorm.weight": "a", "model.embed_tokens.weight": "b", "model.norm.weight": "c",
          "lm_head.weight": "d", "visual.blocks.0.norm.weight": "e", "model.layers.1.mlp.weight": "f"}  # fmt: skip
    assert head_tensor_files(wm) == ["b", "c", "d"]


def test_render_with_a_hub_tokenizer_equals_the_directory(
    hub_cache, tiny_model_dir, sample_chats_path, tmp_path
):
    from click.testing import CliRunner

    from hsgen.cli import main

    files = {k: v for k, v in sharded_model_files(tiny_model_dir).items() if not k.endswith("safetensors")}
    lay_out_hub_cache(hub_cache, REPO, files)
    data = tmp_path / "d.jsonl"
    data.write_text("".join(sample_chats_path.read_text().splitlines(keepends=True)[:3]))
    by_id = CliRunner().invoke(main, ["render", str(data), "--tokenizer", REPO])
    by_dir = CliRunner().invoke(main, ["render", str(data), "--tokenizer", str(tiny_model_dir)])
    assert by_id.exit_code == 0, by_id.output
    assert by_id.stdout == by_dir.stdout and len(by_id.stdout.splitlines()) == 3
    res = CliRunner().invoke(main, ["render", str(data), "--tokenizer", "org/absent"])
    assert res.exit_code == 2 and "org/absent: config.json is not in the Hugging Face cache" in res.output


def test_serve_loads_a_hub_model(hub_cache, tiny_model_dir, tmp_path):
    from hsgen.serve.app import build_state
    from hsgen.serve.config import ServeConfig

    snap = lay_out_hub_cache(hub_cache, REPO, sharded_model_files(tiny_model_dir))
    state = build_state(ServeConfig(model=REPO, layer_ids=[1, 4], shared_storage_path=str(tmp_path / "hs")))
    assert state.loaded.path == snap
    assert state.config.model_name == REPO  # /v1/models names the id, as vLLM does
    with pytest.raises(FileNotFoundError, match="org/absent"):
        build_state(ServeConfig(model="org/absent", layer_ids=[1], shared_storage_path=str(tmp_path / "hs")))
