"""DFlash's decode-time proposals with FlexAttention: one compiled kernel per context bucket.

On a GPU ``propose`` calls the compiled FlexAttention, which is specialised to its key length;
the context grows by a few tokens every decode step, so without padding every step compiled
again until dynamo's cache was full, then ran unfused. Here the compiled path is taken on CPU
(dynamo with a counting backend in place of inductor) and the compiles are counted.
"""

from __future__ import annotations

import functools

import pytest
import torch
from _tiny_drafts import H, V, heads

from spectrain.models import DraftContext, build_draft, get_config_class, layers

torch.set_num_threads(1)
CONTEXTS = list(range(3, 300, 23))  # a decode loop's growing contexts: 13 lengths, 3 buckets


def _dflash(backend: str):
    torch.manual_seed(0)
    cfg = get_config_class("dflash")(
        aux_layer_ids=(1, 2, 3), num_layers=1, block_size=4, attention_backend=backend
    )
    return build_draft(cfg, heads()).eval()


def _context(T: int, seed: int) -> DraftContext:
    g = torch.Generator().manual_seed(seed)
    return DraftContext(
        torch.randn(T, 3 * H, generator=g), torch.randint(0, V, (T + 1,), generator=g).tolist()
    )


def test_buckets():
    got = [layers.context_bucket(n) for n in (1, 127, 128, 129, 256, 257, 5000)]
    assert got == [128, 128, 128, 256, 256, 512, 8192]
    assert len({layers.context_bucket(n) for n in range(1, 8193)}) == 7


@pytest.mark.filterwarnings("ignore::UserWarning")  # eager flex on CPU: unfused, as intended here
def test_padded_flex_proposals_equal_sdpa_ones():
    flex, sdpa = _dflash("flex"), _dflash("sdpa")
    sdpa.load_state_dict(flex.state_dict())
    for i, T in enumerate(CONTEXTS[::3]):
        ctx = _context(T, i)
        assert flex.propose(ctx) == sdpa.propose(ctx), T


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_growing_context_reuses_the_compiled_kernel(monkeypatch):
    from torch._dynamo.testing import CompileCounter
    from torch.nn.attention.flex_attention import flex_attention

    torch._dynamo.reset()
    counter = CompileCounter()
    compiled = torch.compile(flex_attention, backend=counter, dynamic=False)
    monkeypatch.setattr(layers, "compiled_flex_for", lambda q: not torch.compiler.is_compiling())
    monkeypatch.setattr(layers, "_compiled_flex", functools.cache(lambda: compiled))
    model = _dflash("flex")
    kv_lengths = []
    attend = layers.attend

    def spy(q, k, v, spec, backend, **kw):
        kv_lengths.append(k.shape[1])
        return attend(q, k, v, spec, backend, **kw)

    monkeypatch.setattr(layers, "attend", spy)
    for i, T in enumerate(CONTEXTS):
        model.propose(_context(T, i))
    buckets = {layers.context_bucket(T) for T in CONTEXTS}
    assert len(set(kv_lengths)) == len(buckets) == 3  # 13 contexts, 3 key lengths
    assert counter.frame_count == len(buckets)
    torch._dynamo.reset()
