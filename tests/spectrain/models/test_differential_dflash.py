"""DFlash against speculators 0.9.0's DFlashDraftModel: same masks, logits, loss and gradients.

Both models get identical fp64 weights (ours copied into the peer), the same packed sequence of
three documents plus padding, and the same anchors (the peer's ``select_anchors`` is replaced by
ours). With our options set to the peer's recipe (hard targets, D-PACE, count normalisation,
packed anchors; block attention as the peer's layer types give it) everything agrees to fp64
rounding; with any one of them set back to ours, the loss differs.
"""

from __future__ import annotations

import pytest
import torch
from _peer import (
    assert_same_tensor,
    copy_into_peer,
    fp64_heads,
    import_peer,
    layer_config,
    packed_batch,
    perturb_norms,
)

from spectrain.models import build_draft, get_config_class

core = import_peer("models.dflash.core")
peer_attention = import_peer("models.dflash.attention")
peer_utils = import_peer("models.dflash.utils")
peer_losses = import_peer("losses")

B = 4
ANCHORS = 40  # more than the packed rule allows here: every candidate is an anchor, 8 padded slots
AUX = (1, 2, 3)
DOCS, PROMPTS, PAD = [15, 13, 11], [0, 4, 3], 5  # document 0 is trained from its first token
WINDOW = 6

PEER_RECIPE = dict(target_mode="hard", loss_weighting="dpace", dpace_alpha=0.5, loss_norm="count",
                   anchor_rule="packed")  # fmt: skip
# The peer's layer types decide its block attention: full-attention layers are always
# bidirectional; sliding-attention layers with sliding_window_non_causal false (its default) are
# causal and windowed.
LAYOUTS = {
    "full": (None, dict(block_attention="bidirectional")),
    "sliding": (WINDOW, dict(block_attention="causal", sliding_window=WINDOW)),
}


@pytest.fixture(scope="module")
def heads(tiny_model_dir):
    return fp64_heads(tiny_model_dir)


@pytest.fixture(scope="module")
def batch(heads):
    return packed_batch(DOCS, PROMPTS, PAD, len(AUX), heads.hidden_size, heads.vocab_size)


def _ours(heads, **options):
    torch.manual_seed(0)
    cfg = get_config_class("dflash")(aux_layer_ids=AUX, num_layers=2, block_size=B, max_anchors=ANCHORS,
                                     mask_token_id=heads.vocab_size - 1, **options)  # fmt: skip
    model = build_draft(cfg, heads).double()
    perturb_norms(model)
    return model


def _peer(tiny_model_dir, heads, ours, window):
    layers = layer_config(tiny_model_dir, "qwen3", 2, window)
    peer = core.DFlashDraftModel.from_training_args(
        layers, verifier_name_or_path=str(tiny_model_dir), draft_vocab_size=heads.vocab_size, block_size=B,
        mask_token_id=heads.vocab_size - 1, target_layer_ids=list(AUX), draft_attn_impl="eager",
    ).double()  # fmt: skip
    copy_into_peer(ours, peer)
    assert torch.equal(peer.embed_tokens.weight, heads.embed_tokens)
    assert torch.equal(peer.verifier_lm_head.weight, heads.lm_head)
    return peer


def _peer_inputs(batch):
    S = batch.seq_len
    return dict(
        hidden_states=batch.aux_hidden.reshape(1, S, -1), input_ids=batch.input_ids[None],
        loss_mask=batch.loss_mask.long()[None], verifier_last_hidden_states=batch.last_hidden[None],
        document_ids=batch.doc_ids[None], position_ids=batch.position_ids[None],
    )  # fmt: skip


def _draw(ours, batch, monkeypatch):
    """Our anchors (drawn by our rule), padded as the peer pads them, installed in both models."""
    anchors = ours.sample_anchors(batch, torch.Generator().manual_seed(3))
    n = anchors.numel()
    padded = torch.cat([anchors, anchors.new_zeros(ANCHORS - n)])
    valid = torch.arange(ANCHORS) < n
    monkeypatch.setattr(core, "select_anchors", lambda loss_mask, num, block: (padded.clone(), valid.clone()))
    monkeypatch.setattr(ours, "draw_anchors", lambda b, g=None: (padded.clone(), valid.clone()))
    return anchors, padded, valid


def _peer_forward(peer, batch):
    loss_config = peer_losses.resolve_loss_config("ce", "eager")
    _, loss, _ = peer(**_peer_inputs(batch), loss_config=loss_config, max_anchors=ANCHORS,
                      per_position_loss_weight="dpace", dpace_alpha=0.5)  # fmt: skip
    return loss


def _grads(module, names):
    return {n: p.grad.clone() for n, p in module.named_parameters() if n in names and p.grad is not None}


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_peer_recipe_matches_speculators(tiny_model_dir, heads, batch, layout, monkeypatch):
    window, attention = LAYOUTS[layout]
    ours = _ours(heads, **PEER_RECIPE, **attention)
    peer = _peer(tiny_model_dir, heads, ours, window)
    anchors, padded, valid = _draw(ours, batch, monkeypatch)
    assert 0 < anchors.numel() < ANCHORS, "the test needs padded anchor slots"
    assert (batch.position_ids[anchors] == 0).any(), "an anchor at a document's first token (packed rule)"
    assert (anchors + B > batch.doc_ends[anchors]).any(), "a block running into the next document"

    # masks: the peer's mask_mod, dense, equals ours on the same (padded) anchor set
    S = batch.seq_len
    mod, q_len, kv_len = peer_attention.create_anchor_block_mask_mod(
        batch.doc_ids, S, padded, B, sliding_window=window, sliding_window_non_causal=False
    )
    q = torch.arange(q_len)[:, None]
    kv = torch.arange(kv_len)[None, :]
    zero = torch.zeros((), dtype=torch.long)
    theirs = mod(zero, zero, q, kv).expand(q_len, kv_len)
    docs = torch.where(valid, batch.doc_ids[padded], torch.full_like(padded, -2))
    assert torch.equal(ours._mask(batch.doc_ids, padded, docs).dense(), theirs)

    # logits and targets of the real blocks
    _, p_logits, p_targets, p_mask, _ = peer._backbone_forward(**_peer_inputs(batch), max_anchors=ANCHORS)
    n = anchors.numel()
    h, label_slots, ok = ours.block_states(batch, anchors, torch.ones(n, dtype=torch.bool))
    V = heads.vocab_size
    our_logits = h @ heads.lm_head.T
    our_targets = heads.logits(batch.last_hidden[label_slots - 1])
    assert_same_tensor(our_logits, p_logits.view(ANCHORS, B, V)[:n, 1:], "logits")
    assert_same_tensor(our_targets, p_targets.view(ANCHORS, B, V)[:n, 1:], "targets")
    assert torch.equal(ok, p_mask.view(ANCHORS, B)[:n, 1:].bool())

    # loss and gradients
    loss, _ = ours(batch)
    loss.backward()
    peer_loss = _peer_forward(peer, batch)
    peer_loss.backward()
    torch.testing.assert_close(loss, peer_loss, rtol=1e-6, atol=0)
    names = {n for n, p in ours.named_parameters() if p.requires_grad}
    ours_g, peer_g = _grads(ours, names), _grads(peer, names)
    assert set(ours_g) == set(peer_g) == names
    for name in sorted(names):
        assert_same_tensor(ours_g[name], peer_g[name], name)


@pytest.mark.parametrize(
    "option,value",
    [("target_mode", "soft"), ("loss_weighting", "exp-decay"), ("loss_norm", "weight"),
     ("block_attention", "causal")],
)  # fmt: skip
def test_each_of_our_options_differs_from_speculators(
    tiny_model_dir, heads, batch, option, value, monkeypatch
):
    recipe = {**PEER_RECIPE, "block_attention": "bidirectional", option: value}
    ours = _ours(heads, **recipe)
    peer = _peer(tiny_model_dir, heads, ours, None)
    _draw(ours, batch, monkeypatch)
    with torch.no_grad():
        loss, _ = ours(batch)
        peer_loss = _peer_forward(peer, batch)
    assert abs(float(loss) - float(peer_loss)) > 1e-3 * abs(float(peer_loss)), (
        option,
        float(loss),
        float(peer_loss),
    )


def test_anchor_rules_against_speculators(heads, batch):
    """``packed`` allows exactly the peer's anchor slots; ``document`` a strict subset of them."""
    packed = _ours(heads, anchor_rule="packed")
    document = _ours(heads, anchor_rule="document")
    anchors, ok = peer_utils.select_anchors(batch.loss_mask.long()[None], 10_000, B)
    theirs = torch.zeros(batch.seq_len, dtype=torch.bool)
    theirs[anchors[ok]] = True
    assert torch.equal(packed.anchor_candidates(batch), theirs)
    ours_doc = document.anchor_candidates(batch)
    assert (ours_doc <= theirs).all() and ours_doc.sum() < theirs.sum()
