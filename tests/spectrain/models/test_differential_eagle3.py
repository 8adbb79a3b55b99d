"""Eagle3 against speculators 0.9.0's Eagle3DraftModel: same masks, logits, loss and gradients.

The peer shifts every document before packing (``shift_batch``: its row ``i`` reads token
``i + 1``, aux state ``i``, target state ``i + 1``, loss mask ``i + 1``); our packed sequence keeps
the document whole and shifts inside the model. So our slot ``start + i`` is the peer's row
``start - d + i`` (``d`` documents before it), and each document's last slot has no peer row
(it is never trained: its chain leaves the document at once). Each document starts with a
prompt of more untrained tokens than TTT steps, as chat data does: the peer's chains run on
into the next document there, ours stop at the document's end, and neither trains those rows.
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

core = import_peer("models.eagle3.core")
peer_attention = import_peer("models.eagle3.attention")
peer_data = import_peer("models.eagle3.data")
peer_losses = import_peer("losses")

AUX = (1, 2, 3)
K = 3
DRAFT_VOCAB = 600
DECAY = 0.7
DOCS, PROMPTS, PAD = [16, 13, 11], [4, 5, 4], 4

PEER_RECIPE = dict(target_mode="soft", loss_norm="count", loss_mask_on="source", freeze_lm_head=True,
                   norm_before_fc=True, norm_output=True, norm_before_residual=True, train_region="loss")  # fmt: skip


@pytest.fixture(scope="module")
def heads(tiny_model_dir):
    return fp64_heads(tiny_model_dir)


@pytest.fixture(scope="module")
def batch(heads):
    return packed_batch(DOCS, PROMPTS, PAD, len(AUX), heads.hidden_size, heads.vocab_size, seed=5)


def _ours(heads, batch, **options):
    torch.manual_seed(0)
    cfg = get_config_class("eagle3")(aux_layer_ids=AUX, draft_vocab_size=DRAFT_VOCAB, ttt_steps=K,
                                     ttt_step_loss_decay=DECAY, **options)  # fmt: skip
    model = build_draft(cfg, heads)
    model.prepare(torch.bincount(batch.input_ids, minlength=heads.vocab_size).double())
    model = model.double()
    perturb_norms(model)
    return model


def _peer(tiny_model_dir, heads, ours):
    peer = core.Eagle3DraftModel.from_training_args(
        layer_config(tiny_model_dir, "llama", 1), t2d=ours.t2d.clone(), d2t=ours.d2t.clone(),
        verifier_name_or_path=str(tiny_model_dir), draft_vocab_size=DRAFT_VOCAB, norm_before_residual=True,
        norm_before_fc=True, norm_output=True, ttt_steps=K, target_layer_ids=list(AUX), draft_attn_impl="eager",
    ).double()  # fmt: skip
    assert torch.equal(peer.lm_head.weight, ours.lm_head.weight), "both start from the verifier's rows"
    copy_into_peer(ours, peer)
    return peer


def _peer_batch(batch):
    """The peer's packed sequence: each document shifted by ``shift_batch``, then concatenated."""
    parts, rows = [], []
    start = 0
    for n in DOCS:
        sl = slice(start, start + n)
        parts.append(peer_data.shift_batch({
            "input_ids": batch.input_ids[sl], "hidden_states": batch.aux_hidden[sl].reshape(n, -1),
            "verifier_last_hidden_states": batch.last_hidden[sl], "loss_mask": batch.loss_mask[sl].long(),
            "lengths": torch.tensor([n]), "position_ids": batch.position_ids[sl],
        }))  # fmt: skip
        rows += list(range(start, start + n - 1))
        start += n
    cat = {k: torch.cat([p[k] for p in parts]) for k in ("input_ids", "hidden_states",
                                                          "verifier_last_hidden_states", "loss_mask", "position_ids")}  # fmt: skip
    docs = torch.cat([torch.full((n - 1,), d) for d, n in enumerate(DOCS)])
    inputs = dict(
        hidden_states=cat["hidden_states"][None], input_ids=cat["input_ids"][None], document_ids=docs[None],
        loss_mask=cat["loss_mask"][None], position_ids=cat["position_ids"][None],
        verifier_last_hidden_states=cat["verifier_last_hidden_states"][None],
    )  # fmt: skip
    return inputs, torch.tensor(rows)


def _capture(module, name):
    seen: list[torch.Tensor] = []
    handle = module.get_submodule(name).register_forward_hook(
        lambda m, i, o: seen.append(o.detach().reshape(-1, o.shape[-1]))
    )
    return seen, handle


def _peer_forward(peer, inputs):
    loss_config = peer_losses.resolve_loss_config("kl_div", "eager")
    _, loss, _ = peer(**inputs, ttt_steps=K, ttt_step_loss_decay=DECAY, loss_config=loss_config)
    return loss


def test_peer_recipe_matches_speculators(tiny_model_dir, heads, batch):
    ours = _ours(heads, batch, **PEER_RECIPE)
    peer = _peer(tiny_model_dir, heads, ours)
    inputs, rows = _peer_batch(batch)
    S2 = rows.numel()

    # masks, step by step: the peer's dense mask on its rows equals ours on the matching slots
    mod = peer_attention.create_combined_mask_mod(inputs["document_ids"][0], S2)
    q, kv = torch.arange(S2)[:, None], torch.arange(S2)[None, :]
    zero = torch.zeros((), dtype=torch.long)
    theirs = mod(zero, zero, q, kv).expand(S2, S2)[None, None]
    from spectrain.models.eagle3 import ttt_mask

    S = batch.seq_len
    for j in range(K):
        if j:
            theirs = peer_attention.extend_dense_mask_for_draft_tokens(theirs, S2)
        mine = ttt_mask(batch.doc_ids, j).dense()
        cols = torch.cat([rows + st * S for st in range(j + 1)])
        assert torch.equal(mine[rows][:, cols], theirs[0, 0]), f"step {j}"
        others = torch.ones(mine.shape[1], dtype=torch.bool)
        others[cols] = False
        assert not mine[rows][:, others].any(), f"step {j}: a key with no counterpart in the peer"

    # logits of every step where the chain is still inside its document, loss and gradients
    seen_ours, h1 = _capture(ours, "norm")  # our head is applied inside vocab_loss
    seen_peer, h2 = _capture(peer, "lm_head")
    loss, _ = ours(batch)
    peer_loss = _peer_forward(peer, inputs)
    h1.remove()
    h2.remove()
    for j in range(K):
        _, inside, _ = ours.step_slots(batch, j)
        keep = inside[rows]
        assert keep.sum() > 20
        logits = seen_ours[j][rows][keep] @ ours.lm_head.weight.T
        assert_same_tensor(logits, seen_peer[j][keep], f"logits of step {j}")
    assert_same_tensor(loss, peer_loss, "loss")
    loss.backward()
    peer_loss.backward()
    names = {n for n, p in ours.named_parameters() if p.requires_grad}
    assert "lm_head.weight" not in names and "input_norm.weight" in names
    for name in sorted(names):
        assert_same_tensor(ours.get_parameter(name).grad, peer.get_parameter(name).grad, name)


@pytest.mark.parametrize(
    "option,value",
    [("target_mode", "hard"), ("loss_norm", "weight"), ("loss_mask_on", "label"), ("norm_output", False)],
)  # fmt: skip
def test_each_of_our_options_differs_from_speculators(tiny_model_dir, heads, batch, option, value):
    ours = _ours(heads, batch, **{**PEER_RECIPE, option: value})
    peer = _peer(tiny_model_dir, heads, _ours(heads, batch, **PEER_RECIPE))
    copy_into_peer(ours, peer)
    inputs, _ = _peer_batch(batch)
    with torch.no_grad():
        loss, _ = ours(batch)
        peer_loss = _peer_forward(peer, inputs)
    assert abs(float(loss) - float(peer_loss)) > 1e-3 * abs(float(peer_loss)), (
        option,
        float(loss),
        float(peer_loss),
    )


def test_norm_before_fc_and_frozen_head_are_the_peers(tiny_model_dir, heads, batch):
    """Without ``norm_before_fc`` there is no ``input_norm`` to copy; unfrozen, lm_head trains."""
    plain = _ours(heads, batch, **{**PEER_RECIPE, "norm_before_fc": False, "freeze_lm_head": False})
    assert plain.input_norm is None and "input_norm.weight" not in plain.state_dict()
    assert plain.lm_head.weight.requires_grad
    frozen = _ours(heads, batch, **PEER_RECIPE)
    loss, _ = frozen(batch)
    loss.backward()
    assert frozen.lm_head.weight.grad is None
