"""DSpark against speculators 0.9.0's DSparkDraftModel: masks, Markov-corrected logits, confidence
logits, loss and gradients, for every Markov head type and both block layouts.

Both models get identical fp64 weights (ours copied into the peer), the same packed sequence and
the same anchors (the peer's ``select_anchors`` replaced by ours). The peer's own inputs to its
loss (corrected logits, confidence logits, slot mask) are read where it computes the loss. With
our options set to the peer's (:data:`PEER_RECIPE`) everything agrees to fp64 rounding (the
peer's KL and TV run in fp32 inside an fp64 model). Two differences are ours by default and named
by a test each: an anchor-first slot is gated by the token it predicts (speculators gates it by
its own input token: its PR #865), and an anchor is drawn only where its first label is trained.
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

from spectrain.data.batch import Batch
from spectrain.models import build_draft, get_config_class

dflash_core = import_peer("models.dflash.core")
dspark_core = import_peer("models.dspark.core")
peer_attention = import_peer("models.dflash.attention")
peer_losses = import_peer("losses")

B = 4
RANK = 8
ANCHORS = 40
AUX = (1, 2, 3)
DOCS, PROMPTS, PAD = [15, 13, 11], [0, 4, 3], 5
HOLE = (8, 10)
"""Slots of document 0 whose loss mask is 0 (a user turn inside a conversation)."""

PEER_RECIPE = dict(anchor_rule="packed", slot_mask="input", anchor_needs_label=False, loss_norm="count",
                   loss_weighting="exp-decay", loss_gamma=4.0, target_mode="soft")  # fmt: skip
LOSSES = {"kl_div": "kl_div", "deepspec": '{"ce": 0.1, "tv": 1.8}'}


@pytest.fixture(scope="module")
def heads(tiny_model_dir):
    return fp64_heads(tiny_model_dir)


@pytest.fixture(scope="module")
def batch(heads):
    b = packed_batch(DOCS, PROMPTS, PAD, len(AUX), heads.hidden_size, heads.vocab_size)
    mask = b.loss_mask.clone()
    mask[HOLE[0] : HOLE[1]] = False
    return Batch(b.input_ids, mask, b.position_ids, b.doc_ids, b.doc_ends, b.hidden_states)


def _ours(heads, kind="vanilla", anchor_first=True, **options):
    torch.manual_seed(0)
    cfg = get_config_class("dspark")(aux_layer_ids=AUX, num_layers=2, block_size=B, max_anchors=ANCHORS,
                                     mask_token_id=heads.vocab_size - 1, markov_rank=RANK, markov_head_type=kind,
                                     sample_from_anchor=anchor_first, **options)  # fmt: skip
    model = build_draft(cfg, heads).double()
    perturb_norms(model)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():  # heads away from their init, so that every term of theirs shows
        for name, p in model.named_parameters():
            if name.startswith(("markov_head", "confidence_head")):
                p.copy_(0.2 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return model


def _peer(tiny_model_dir, heads, ours):
    cfg = ours.cfg
    peer = dspark_core.DSparkDraftModel.from_training_args(
        layer_config(tiny_model_dir, "qwen3", 2), verifier_name_or_path=str(tiny_model_dir),
        draft_vocab_size=heads.vocab_size, block_size=B, mask_token_id=heads.vocab_size - 1,
        target_layer_ids=list(AUX), draft_attn_impl="eager", sample_from_anchor=cfg.sample_from_anchor,
        markov_rank=cfg.markov_rank, markov_head_type=cfg.markov_head_type,
        enable_confidence_head=cfg.enable_confidence_head,
        confidence_head_with_markov=cfg.confidence_head_with_markov,
    ).double()  # fmt: skip
    names = copy_into_peer(ours, peer)
    assert any(n.startswith("markov_head.") for n in names) and "confidence_head.proj.bias" in names
    return peer


def _inputs(batch):
    S = batch.seq_len
    return dict(
        hidden_states=batch.aux_hidden.reshape(1, S, -1), input_ids=batch.input_ids[None],
        loss_mask=batch.loss_mask.long()[None], verifier_last_hidden_states=batch.last_hidden[None],
        document_ids=batch.doc_ids[None], position_ids=batch.position_ids[None],
    )  # fmt: skip


def _draw(ours, batch, monkeypatch):
    anchors = ours.sample_anchors(batch, torch.Generator().manual_seed(3))
    n = anchors.numel()
    padded = torch.cat([anchors, anchors.new_zeros(ANCHORS - n)])
    valid = torch.arange(ANCHORS) < n
    monkeypatch.setattr(
        dflash_core, "select_anchors", lambda loss_mask, num, block: (padded.clone(), valid.clone())
    )
    monkeypatch.setattr(ours, "draw_anchors", lambda b, g=None: (padded.clone(), valid.clone()))
    return anchors, padded, valid


def _peer_forward(peer, batch, loss, monkeypatch, weighting="fixed-exp-decay"):
    """The peer's loss, and what its ``compute_metrics`` received (logits, confidence logits, mask)."""
    seen = {}
    real = dspark_core.compute_metrics

    def spy(logits, targets, confidence_logits, loss_mask, *args, **kwargs):
        seen.update(logits=logits, targets=targets, confidence=confidence_logits, mask=loss_mask)
        return real(logits, targets, confidence_logits, loss_mask, *args, **kwargs)

    monkeypatch.setattr(dspark_core, "compute_metrics", spy)
    tv = peer_losses.resolve_loss_config("tv", "eager")["tv"][0]
    _, value, _ = peer(**_inputs(batch), loss_config=peer_losses.resolve_loss_config(loss, "eager"), tv_loss_fn=tv,
                       gamma=4.0, max_anchors=ANCHORS, confidence_head_alpha=1.0,
                       per_position_loss_weight=weighting, dpace_alpha=0.5)  # fmt: skip
    return value, seen


def _our_outputs(ours, batch, anchors):
    n = anchors.numel()
    h, u, emb, _, valid = ours.block_outputs(batch, anchors, torch.ones(n, dtype=torch.bool))
    logits = h @ ours.verifier.lm_head.T + ours.markov_head.bias(u)
    return logits, ours.confidence_head(h, emb), valid


def _grads(module):
    return {n: p.grad.clone() for n, p in module.named_parameters() if p.requires_grad and p.grad is not None}


@pytest.mark.parametrize("loss", sorted(LOSSES))
@pytest.mark.parametrize("layout", ["anchor-first", "fill-in"])
@pytest.mark.parametrize("kind", ["vanilla", "gated", "rnn"])
def test_peer_recipe_matches_speculators(tiny_model_dir, heads, batch, kind, layout, loss, monkeypatch):
    ours = _ours(heads, kind, layout == "anchor-first", loss_mix=LOSSES[loss], **PEER_RECIPE)
    peer = _peer(tiny_model_dir, heads, ours)
    anchors, padded, valid = _draw(ours, batch, monkeypatch)
    n, off = anchors.numel(), ours.offset
    assert 0 < n < ANCHORS, "the test needs padded anchor slots"

    # masks: the peer's mask_mod, dense, equals ours on the same (padded) anchor set
    S = batch.seq_len
    mod, q_len, kv_len = peer_attention.create_anchor_block_mask_mod(batch.doc_ids, S, padded, B)
    zero = torch.zeros((), dtype=torch.long)
    theirs = mod(zero, zero, torch.arange(q_len)[:, None], torch.arange(kv_len)[None, :]).expand(
        q_len, kv_len
    )
    docs = torch.where(valid, batch.doc_ids[padded], torch.full_like(padded, -2))
    assert torch.equal(ours._mask(batch.doc_ids, padded, docs).dense(), theirs)

    # loss and gradients
    value, _ = ours(batch)
    value.backward()
    peer_value, seen = _peer_forward(peer, batch, LOSSES[loss], monkeypatch)
    peer_value.backward()
    torch.testing.assert_close(value, peer_value, rtol=1e-6, atol=0)
    ours_g, peer_g = _grads(ours), _grads(peer)
    assert set(ours_g) == set(peer_g) and any(k.startswith("markov_head.markov_w2") for k in ours_g)
    for name in sorted(ours_g):
        assert_same_tensor(ours_g[name], peer_g[name], name)

    # Markov-corrected logits, confidence logits and slot masks of the real blocks
    V = heads.vocab_size
    logits, confidence, ok = _our_outputs(ours, batch, anchors)
    assert_same_tensor(logits, seen["logits"].view(ANCHORS, B, V)[:n, off:], "corrected logits")
    assert_same_tensor(confidence, seen["confidence"].view(ANCHORS, B)[:n, off:], "confidence logits")
    assert torch.equal(ok, seen["mask"].view(ANCHORS, B)[:n, off:].bool())


def test_dpace_matches_speculators(tiny_model_dir, heads, batch, monkeypatch):
    ours = _ours(heads, loss_mix="ce", **{**PEER_RECIPE, "loss_weighting": "dpace", "dpace_alpha": 0.5})
    peer = _peer(tiny_model_dir, heads, ours)
    _draw(ours, batch, monkeypatch)
    value, _ = ours(batch)
    peer_value, _ = _peer_forward(peer, batch, "ce", monkeypatch, weighting="dpace")
    torch.testing.assert_close(value, peer_value, rtol=1e-6, atol=0)


def test_speculators_gates_anchor_first_slots_by_their_own_token(tiny_model_dir, heads, batch, monkeypatch):
    """speculators' PR #865: slot k of an anchor-first block predicts the token at a + k + 1 but
    trains where a + k has loss mask 1. Ours (``slot_mask=label``) trains where a + k + 1 has."""
    recipe = {**PEER_RECIPE, "slot_mask": "label"}
    ours = _ours(heads, **recipe)
    peer = _peer(tiny_model_dir, heads, ours)
    anchors, _, _ = _draw(ours, batch, monkeypatch)
    n = anchors.numel()
    _, _, ok = _our_outputs(ours, batch, anchors)
    labels = anchors[:, None] + torch.arange(1, B + 1)[None, :]
    assert torch.equal(ok, batch.loss_mask[labels.clamp(max=batch.seq_len - 1)])
    with torch.no_grad():
        value, _ = ours(batch)
        peer_value, seen = _peer_forward(peer, batch, "kl_div", monkeypatch)
    theirs = seen["mask"].view(ANCHORS, B)[:n].bool()
    assert torch.equal(theirs, batch.loss_mask[labels - 1])
    differs = ok != theirs
    assert differs.any(), "the batch must hold a trained/untrained boundary inside a block"
    assert (~batch.loss_mask[labels[differs]] | ~batch.loss_mask[labels[differs] - 1]).all()
    assert abs(float(value) - float(peer_value)) > 1e-3 * abs(float(peer_value))


@pytest.mark.parametrize("anchor_first", [True, False])
def test_speculators_draws_anchors_whose_first_label_is_untrained(heads, batch, anchor_first):
    peer_rule = _ours(heads, anchor_first=anchor_first, **PEER_RECIPE)
    ours = _ours(heads, anchor_first=anchor_first, **{**PEER_RECIPE, "anchor_needs_label": True,
                                                      "slot_mask": "label"})  # fmt: skip
    theirs = torch.zeros(batch.seq_len, dtype=torch.bool)
    anchors, ok = dflash_core.select_anchors(batch.loss_mask.long()[None], 10_000, B)
    theirs[anchors[ok]] = True
    assert torch.equal(peer_rule.anchor_candidates(batch), theirs)
    mine = ours.anchor_candidates(batch)
    untrained_next = theirs & ~torch.cat([batch.loss_mask[1:], torch.zeros(1, dtype=torch.bool)])
    assert untrained_next.any(), "the batch must hold a trained token followed by an untrained one"
    assert torch.equal(mine, theirs & ~untrained_next)


def test_default_recipe_differs_from_speculators_only_where_named(heads):
    cfg = get_config_class("dspark")(aux_layer_ids=AUX)
    peer_defaults = dict(block_size=8, sample_from_anchor=True, markov_rank=256, markov_head_type="vanilla",
                         enable_confidence_head=True, confidence_head_with_markov=True, confidence_head_alpha=1.0,
                         loss_mix={"kl_div": 1.0}, loss_norm="count", num_layers=5, max_anchors=512)  # fmt: skip
    assert {k: getattr(cfg, k) for k in peer_defaults} == peer_defaults
    assert (cfg.slot_mask, cfg.anchor_needs_label, cfg.anchor_rule) == ("label", True, "document")
    # the loss is our DFlash's (measured, docs/decisions.md), where speculators' is soft KL with fixed decay
    assert (cfg.target_mode, cfg.loss_weighting, cfg.train_region) == ("hard", "dpace", "loss")


# --------------------------------------------------------------------------- checkpoints both ways


def _peer_logits(peer, batch, anchors, monkeypatch):
    """The peer's corrected logits and confidence logits ``[M, B, ...]`` of blocks at ``anchors``."""
    M = anchors.numel()
    monkeypatch.setattr(dflash_core, "select_anchors",
                        lambda loss_mask, num, block: (anchors.clone(), torch.ones(M, dtype=torch.bool)))  # fmt: skip
    seen = {}
    real = dspark_core.compute_metrics

    def spy(logits, targets, confidence_logits, *args, **kwargs):
        seen.update(logits=logits, confidence=confidence_logits)
        return real(logits, targets, confidence_logits, *args, **kwargs)

    monkeypatch.setattr(dspark_core, "compute_metrics", spy)
    tv = peer_losses.resolve_loss_config("tv", "eager")["tv"][0]
    with torch.no_grad():
        peer(**_inputs(batch), loss_config=peer_losses.resolve_loss_config("kl_div", "eager"), tv_loss_fn=tv,
             max_anchors=M)  # fmt: skip
    return seen["logits"].view(M, B, -1), seen["confidence"].view(M, B)


def _float_batch(batch):
    return Batch(batch.input_ids, batch.loss_mask, batch.position_ids, batch.doc_ids, batch.doc_ends,
                 batch.hidden_states.float())  # fmt: skip


@pytest.mark.parametrize("kind", ["vanilla", "gated", "rnn"])
def test_speculators_dspark_loads_and_runs_like_the_peer(
    tiny_model_dir, heads, batch, kind, tmp_path, monkeypatch
):
    from spectrain.eval.decode import load_exported_draft

    ours = _ours(heads, kind).float()
    peer = _peer(tiny_model_dir, heads, ours).float().eval()
    peer.save_pretrained(tmp_path / "peer")
    model = load_exported_draft(tmp_path / "peer", tiny_model_dir).model
    assert (model.cfg.markov_head_type, model.cfg.sample_from_anchor, model.cfg.block_attention) == (
        kind, True, "bidirectional")  # fmt: skip
    fb = _float_batch(batch)
    anchors = model.anchor_candidates(fb).nonzero().flatten()[:12]
    logits, confidence, _ = _our_outputs(model, fb, anchors)
    theirs, their_conf = _peer_logits(peer, fb, anchors, monkeypatch)
    assert_same_tensor(logits, theirs, "corrected logits")
    assert_same_tensor(confidence, their_conf, "confidence logits")


def test_our_dspark_export_loads_in_speculators(tiny_model_dir, heads, batch, tmp_path, monkeypatch):
    from spectrain.eval.decode import load_exported_draft
    from spectrain.export.write import export_draft

    out = export_draft(_ours(heads).float(), tmp_path / "ours", verifier_name=str(tiny_model_dir))
    config = dspark_core.DSparkDraftModel.config_class.from_pretrained(out)
    config.transformer_layer_config._attn_implementation = "eager"
    peer = dspark_core.DSparkDraftModel.from_pretrained(out, config=config, dtype=torch.float32).eval()
    model = load_exported_draft(out, tiny_model_dir).model  # the same bf16-rounded weights
    fb = _float_batch(batch)
    anchors = model.anchor_candidates(fb).nonzero().flatten()[:12]
    logits, confidence, _ = _our_outputs(model, fb, anchors)
    theirs, their_conf = _peer_logits(peer, fb, anchors, monkeypatch)
    assert_same_tensor(logits, theirs, "corrected logits")
    assert_same_tensor(confidence, their_conf, "confidence logits")
