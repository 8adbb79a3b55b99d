"""DSpark exports read by the real vLLM 0.32: its speculators config parser, its DSpark model class and
its own weight loading (vLLM runs DSpark only in its V2 GPU runner, so on the CPU build the config
parse, the weight mapping and the two heads are what can be checked; docs/vllm.md says how to
serve it on a GPU).

A draft trained by ``spectrain train --speculator-type dspark`` and exported by ``spectrain export``,
and exports of the other layouts, are resolved by ``_vllm_dspark.py`` in the vLLM venv: method
``dspark``, architecture ``Qwen3DSparkModel``, the token count; every weight vLLM loads equals the
file's; vLLM's Markov bias and confidence on a probe equal ours. A gated export, which spectrain
refuses to write for vLLM, is shown to fail vLLM's own loading.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _tier_util import env
from safetensors.torch import save_file

from hsgen.vllm.server import free_port
from spectrain.eval.decode import load_exported_draft
from spectrain.export.write import export_draft
from spectrain.models import build_draft, get_config_class
from spectrain.models.verifier import VerifierHeads

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1800)]

ROOT = Path(__file__).resolve().parents[2]
AUX = (1, 2, 3)
RANK = 16


def _build_store(path: Path, model_dir: Path, n: int) -> None:
    spec = importlib.util.spec_from_file_location(
        "_spectrain_fixtures", ROOT / "tests" / "spectrain" / "conftest.py"
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.build_store(path, model_dir, n)


def _export(model_dir: Path, out: Path, for_vllm: bool = True, **options) -> Path:
    torch.manual_seed(0)
    heads = VerifierHeads.load(model_dir)
    cfg = get_config_class("dspark")(
        aux_layer_ids=AUX, num_layers=1, block_size=4, markov_rank=RANK, **options
    )
    model = build_draft(cfg, heads)
    if model.reduced:
        model.prepare(torch.arange(heads.vocab_size, 0, -1, dtype=torch.float64))
    return export_draft(model, out, verifier_name="org/tiny", for_vllm=for_vllm)


@pytest.fixture(scope="module")
def drafts(vllm_py, vllm_model_dir, tmp_path_factory):
    """``{case: draft dir}``, and what vLLM's code made of each (one vLLM process for all)."""
    work = tmp_path_factory.mktemp("dspark")
    _build_store(work / "store", vllm_model_dir, 16)
    save = work / "run"
    cmd = [sys.executable, "-m", "spectrain.cli", "train", "--store", str(work / "store"), "--verifier",
           str(vllm_model_dir), "--speculator-type", "dspark", "--save-path", str(save), "--total-seq-len", "256",
           "--max-steps", "3", "--save-every", "0", "--num-workers", "0", "--val-fraction", "0", "--block-size", "4",
           "--max-anchors", "16", "--num-layers", "1", "--markov-rank", str(RANK), "--target-layer-ids", "1 2 3"]  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env())
    assert r.returncode == 0, r.stderr[-3000:]
    ckpt = save / (save / "latest").read_text().strip()
    r = subprocess.run([sys.executable, "-m", "spectrain.cli", "export", str(ckpt), str(work / "trained"),
                        "--verifier-name", "org/tiny"], capture_output=True, text=True, timeout=300, env=env())  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    cases = {
        "trained": work / "trained",
        "fill_in": _export(vllm_model_dir, work / "fill_in", sample_from_anchor=False),
        "reduced": _export(vllm_model_dir, work / "reduced", draft_vocab_size=300),
        "no_confidence": _export(vllm_model_dir, work / "no_confidence", enable_confidence_head=False),
        "gated": _export(vllm_model_dir, work / "gated", for_vllm=False, markov_head_type="gated"),
    }
    heads = VerifierHeads.load(vllm_model_dir)
    g = torch.Generator().manual_seed(3)
    probe = {"hidden": torch.randn(5, heads.hidden_size, generator=g),
             "prev": torch.randint(0, heads.vocab_size, (5,), generator=g)}  # fmt: skip
    save_file(probe, str(work / "probe.safetensors"))
    r = subprocess.run([str(vllm_py), str(Path(__file__).with_name("_vllm_dspark.py")), str(vllm_model_dir),
                        json.dumps({k: str(v) for k, v in cases.items()}), str(work / "probe.safetensors"),
                        str(free_port())], capture_output=True, text=True, timeout=900)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    return cases, json.loads(r.stdout.strip().splitlines()[-1]), probe


@pytest.mark.parametrize(("case", "tokens", "anchor_first"),
                         [("trained", 4, True), ("fill_in", 3, False), ("reduced", 4, True),
                          ("no_confidence", 4, True)])  # fmt: skip
def test_vllm_parses_and_loads_the_export(drafts, vllm_model_dir, case, tokens, anchor_first):
    cases, resolved, probe = drafts
    got = resolved[case]
    assert "error" not in got and "load_error" not in got, got
    assert got["bare"] == got["flag"] == {"method": "dspark", "num_speculative_tokens": tokens}
    hf = got["hf"]
    assert hf["architectures"] == ["Qwen3DSparkModel"]
    assert (hf["sample_from_anchor"], hf["dspark_bonus_anchor"]) == (anchor_first, not anchor_first)
    assert (hf["markov_rank"], hf["markov_head_type"], hf["block_size"]) == (RANK, "vanilla", 4)
    assert hf["target_layer_ids"] == [i - 1 for i in AUX]
    confidence = case != "no_confidence"
    assert hf["enable_confidence_head"] is confidence and hf["confidence_head_with_markov"] is confidence
    assert got["same_weights"] and all(got["same_weights"].values()), got["same_weights"]
    loaded = set(got["loaded"])
    assert {"model.markov_head.markov_w1.weight", "model.markov_head.markov_w2.weight"} <= loaded
    assert ("model.confidence_head.proj.weight" in loaded) is confidence
    if case == "reduced":
        assert got["hf"]["draft_vocab_size"] == 300 and "d2t" in got["same_weights"]
    # vLLM's heads on the probe equal ours, loaded from the same file
    model = load_exported_draft(cases[case], vllm_model_dir).model
    with torch.no_grad():
        emb = model.markov_head.embed(probe["prev"])
        ours = model.markov_head.bias(emb)
        torch.testing.assert_close(torch.tensor(got["bias"]), ours, rtol=1e-5, atol=1e-6)
        if confidence:
            conf = torch.sigmoid(model.confidence_head(probe["hidden"], emb))
            torch.testing.assert_close(torch.tensor(got["confidence"]), conf, rtol=1e-5, atol=1e-6)


def test_vllm_has_nowhere_to_load_a_gated_head(drafts):
    """Why spectrain refuses a gated export for vLLM: vLLM's own loading fails on it."""
    _, resolved, _ = drafts
    got = resolved["gated"]
    assert got["bare"]["method"] == "dspark"
    assert "no module or parameter named 'markov_head." in got.get("load_error", ""), got
