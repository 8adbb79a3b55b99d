"""Our drafts served by the real vLLM: the method it resolves, DFlash's attention per layer, and the
acceptance it measures against ``spectrain eval`` (``scripts/bench_vllm_parity.py --quick``)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from _tier_util import env

from spectrain.export.read import draft_config_from_export, read_export_config
from spectrain.export.write import serve_hint, speculative_config_for

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(3600)]  # fixtures start vLLM and train drafts

ROOT = Path(__file__).resolve().parents[2]
KINDS = {
    "dflash": ("dflash", "bidirectional"),
    "dflash_causal": ("dflash", "causal"),
    "eagle3": ("eagle3", None),
}


@pytest.fixture(scope="module")
def parity(vllm_py, vllm_model_dir, tmp_path_factory):
    """One run of the parity benchmark (all three drafts): ``(figures, work dir)``."""
    work = tmp_path_factory.mktemp("parity")
    cmd = [sys.executable, str(ROOT / "scripts" / "bench_vllm_parity.py"), "--quick", "--causal", "--work", str(work),
           "--vllm-venv", str(vllm_py.parents[1])]  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=3600, env=env())
    assert r.returncode == 0, r.stderr[-4000:]
    return json.loads(r.stdout.strip().splitlines()[-1]), work


def _checkpoint(work: Path, name: str) -> Path:
    save = work / f"draft-{name}"
    return save / (save / "latest").read_text().strip()


@pytest.mark.parametrize("name", sorted(KINDS))
def test_served_acceptance_equals_spectrain_eval(parity, name):
    figures, _ = parity
    assert figures["exact_match"] is True
    served, ours = figures[f"{name}_vllm_tau"], figures[f"{name}_spectrain_tau"]
    assert figures[f"{name}_drafts"] > 0 and served >= 1.0
    assert abs(served - ours) <= 0.02, f"{name}: vLLM tau {served} vs spectrain eval {ours}"
    for a, b in zip(figures[f"{name}_vllm_acceptance"], figures[f"{name}_spectrain_acceptance"], strict=True):
        assert abs(a - b) <= 0.03, (
            figures[f"{name}_vllm_acceptance"],
            figures[f"{name}_spectrain_acceptance"],
        )


@pytest.fixture(scope="module")
def resolved(parity, vllm_py, vllm_model_dir, tmp_path_factory):
    """What vLLM's own config code resolves for each export, with the method as our hint names it,
    and for a copy of the DFlash export at a ``checkpoint-N`` path given without a method (one
    process for all: importing vLLM is slow)."""
    import shutil

    _, work = parity
    cases = {}
    for name in KINDS:
        draft = _checkpoint(work, name)
        cases[name] = {"draft": str(draft), "spec": speculative_config_for(draft, read_export_config(draft))}
    bare = tmp_path_factory.mktemp("run") / _checkpoint(work, "dflash").name  # our default layout
    shutil.copytree(_checkpoint(work, "dflash"), bare)
    cases["no_method"] = {"draft": str(bare), "spec": {"model": str(bare), "num_speculative_tokens": 3}}
    r = subprocess.run([str(vllm_py), str(Path(__file__).with_name("_vllm_resolve.py")), str(vllm_model_dir),
                        json.dumps(cases)], capture_output=True, text=True, timeout=900)  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    return cases, json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", sorted(KINDS))
def test_vllm_resolves_the_trained_method_and_attention(parity, resolved, name):
    _, work = parity
    algorithm, attention = KINDS[name]
    draft = _checkpoint(work, name)
    config = read_export_config(draft)
    spec = speculative_config_for(draft, config)
    assert spec["method"] == algorithm and f'"method": "{algorithm}"' in serve_hint(draft, config, "M")
    out = resolved[1][name]
    assert "error" not in out, out
    assert out["bare"]["method"] == algorithm  # vllm serve <draft>
    assert out["flag"]["method"] == algorithm  # --speculative-config as our hint writes it
    assert out["flag"]["num_speculative_tokens"] == spec["num_speculative_tokens"]
    if algorithm != "dflash":
        return
    trained = json.loads((draft / "trainer" / "train_config.json").read_text())
    draft_cfg, _ = draft_config_from_export(config, 10**6)
    assert draft_cfg.block_attention == attention  # what spectrain eval builds
    assert json.dumps(trained).count(f'"block_attention": "{attention}"') >= 1  # what the trainer used
    layers = out["dflash_layers"]
    assert len(layers) == config["transformer_layer_config"]["num_hidden_layers"]
    assert all(causal is (attention == "causal") for _window, causal in layers), layers  # vLLM's layers
    assert out["dflash_proposer_causal"] is (attention == "causal")  # the mask vLLM's proposer asks for
    assert out["dflash_target_layer_ids"] == [i - 1 for i in config["aux_hidden_state_layer_ids"]]


def test_without_the_method_vllm_serves_a_plain_draft_model(resolved):
    """Why every hint names the method: a checkpoint-N path given without it is a plain draft model."""
    cases, out = resolved
    assert "dflash" not in cases["no_method"]["draft"].lower()
    assert out["no_method"].get("error") is None, out["no_method"]
    assert out["no_method"]["flag"]["method"] == "draft_model"
    assert out["no_method"]["bare"]["method"] == "dflash"  # vllm serve <draft> reads speculators_model_type
