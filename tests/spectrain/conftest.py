"""Fixtures for spectrain tests: a store of real hidden states from the tiny verifier.

The store is built by running the tiny Qwen3 model with transformers (no server): layer id
``k`` is the residual stream entering decoder layer ``k`` (``output_hidden_states[k]``), and id
``L`` is the last layer's output before the final norm (captured with a forward hook).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

STORE_LAYERS = (1, 2, 3, 4)


def _bf16_storage(t: torch.Tensor) -> np.ndarray:
    return t.to(torch.bfloat16).contiguous().view(torch.uint16).numpy()


def build_store(path: Path, model_dir: Path, n_samples: int, *, layers=STORE_LAYERS, id_prefix: str = "s",
                start: int = 0):  # fmt: skip
    """Render sample chats, run the tiny model, write hidden states of ``layers`` into a store at ``path``."""
    from transformers import AutoModelForCausalLM

    from hsgen.inputs.render import ChatRenderer, RenderConfig
    from hsgen.inputs.sample_data import iter_sample_chats
    from hsgen.store import HiddenStateStore, StoreHeader

    torch.set_num_threads(1)
    renderer = ChatRenderer(RenderConfig(tokenizer_path=str(model_dir), max_len=160))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    L = model.config.num_hidden_layers
    captured = {}
    hook = model.model.layers[-1].register_forward_hook(
        lambda m, i, o: captured.__setitem__("last", o[0] if isinstance(o, tuple) else o)
    )
    header = StoreHeader(verifier=str(model_dir), layer_ids=tuple(layers), hidden_size=model.config.hidden_size,
                         dtype="bfloat16")  # fmt: skip
    store = HiddenStateStore.create(path, header)
    rows = list(iter_sample_chats(limit=start + n_samples))[start:]
    with store.writer(f"fixture-{id_prefix}-{start}") as w, torch.no_grad():
        for i, row in enumerate(rows):
            ids, mask = renderer.render_messages(row["messages"])
            ids, mask = ids[:160], mask[:160]
            out = model(torch.tensor([ids]), output_hidden_states=True)
            states = []
            for k in layers:
                h = captured["last"][0] if k == L else out.hidden_states[k][0]
                states.append(h)
            hs = torch.stack(states, dim=1)  # [T, n_layers, H]
            w.add(
                f"{id_prefix}{start + i:05d}",
                _bf16_storage(hs),
                np.asarray(ids, np.int64),
                np.asarray(mask, np.uint8),
            )
    hook.remove()
    store.refresh()
    return store


@pytest.fixture(scope="session")
def tiny_store(tmp_path_factory, tiny_model_dir) -> Path:
    """A store of 48 sample conversations (layers 1, 2, 3 aux + 4 = last) from the tiny verifier."""
    path = tmp_path_factory.mktemp("spectrain") / "store"
    build_store(path, tiny_model_dir, 48)
    return path
