"""DSpark: the chunked mixed loss against an eager definition, anchors, propose() against training,
the overfit, the exports (names, fields, refusals) and their loading back."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from spectrain.data.sources import Batch, PackedLoader, StoreSource
from spectrain.export.read import build_exported_draft
from spectrain.export.write import ExportError, export_draft
from spectrain.models import DraftContext, available, build_draft, get_config_class
from spectrain.models.dspark import SlotWeighting, mix_loss, parse_loss_mix
from spectrain.models.verifier import VerifierHeads

AUX = (1, 2, 3)
KINDS = ("vanilla", "gated", "rnn")


@pytest.fixture(scope="module")
def sharp_heads(heads):
    return VerifierHeads(heads.info, heads.embed_tokens, heads.norm_weight, heads.lm_head * 25)


@pytest.fixture(scope="module")
def batches(tiny_store) -> list[Batch]:
    src = StoreSource(tiny_store, val_fraction=0.0)
    return list(PackedLoader(src, src.plan(0)[:12], total_seq_len=256, layers=[0, 1, 2, 3],
                             hidden_dtype=torch.bfloat16))  # fmt: skip


def _model(heads, **kw):
    torch.manual_seed(0)
    kw = {"block_size": 4, "num_layers": 1, "markov_rank": 16, **kw}
    return build_draft(get_config_class("dspark")(aux_layer_ids=AUX, **kw), heads)


# --------------------------------------------------------------------------- the loss


def _eager(h, W, u, W2, th, tw, mix, mode, weighting, valid):
    """The definition: full logits, each term over the whole vocabulary, weights from the rows."""
    z = h @ W.T + (u @ W2.T if u is not None else 0)
    t_logits = th @ tw.T
    t = t_logits.argmax(-1)
    lq = F.log_softmax(z, -1)
    q = lq.exp()
    p = F.softmax(t_logits, -1) if mode == "soft" else F.one_hot(t, z.shape[1]).to(z.dtype)
    terms = {"ce": -lq.gather(1, t[:, None]).squeeze(1),
             "kl_div": (p * (torch.log(p.clamp_min(1e-300)) - lq)).sum(-1),
             "tv": 1 - torch.minimum(p, q).sum(-1)}  # fmt: skip
    row = sum(c * terms[k] for k, c in mix.items())
    w = weighting.weights(row.detach(), valid)
    return (row * w).sum(), 1 - terms["tv"].detach(), z.argmax(-1), t


@pytest.mark.parametrize("mode", ["soft", "hard"])
@pytest.mark.parametrize("mix", ["kl_div", '{"ce": 0.1, "tv": 1.8}', '{"ce": 1, "kl_div": 0.5, "tv": 0.3}'])
@pytest.mark.parametrize("kind", ["exp-decay", "dpace"])
@pytest.mark.parametrize("chunk", [3, 12, 1000])  # rounded down to whole blocks of 3
def test_mix_loss_equals_its_definition(mode, mix, kind, chunk):
    g = torch.Generator().manual_seed(1)
    N, H, r, V, K = 24, 8, 4, 50, 3
    d = dict(dtype=torch.float64)
    h, u = torch.randn(N, H, generator=g, **d), torch.randn(N, r, generator=g, **d)
    W, W2 = torch.randn(V, H, generator=g, **d), torch.randn(V, r, generator=g, **d)
    th, tw = h + 0.3 * torch.randn(N, H, generator=g, **d), W + 0.2 * torch.randn(V, H, generator=g, **d)
    valid = torch.rand(N, generator=g) > 0.25
    weighting = SlotWeighting(K, kind, gamma=3.0, alpha=0.6)
    mix = parse_loss_mix(mix)
    grads = []
    for fn in ("ours", "eager"):
        leaves = [x.clone().requires_grad_(True) for x in (h, u, W2)]
        if fn == "ours":
            res = mix_loss(leaves[0], W, valid, mix=mix, weighting=weighting, markov=leaves[1], markov_weight=leaves[2],
                           target_hidden=th, target_head_weight=tw, mode=mode, chunk_rows=chunk)  # fmt: skip
            total, accept, pred, tgt = res.total, res.accept, res.pred, res.target
        else:
            total, accept, pred, tgt = _eager(
                *leaves[:1], W, leaves[1], leaves[2], th, tw, mix, mode, weighting, valid
            )
        (2.5 * total).backward()
        grads.append((total.detach(), accept, pred, tgt, *(x.grad for x in leaves)))
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-11)


def test_mix_loss_with_stored_target_ids_is_the_hard_loss():
    g = torch.Generator().manual_seed(2)
    N, H, V = 12, 6, 40
    h, W = (
        torch.randn(N, H, generator=g, dtype=torch.float64),
        torch.randn(V, H, generator=g, dtype=torch.float64),
    )
    th = torch.randn(N, H, generator=g, dtype=torch.float64)
    ids = (th @ W.T).argmax(-1)
    valid = torch.ones(N, dtype=torch.bool)
    kw = dict(mix={"ce": 0.5, "tv": 1.0}, weighting=SlotWeighting(4), mode="hard")
    a = mix_loss(h, W, valid, target_hidden=th, target_head_weight=W, **kw)
    b = mix_loss(h, W, valid, target_ids=ids, **kw)
    torch.testing.assert_close(a.total, b.total)
    with pytest.raises(ValueError, match="target ids only"):
        mix_loss(h, W, valid, target_ids=ids, **{**kw, "mode": "soft"})


def test_loss_mix_and_options_are_checked():
    assert parse_loss_mix("tv") == {"tv": 1.0}
    for bad, match in (("jsd", "neither a term"), ({"rkl": 1}, "unknown term"), ({"ce": -1}, ">= 0"),
                       ({"ce": 0}, "every weight is 0")):  # fmt: skip
        with pytest.raises(ValueError, match=match):
            parse_loss_mix(bad)
    cls = get_config_class("dspark")
    with pytest.raises(ValueError, match="markov_head_type"):
        cls(markov_head_type="lstm")
    with pytest.raises(ValueError, match="confidence_head_with_markov: needs markov_rank > 0"):
        cls(markov_rank=0)
    assert "dspark" in available() and cls(markov_rank=0, confidence_head_with_markov=False).proposals == 8


# --------------------------------------------------------------------------- the model


@pytest.mark.parametrize("anchor_first", [True, False])
def test_anchors_leave_room_for_the_block_and_a_trained_first_label(heads, batches, anchor_first):
    m = _model(heads, max_anchors=10_000, sample_from_anchor=anchor_first)
    b = batches[0]
    a = m.sample_anchors(b)
    last = a + 4 - (0 if anchor_first else 1)
    assert b.loss_mask[a].all() and b.loss_mask[a + 1].all() and (b.position_ids[a] >= 1).all()
    assert (last < b.doc_ends[a]).all()
    S = b.seq_len
    slots = torch.arange(S)
    ok = (b.loss_mask & (b.doc_ids >= 0) & (slots + 4 - (0 if anchor_first else 1) < b.doc_ends)
          & (b.position_ids >= 1) & b.loss_mask[(slots + 1).clamp(max=S - 1)])  # fmt: skip
    assert torch.equal(a, ok.nonzero().flatten())


@pytest.mark.parametrize("anchor_first", [True, False])
@pytest.mark.parametrize("kind", KINDS)
def test_propose_equals_training_on_its_own_tokens(heads, batches, kind, anchor_first):
    """Teacher forcing on a document whose tokens after the anchor are the draft's own proposals is
    exactly the sequential correction: the training predictions then repeat propose()."""
    m = _model(heads, markov_head_type=kind, sample_from_anchor=anchor_first, max_anchors=10_000).eval()
    with torch.no_grad():
        for p in m.markov_head.parameters():  # a strong bias: the correction changes the tokens
            p.mul_(40.0 if p.ndim == 2 else 1.0)
    b = batches[0]
    K = m.max_proposals
    a = int(m.sample_anchors(b)[-1])
    start = a - int(b.position_ids[a])
    aux = b.aux_hidden[start:a].reshape(a - start, -1).float()
    chain = m.propose(DraftContext(aux, b.input_ids[start : a + 1].tolist()))
    assert len(chain) == K
    ids = b.input_ids.clone()
    ids[a + 1 : a + K] = torch.tensor(chain[:-1])  # the previous tokens of slots 2..K
    doctored = Batch(ids, b.loss_mask, b.position_ids, b.doc_ids, b.doc_ends, b.hidden_states)
    with torch.no_grad():
        m(doctored)
    row = int((m.last_anchors == a).nonzero()[0])
    assert m.last_predictions[row].tolist() == chain
    plain = _model(heads, markov_head_type=kind, sample_from_anchor=anchor_first, markov_rank=0,
                   confidence_head_with_markov=False).eval()  # fmt: skip
    plain.load_state_dict({k: v for k, v in m.state_dict().items() if not k.startswith(("markov", "confidence"))},
                          strict=False)  # fmt: skip
    assert plain.propose(DraftContext(aux, b.input_ids[start : a + 1].tolist())) != chain, "the bias mattered"
    # fewer proposals: a prefix of the step's block (vLLM's K slots, the first n looked at)
    assert m.propose(DraftContext(aux, b.input_ids[start : a + 1].tolist()), 2, step_tokens=K) == chain[:2]


@pytest.mark.parametrize("kind", KINDS)
def test_overfit_raises_accuracy_and_calibrates_confidence(sharp_heads, batches, kind):
    m = _model(sharp_heads, markov_head_type=kind, max_anchors=64, loss_mix='{"ce": 0.1, "tv": 1.8}')
    opt = torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=3e-2)
    b = batches[0]
    first = None
    for i in range(40):
        loss, met = m(b, torch.Generator().manual_seed(i % 2))
        if first is None:
            first = (loss.item(), float(met["acc_correct"].sum() / met["acc_total"].sum()),
                     float(met["confidence_error_sum"] / met["confidence_error_total"]))  # fmt: skip
        opt.zero_grad()
        loss.backward()
        opt.step()
    loss, met = m(b, torch.Generator().manual_seed(0))
    acc = float(met["acc_correct"].sum() / met["acc_total"].sum())
    err = float(met["confidence_error_sum"] / met["confidence_error_total"])
    assert loss.item() < 0.6 * first[0] and acc > first[1] + 0.1 and err < first[2], (
        first,
        loss.item(),
        acc,
        err,
    )
    assert m.markov_head.markov_w2.weight.grad is not None and m.confidence_head.proj.weight.grad is not None


def test_reduced_vocabulary(heads, batches):
    m = _model(heads, draft_vocab_size=300, max_anchors=16)
    m.prepare(torch.bincount(batches[0].input_ids, minlength=heads.vocab_size))
    assert m.markov_head.markov_w1.weight.shape == (heads.vocab_size, 16)
    assert m.markov_head.markov_w2.weight.shape == (300, 16)
    loss, _ = m(batches[0])
    loss.backward()
    a = int(m.last_anchors[0])
    b = batches[0]
    start = a - int(b.position_ids[a])
    got = m.propose(DraftContext(b.aux_hidden[start:a].reshape(a - start, -1).float(),
                                 b.input_ids[start : a + 1].tolist()))  # fmt: skip
    assert set(got) <= set((torch.arange(300) + m.d2t).tolist())


# --------------------------------------------------------------------------- export


def test_export_names_fields_and_loading_back(heads, batches, tmp_path):
    m = _model(heads, max_anchors=16)
    out = export_draft(m, tmp_path / "d", verifier_name="org/tiny")
    cfg = json.loads((out / "config.json").read_text())
    assert {k: cfg[k] for k in ("speculators_model_type", "architectures", "sample_from_anchor", "markov_rank",
                                "markov_head_type", "enable_confidence_head", "confidence_head_with_markov",
                                "block_size")} == {
        "speculators_model_type": "dspark", "architectures": ["DSparkDraftModel"], "sample_from_anchor": True,
        "markov_rank": 16, "markov_head_type": "vanilla", "enable_confidence_head": True,
        "confidence_head_with_markov": True, "block_size": 4}  # fmt: skip
    assert cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == 4
    assert cfg["speculators_config"]["algorithm"] == "dspark"
    names = set(load_file(str(out / "model.safetensors")))
    assert {"markov_head.markov_w1.weight", "markov_head.markov_w2.weight", "confidence_head.proj.weight",
            "confidence_head.proj.bias", "fc.weight"} <= names  # fmt: skip
    assert not any("embed" in n or "lm_head" in n for n in names)
    back, k = build_exported_draft(out, heads)
    fields = ("aux_layer_ids", "num_layers", "block_size", "sample_from_anchor", "markov_rank", "markov_head_type",
              "enable_confidence_head", "confidence_head_with_markov", "block_attention", "sliding_window",
              "draft_vocab_size")  # fmt: skip
    assert k == 4 and {f: getattr(back.cfg, f) for f in fields} == {f: getattr(m.cfg, f) for f in fields}
    b = batches[0]
    a = 40
    ctx = DraftContext(b.aux_hidden[:a].reshape(a, -1).float(), b.input_ids[: a + 1].tolist())
    m16 = m.to(torch.bfloat16).float()  # the export is bf16
    assert back.propose(ctx) == m16.propose(ctx)


@pytest.mark.parametrize(("options", "needle"), [
    (dict(markov_head_type="gated"), "markov_head_type gated: vLLM 0.32 serves only the vanilla"),
    (dict(markov_head_type="rnn"), "markov_head_type rnn: vLLM 0.32 serves only the vanilla"),
    (dict(markov_rank=0, confidence_head_with_markov=False), "markov_rank 0"),
    (dict(block_attention="causal"), "block_attention causal on full-attention layers"),
])  # fmt: skip
def test_exports_vllm_cannot_serve_are_refused_in_one_line(heads, tmp_path, options, needle):
    m = _model(heads, **options)
    with pytest.raises(ExportError) as e:
        export_draft(m, tmp_path / "d", verifier_name="org/tiny")
    assert needle in str(e.value) and "\n" not in str(e.value) and not (tmp_path / "d").exists()
    out = export_draft(m, tmp_path / "d", verifier_name="org/tiny", for_vllm=False)
    back, _ = build_exported_draft(out, heads)
    assert back.cfg.markov_head_type == m.cfg.markov_head_type
    assert set(back.state_dict()) == set(m.state_dict())
