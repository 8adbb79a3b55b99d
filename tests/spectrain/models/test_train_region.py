"""``train_region``: which slots a DFlash block or an Eagle3 chain trains on.

``loss`` trains where the loss mask says; ``greedy`` trains every slot of a document that a served
draft could reach: the label's path from the anchor (or chain start) runs through the verifier's own
greedy tokens only. Checked against a slot-by-slot count written from that definition.
"""

from __future__ import annotations

import pytest
import torch

from spectrain.data.sources import PackedLoader, StoreSource
from spectrain.models import build_draft, get_config_class
from spectrain.models.common import greedy_reach

AUX = (1, 2, 3)


@pytest.fixture(scope="module")
def greedy_batch(tiny_store, heads):
    """A packed float32 sequence whose tokens follow the verifier's greedy choice after most slots
    from the fourth position of each document on, and the verifier's argmax after every slot."""
    src = StoreSource(tiny_store, val_fraction=0.0)
    b = next(iter(PackedLoader(src, src.plan(0)[:12], total_seq_len=256, layers=[0, 1, 2, 3],
                               hidden_dtype=torch.float32)))  # fmt: skip
    greedy = torch.nn.functional.linear(heads.norm(b.last_hidden.float()), heads.lm_head.float()).argmax(-1)
    ids = b.input_ids.clone()
    for t in range(b.seq_len - 1):
        same_doc = b.doc_ids[t] >= 0 and b.doc_ids[t + 1] == b.doc_ids[t]
        if same_doc and b.position_ids[t + 1] >= 4 and t % 5 != 0:
            ids[t + 1] = greedy[t]
    b.input_ids = ids
    return b, greedy


def _model(heads, name, **kw):
    torch.manual_seed(0)
    return build_draft(
        get_config_class(name)(aux_layer_ids=AUX, target_mode="hard", loss_norm="count", **kw), heads
    )


def _agrees(b, greedy, s: int) -> bool:
    """The token after slot ``s`` is the verifier's greedy choice there."""
    return bool(b.input_ids[s + 1] == greedy[s])


def test_dflash_greedy_trains_exactly_the_reachable_slots(heads, greedy_batch):
    b, greedy = greedy_batch
    B = 4
    m = _model(heads, "dflash", block_size=B, max_anchors=10_000, num_layers=1, train_region="greedy")
    _, met = m(b, torch.Generator().manual_seed(0))
    anchors = m.last_anchors.tolist()
    assert any(not b.loss_mask[a] for a in anchors), "greedy draws anchors outside the loss mask too"
    expected = 0
    for a in anchors:
        for k in range(1, B):
            reachable = all(_agrees(b, greedy, a + j - 1) for j in range(1, k))
            expected += int(b.doc_ids[a + k] == b.doc_ids[a] and reachable)
    assert int(met["weight_sum"]) == expected
    assert 0 < expected < len(anchors) * (B - 1)


def test_dflash_loss_region_is_the_loss_mask(heads, greedy_batch):
    b, _ = greedy_batch
    m = _model(heads, "dflash", block_size=4, max_anchors=10_000, num_layers=1)
    _, met = m(b, torch.Generator().manual_seed(0))
    anchors = m.last_anchors
    assert bool(b.loss_mask[anchors].all())
    labels = anchors[:, None] + torch.arange(1, 4)[None, :]
    assert int(met["weight_sum"]) == int(b.loss_mask[labels].sum())


def test_eagle3_greedy_trains_exactly_the_reachable_slots(heads, greedy_batch):
    b, greedy = greedy_batch
    steps = 3
    m = _model(heads, "eagle3", draft_vocab_size=None, ttt_steps=steps, train_region="greedy")
    _, met = m(b, None)
    expected = 0
    for j in range(steps):
        for t in range(b.seq_len):
            lab = t + j + 2
            if b.doc_ids[t] < 0 or lab >= int(b.doc_ends[t]):
                continue
            expected += int(all(_agrees(b, greedy, t + i + 1) for i in range(j)))
    assert int(met["weight_sum"]) == expected
    loss_region = _model(heads, "eagle3", draft_vocab_size=None, ttt_steps=steps, train_region="loss")
    _, met_loss = loss_region(b, None)
    assert int(met_loss["weight_sum"]) < expected


def test_dspark_greedy_trains_exactly_the_reachable_slots(heads, greedy_batch):
    b, greedy = greedy_batch
    B = 4
    m = _model(heads, "dspark", block_size=B, max_anchors=10_000, num_layers=1, markov_rank=8,
               train_region="greedy")  # fmt: skip
    _, met = m(b, torch.Generator().manual_seed(0))
    anchors = m.last_anchors.tolist()
    assert any(not b.loss_mask[a] for a in anchors)
    expected = 0
    for a in anchors:  # anchor-first: slot i predicts the token i + 1 after the anchor
        for k in range(1, B + 1):
            if a + k >= b.seq_len or b.doc_ids[a + k] != b.doc_ids[a]:
                continue
            expected += int(all(_agrees(b, greedy, a + j - 1) for j in range(1, k)))
    assert int(met["accept_rate_total"]) == expected
    assert 0 < expected < len(anchors) * B


def test_greedy_reach_matches_its_definition():
    agree = torch.tensor([[True, False, True, True], [True, True, True, False], [False, True, True, True]])
    got = greedy_reach(agree)
    for n in range(agree.shape[0]):
        for k in range(agree.shape[1]):
            want = all(bool(agree[n, i]) for i in range(k))
            assert bool(got[n, k]) == want, (n, k)


def test_train_region_is_checked(heads):
    for name in ("dflash", "dspark", "eagle3"):
        with pytest.raises(ValueError, match="train_region"):
            _model(heads, name, train_region="everywhere")
    assert get_config_class("eagle3")().train_region == "greedy"
    assert get_config_class("dflash")().train_region == get_config_class("dspark")().train_region == "loss"
    with pytest.raises(ValueError, match="loss_mask_on: 'source' applies to train_region 'loss'"):
        get_config_class("eagle3")(loss_mask_on="source")
    assert get_config_class("eagle3")(loss_mask_on="source", train_region="loss").loss_mask_on == "source"
    eagle3 = get_config_class("eagle3")
    assert eagle3.from_dict({}).train_region == "greedy"
    # options naming the loss mask's slot (a checkpoint's from before train_region, or --loss-mask-on) train
    # the loss region, the one that option applies to; naming both is the caller's choice, checked as such
    assert eagle3.from_dict({"loss_mask_on": "source", "ttt_steps": 3}).train_region == "loss"
    with pytest.raises(ValueError, match="applies to train_region 'loss'"):
        eagle3.from_dict({"loss_mask_on": "source", "train_region": "greedy"})
