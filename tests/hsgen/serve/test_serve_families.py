"""``hsgen serve``'s hidden states for every verifier family follow vLLM's layer ids.

id ``k < L`` is the residual stream entering decoder layer ``k`` (transformers'
``output_hidden_states[k]``; id 0 is the embeddings as the model itself scales them, Gemma's
``sqrt(hidden_size)`` included), id ``L`` the last decoder layer's output before the final norm
(transformers' last entry is after it). For a multimodal wrapper the layers are its language
model's. Compared here on a batch of unequal lengths (right padding) against one plain forward
per sequence, with sliding-window and linear-attention layers among the families.
"""

from __future__ import annotations

import pytest
import torch

from _families import CASES, LAYERS
from hsgen.hf.causal_lm import load_causal_lm
from hsgen.serve.hidden import HiddenStateExtractor, load_model

NAMES = [c.name for c in CASES if c.name != "llama_tied"]
SEQS = [[1, 5, 9, 300, 7, 2, 44, 45, 46, 47, 48, 100, 101, 102], [640, 641, 642, 643, 644], [12]]


def _reference(model, seq):
    captured = {}
    handle = (
        model.get_decoder()
        .layers[-1]
        .register_forward_hook(lambda m, i, o: captured.__setitem__("h", o[0] if isinstance(o, tuple) else o))
    )
    with torch.no_grad():
        out = model(input_ids=torch.tensor([seq]), output_hidden_states=True, use_cache=False)
    handle.remove()
    states = out.hidden_states
    assert len(states) == LAYERS + 1
    return [states[k][0] for k in range(LAYERS)] + [captured["h"][0]], states[LAYERS][0], out.logits[0, -1]


@pytest.mark.parametrize("name", NAMES)
def test_layer_ids_follow_vllm_for_every_family(family_model, name):
    torch.set_num_threads(1)
    path = family_model(name)
    loaded = load_model(str(path), dtype="float32")
    assert loaded.num_hidden_layers == LAYERS and loaded.hidden_size == 64
    extractor = HiddenStateExtractor(loaded, list(range(LAYERS + 1)))
    try:
        outputs = extractor.forward(SEQS)
    finally:
        extractor.close()
    plain = load_causal_lm(path, torch.float32).eval()
    for seq, out in zip(SEQS, outputs, strict=True):
        expected, hf_last, logits = _reference(plain, seq)
        assert out.hidden_states.shape == (len(seq), LAYERS + 1, 64)
        for k, ref in enumerate(expected):
            got = out.hidden_states[:, k]
            assert torch.allclose(got, ref, rtol=1e-4, atol=1e-4 * float(ref.abs().max())), (name, k)
        assert float(out.hidden_states[:, 1:].abs().max()) > 0, "all-zero layer states"
        # transformers' last entry is after the final norm: id L is not it
        assert not torch.allclose(out.hidden_states[:, LAYERS], hf_last, atol=1e-3)
        assert out.next_token == int(logits.argmax())
