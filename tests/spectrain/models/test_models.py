"""DFlash and Eagle3: masks, anchors, flex vs SDPA, overfitting, propose() vs training, vocab maps."""

from __future__ import annotations

import math

import pytest
import torch

from spectrain.data.sources import Batch, PackedLoader, StoreSource
from spectrain.models import DraftContext, available, build_draft, get_config_class
from spectrain.models.common import build_vocab_map, default_dflash_gamma, loss_decay_weights
from spectrain.models.dflash import dflash_mask
from spectrain.models.eagle3 import ttt_mask
from spectrain.models.verifier import VerifierHeads

AUX = (1, 2, 3)


@pytest.fixture(scope="module")
def sharp_heads(heads):
    """The tiny verifier with a 25x LM head: its random-init distributions become peaked, so
    greedy targets are learnable in a few dozen steps (a real verifier's already are)."""
    return VerifierHeads(heads.info, heads.embed_tokens, heads.norm_weight, heads.lm_head * 25)


@pytest.fixture(scope="module")
def batches(tiny_store) -> list[Batch]:
    src = StoreSource(tiny_store, val_fraction=0.0)
    return list(PackedLoader(src, src.plan(0)[:12], total_seq_len=256, layers=[0, 1, 2, 3],
                             hidden_dtype=torch.bfloat16))  # fmt: skip


def _model(heads, name, **kw):
    torch.manual_seed(0)
    return build_draft(get_config_class(name)(aux_layer_ids=AUX, **kw), heads)


def test_registry():
    assert {"dflash", "eagle3"} <= set(available())
    with pytest.raises(ValueError, match="unknown speculator type"):
        get_config_class("medusa9")
    with pytest.raises(ValueError, match="block_sizee"):
        get_config_class("dflash").from_dict({"block_sizee": 4})


def test_gamma_and_decay():
    assert (default_dflash_gamma(16), default_dflash_gamma(10), default_dflash_gamma(8)) == (7.0, 5.0, 4.0)
    w = loss_decay_weights(15, 7.0)
    assert w[0] == 1.0 and math.isclose(float(w[14]), math.exp(-14 / 7), rel_tol=1e-6)


def test_vocab_map():
    counts = torch.tensor([5, 0, 9, 9, 1, 0, 7], dtype=torch.float64)
    d2t, t2d = build_vocab_map(counts, 4)
    targets = torch.arange(4) + d2t
    assert targets.tolist() == [0, 2, 3, 6]  # the 4 most frequent, in id order
    assert t2d.tolist() == [True, False, True, True, False, False, True]
    d2t, _ = build_vocab_map(torch.zeros(7), 3)
    assert (torch.arange(3) + d2t).tolist() == [0, 1, 2]  # ties go to the lower id


def test_dflash_mask_matches_definition():
    doc = torch.tensor([0] * 9 + [1] * 8 + [-1] * 3)
    anchors = torch.tensor([2, 5, 10, 13])
    B = 3
    spec = dflash_mask(doc, anchors, doc[anchors], B)
    dense = spec.dense()
    S = doc.numel()
    for q in range(spec.q_len):
        n = q // B
        for kv in range(spec.kv_len):
            if kv < S:
                want = bool(doc[kv] == doc[anchors[n]] and kv < anchors[n])
            else:
                want = (kv - S) // B == n
            assert bool(dense[q, kv]) == want, (q, kv)


def test_ttt_mask_matches_definition():
    doc = torch.tensor([0] * 4 + [1] * 3 + [-1])
    S = doc.numel()
    dense = ttt_mask(doc, 2).dense()
    assert dense.shape == (S, 3 * S)
    for t in range(S):
        for kv in range(3 * S):
            step, s = divmod(kv, S)
            want = (doc[s] == doc[t] and s <= t) if step == 0 else s == t
            assert bool(dense[t, kv]) == bool(want), (t, kv)


def test_anchor_rules(heads, batches):
    m = _model(heads, "dflash", block_size=4, max_anchors=8, num_layers=1)
    b = batches[0]
    g = torch.Generator().manual_seed(1)
    a = m.sample_anchors(b, g)
    assert 0 < a.numel() <= 8 and torch.equal(a, a.sort().values)
    assert b.loss_mask[a].all() and (a + 4 <= b.doc_ends[a]).all() and (b.position_ids[a] >= 1).all()
    assert torch.equal(a, m.sample_anchors(b, torch.Generator().manual_seed(1)))
    many = _model(heads, "dflash", block_size=4, max_anchors=10_000, num_layers=1).sample_anchors(b)
    ok = b.loss_mask & (b.doc_ids >= 0) & (torch.arange(b.seq_len) + 4 <= b.doc_ends) & (b.position_ids >= 1)
    assert torch.equal(many, ok.nonzero().flatten())


@pytest.mark.parametrize("name,kw", [("dflash", dict(block_size=4, max_anchors=12, num_layers=2)),
                                     ("eagle3", dict(draft_vocab_size=300, ttt_steps=2))])  # fmt: skip
def test_flex_and_sdpa_agree(heads, batches, name, kw):
    m = _model(heads, name, **kw)
    b = batches[0]
    with torch.no_grad():  # FlexAttention has no CPU backward; CUDA runs it with gradients
        m.cfg.attention_backend = "sdpa"
        loss_a, met_a = m(b, torch.Generator().manual_seed(0))
        m.cfg.attention_backend = "flex"
        loss_b, met_b = m(b, torch.Generator().manual_seed(0))
    assert torch.allclose(loss_a, loss_b, atol=1e-5)
    assert torch.equal(met_a["acc_total"], met_b["acc_total"])


@pytest.mark.parametrize("name,kw", [("dflash", dict(block_size=4, max_anchors=64, num_layers=1)),
                                     ("eagle3", dict(draft_vocab_size=400, ttt_steps=2))])  # fmt: skip
def test_overfit_loss_decreases(sharp_heads, batches, name, kw):
    m = _model(sharp_heads, name, target_mode="hard", **kw)
    counts = torch.bincount(batches[0].input_ids, minlength=sharp_heads.vocab_size)
    m.prepare(counts)
    opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=3e-2)
    b = batches[0]
    first, acc0 = None, None
    for i in range(60):
        loss, met = m(b, torch.Generator().manual_seed(i % 2))
        if first is None:
            first, acc0 = loss.item(), float(met["acc_correct"][0] / met["acc_total"][0])
        opt.zero_grad()
        loss.backward()
        opt.step()
    loss, met = m(b, torch.Generator().manual_seed(0))
    acc = float(met["acc_correct"][0] / met["acc_total"][0])
    assert float(loss) < 0.6 * first, (first, float(loss))
    assert acc > acc0 + 0.05, (acc0, acc)
    assert 1.0 <= 1 + float(met["accepted_sum"] / met["chains"]) <= 1 + met["acc_total"].numel()


def test_frozen_verifier_is_not_trained(heads, batches):
    m = _model(heads, "dflash", block_size=4, max_anchors=8, num_layers=1)
    names = {n for n, _ in m.named_parameters()}
    assert not any("embed" in n or "lm_head" in n for n in names)
    before = heads.lm_head.clone()
    loss, _ = m(batches[0])
    loss.backward()
    assert heads.lm_head.grad is None and torch.equal(before, heads.lm_head)


def test_dflash_propose_equals_training_prediction(heads, batches):
    m = _model(heads, "dflash", block_size=4, max_anchors=10_000, num_layers=2).eval()
    b = batches[0]
    with torch.no_grad():
        m(b)
    anchors, preds = m.last_anchors, m.last_predictions
    assert preds.shape == (anchors.numel(), 3)
    docs = b.doc_ids[anchors]
    pick = int((docs == docs.max()).nonzero()[0])  # an anchor in the last document: isolation is exercised
    a = int(anchors[pick])
    start = a - int(b.position_ids[a])
    aux = b.aux_hidden[start:a].reshape(a - start, -1).float()
    tokens = b.input_ids[start : a + 1].tolist()
    got = m.propose(DraftContext(aux, tokens))
    assert got == preds[pick].tolist()
    assert m.propose(DraftContext(aux, tokens), 2) == got[:2]
    with pytest.raises(ValueError, match="T \\+ 1"):
        m.propose(DraftContext(aux, tokens[:-1]))


def test_eagle3_propose_equals_training_chain(heads, batches):
    m = _model(heads, "eagle3", draft_vocab_size=500, ttt_steps=3).eval()
    b = batches[0]
    doc_len = int(b.doc_ends[0])
    T = doc_len - 6
    aux = b.aux_hidden[:T].reshape(T, -1).float()
    ctx_tokens = b.input_ids[: T + 1].tolist()
    chain = m.propose(DraftContext(aux, ctx_tokens), 3)
    assert len(chain) == 3 and all(0 <= t < heads.vocab_size for t in chain)
    # A document whose tokens after the bonus are the draft's own chain: TTT step j at T-1 must
    # then see exactly what the chain saw, so the training predictions repeat the chain.
    ids = b.input_ids.clone()
    ids[T + 1 : T + 3] = torch.tensor(chain[:2])
    doctored = Batch(ids, b.loss_mask, b.position_ids, b.doc_ids, b.doc_ends, b.hidden_states)
    with torch.no_grad():
        m(doctored)
    assert m.last_predictions[T - 1].tolist() == chain


def test_eagle3_needs_three_aux_layers(heads):
    with pytest.raises(ValueError, match="exactly 3"):
        build_draft(get_config_class("eagle3")(aux_layer_ids=(1, 2)), heads)
