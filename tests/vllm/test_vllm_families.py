"""A second verifier family on the real vLLM: a tiny random Gemma 4 (``gemma4_text``: embeddings scaled by
sqrt(hidden), per-layer inputs, sliding-window and global layers of their own head sizes) served by vLLM's CPU build with hidden-state
extraction, ``hsgen generate`` storing what vLLM writes, and every stored layer id compared with transformers'
own forward of the same token ids: ids 1..3 are ``output_hidden_states[k]``, the last id the last decoder
layer's output before the final norm (vLLM's convention, issue 19)."""

from __future__ import annotations

import numpy as np
import pytest
from _tier_util import LAYERS, generate_cmd, rel_err, run_json, write_chats

from hsgen.store import HiddenStateStore

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(3600)]  # starts vLLM


@pytest.fixture(scope="module")
def gemma4_dir(tmp_path_factory, vllm_model_dir):
    """The matrix's Gemma 4 text model with head sizes 32 (vLLM's CPU attention refuses 16).

    Not Gemma 2 / 3: vLLM 0.32 extracts hidden states through the Eagle3 interface, which its
    ``Gemma3ForCausalLM`` lacks ("Model does not support EAGLE3 interface but
    aux_hidden_state_outputs was requested" at start-up; docs/families.md)."""
    import dataclasses

    from _families import BY_NAME, build_family_model

    case = BY_NAME["gemma4_text"]
    case = dataclasses.replace(
        case, name="gemma4_text_vllm", text=dict(case.text, head_dim=32, global_head_dim=32)
    )
    return build_family_model(case, tmp_path_factory.mktemp("gemma4") / "model", vllm_model_dir)


def _reference(model_dir, token_ids: list[int]) -> np.ndarray:
    """``[T, len(LAYERS), H]`` in float32 from transformers: vLLM's layer ids on the same ids."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    captured = {}
    last = model.get_decoder().layers[-1]
    handle = last.register_forward_hook(
        lambda m, i, o: captured.__setitem__("h", o[0] if isinstance(o, tuple) else o)
    )
    with torch.no_grad():
        out = model(input_ids=torch.tensor([token_ids]), output_hidden_states=True, use_cache=False)
    handle.remove()
    per_id = [out.hidden_states[k][0] if k < len(out.hidden_states) - 1 else captured["h"][0] for k in LAYERS]
    return torch.stack(per_id, dim=1).numpy()


def test_gemma4_hidden_states_from_vllm_equal_transformers(
    vllm_extraction, gemma4_dir, shared_root, sample_chats_path, tmp_path
):
    data = tmp_path / "chats.jsonl"
    ids = write_chats(sample_chats_path, data, 4)
    shared = shared_root / "gemma4"
    shared.mkdir()
    store = tmp_path / "store"
    with vllm_extraction(gemma4_dir, shared, tmp_path / "vllm.log") as server:
        r, summary = run_json(generate_cmd(data, store, server.url, shared, gemma4_dir, LAYERS))
        assert r.returncode == 0, r.stderr[-3000:] + server.log_tail()
    assert summary["stored"] == len(ids) and summary["failed"] == 0, summary
    st = HiddenStateStore.open(store)
    assert st.verify() == [] and sorted(st.sample_ids()) == sorted(ids)
    for sid in ids:
        got = st.read(sid)
        want = _reference(gemma4_dir, got.token_ids.tolist())
        states = got.hidden_states.astype(np.float32)
        assert states.shape == want.shape
        assert float(np.abs(states).max()) > 0, "all-zero hidden states"
        for j, layer in enumerate(LAYERS):
            err = rel_err(states[:, j], want[:, j])
            # the store keeps bf16: vLLM's fp32 states rounded once, on top of kernel differences
            assert err <= 2**-6, f"{sid}: layer id {layer} differs from transformers by {err:.2e} (relative)"
