"""Every verifier family end to end on the reference server: ``hsgen generate`` → DFlash and
Eagle3, a few steps → the exported checkpoint → speculators 0.9.0 loads it with that
verifier → ``spectrain eval`` is exact (speculative decoding reproduces the verifier's own greedy output).

In process (the thread-mode server, the CLIs through click), one tiny random model per family
(``tests/_families.py``), so the whole matrix stays within minutes on 2 cores.
"""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from _families import LAYERS
from hsgen.serve.testing import running_server

STORE_LAYERS = list(range(1, LAYERS + 1))
NAMES = [
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "qwen3_moe",
    "qwen3_vl",
    "qwen3_next",
    "qwen3_5_text",
    "qwen3_5",
    "gpt_oss",
    "gemma2",
    "gemma3_text",
    "gemma3",
    "gemma4_text",
    "gemma4",
]
"""One model per row of ``spectrain.models.families`` (a wrapper and its text model both), so every family a user can
train for runs end to end in the default suite; the matrix's two variants (a tied Llama head, Gemma 3 with a
softcap) change only the heads, which the differential tests cover, and the Gemma 4 wrapper runs a softcap here.
The Qwen2 and Qwen3.5 models carry a tokenizer whose pre-tokenizer is the one transformers forces on
them (``_families._as_forced_tokenizer``), so ``hsgen generate``'s tokenizer probe sees the server tokenize as the
local files do."""


def _speculators_loads(draft_dir, algorithm):
    """speculators' own class for the algorithm loads the export, every exported tensor in place."""
    from safetensors.torch import load_file

    core = pytest.importorskip(
        f"speculators.models.{algorithm}.core", reason="speculators 0.9.0 not importable"
    )
    cls = core.DFlashDraftModel if algorithm == "dflash" else core.Eagle3DraftModel
    config = cls.config_class.from_pretrained(draft_dir)
    config.transformer_layer_config._attn_implementation = "eager"
    peer = cls.from_pretrained(draft_dir, config=config, dtype=torch.float32)
    theirs = peer.state_dict()
    for name, tensor in load_file(str(draft_dir / "model.safetensors")).items():
        held = theirs.get(name, getattr(peer, name, None))  # d2t / t2d: buffers outside the state dict
        if held is None and name in ("d2t", "t2d"):  # a full-vocabulary draft: the maps are the identity
            assert not tensor.any() if name == "d2t" else bool(tensor.all()), name
            continue
        assert held is not None, f"speculators has no {name}"
        assert torch.equal(held.to(tensor.dtype), tensor), name


@pytest.mark.parametrize("name", NAMES)
def test_family_end_to_end(family_model, name, tmp_path, sample_chats_path):
    from hsgen.cli import main as hsgen_main
    from spectrain.cli import main as spectrain_main

    torch.set_num_threads(1)
    model = family_model(name)
    shared, store = tmp_path / "shm", tmp_path / "store"
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(sample_chats_path.read_text().splitlines(keepends=True)[:6]))
    runner = CliRunner()
    with running_server(model, STORE_LAYERS, shared, dtype="float32") as url:
        res = runner.invoke(hsgen_main, ["generate", str(data), "--store", str(store), "--endpoint", url,
                                         "--shared-dir", str(shared), "--layer-ids", ",".join(map(str, STORE_LAYERS)),
                                         "--tokenizer", str(model), "--max-len", "96", "--no-progress"])  # fmt: skip
        assert res.exit_code == 0, res.output
        assert json.loads(res.stdout.strip().splitlines()[-1])["stored"] == 6
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(sample_chats_path.read_text().splitlines(keepends=True)[6:8]))
    for algorithm, extra in (("dflash", ["--block-size", "4", "--num-layers", "1"]), ("eagle3", [])):
        save = tmp_path / algorithm
        res = runner.invoke(spectrain_main, ["train", "--store", str(store), "--verifier", str(model),
                                             "--speculator-type", algorithm, "--save-path", str(save),
                                             "--total-seq-len", "128", "--max-steps", "2", "--save-every", "0",
                                             "--num-workers", "0", "--val-fraction", "0", *extra])  # fmt: skip
        assert res.exit_code == 0, res.output
        draft = save / (save / "latest").read_text().strip()
        cfg = json.loads((draft / "config.json").read_text())
        assert cfg["speculators_model_type"] == algorithm
        assert cfg["speculators_config"]["verifier"]["name_or_path"] == str(model)
        _speculators_loads(draft, algorithm)
        res = runner.invoke(spectrain_main, ["eval", "--draft", str(draft), "--verifier", str(model), "--prompts",
                                             str(prompts), "--max-new-tokens", "8", "--json", "--no-progress",
                                             "--dtype", "float32"])  # fmt: skip
        assert res.exit_code == 0, res.output
        out = json.loads(res.stdout.strip().splitlines()[-1])
        assert out["exact_match"] is True and out["num_prompts"] == 2
