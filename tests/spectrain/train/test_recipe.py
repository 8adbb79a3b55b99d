"""The recipe options: the vocabulary loss, D-PACE, Muon, option checks, aux layer order, exports."""

from __future__ import annotations

import json
import logging

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from spectrain.data.batch import Batch
from spectrain.export.write import export_draft
from spectrain.models import DraftContext, build_draft, get_config_class
from spectrain.models.common import dpace_weights, eager_vocab_loss
from spectrain.models.verifier import VerifierHeads
from spectrain.train.optim import OptimConfig, build_optimizers, split_for_muon

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def heads(tiny_model_dir):
    return VerifierHeads.load(tiny_model_dir)


def test_vocab_loss_soft_is_kl_and_hard_is_ce():
    g = torch.Generator().manual_seed(0)
    h, w = torch.randn(6, 8, generator=g, requires_grad=True), torch.randn(20, 8, generator=g)
    th, tw = torch.randn(6, 8, generator=g), torch.randn(20, 8, generator=g)
    p = F.softmax(th @ tw.T, -1)
    logq = F.log_softmax(h @ w.T, -1)
    soft, pred, tgt = eager_vocab_loss(h, w, th, tw, "soft")
    torch.testing.assert_close(soft, (p * (p.log() - logq)).sum(-1))
    assert torch.equal(pred, (h @ w.T).argmax(-1)) and torch.equal(tgt, p.argmax(-1))
    hard, _, _ = eager_vocab_loss(h, w, th, tw, "hard")
    torch.testing.assert_close(hard, -logq.gather(1, p.argmax(-1, keepdim=True))[:, 0])
    hard.sum().backward()
    assert h.grad is not None and h.grad.abs().sum() > 0
    with pytest.raises(ValueError, match="target_mode"):
        eager_vocab_loss(h, w, th, tw, "argmax")


@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.lists(st.floats(0, 5), min_size=5, max_size=5), min_size=1, max_size=4),
    st.lists(st.lists(st.booleans(), min_size=5, max_size=5), min_size=4, max_size=4),
    st.floats(0.05, 1.0),
)
def test_dpace_is_the_expected_accepted_length_each_position_gates(losses, valid, alpha):
    loss = torch.tensor(losses, dtype=torch.float64)
    ok = torch.tensor(valid[: loss.shape[0]])
    w = dpace_weights(loss, ok, alpha)
    for n in range(loss.shape[0]):
        for k in range(5):
            if not ok[n, k]:
                assert w[n, k] == 0
                continue
            expect = 0.0
            for j in range(k, 5):
                if ok[n, j]:
                    prod = 1.0
                    for i in range(j + 1):
                        if ok[n, i]:
                            prod *= (1 - alpha) * float(torch.exp(-loss[n, i])) + alpha
                    expect += prod
            assert abs(float(w[n, k]) - expect) < 1e-5 * max(1.0, expect)


def test_dpace_gives_early_positions_more_weight():
    loss = torch.full((1, 6), 0.5)
    w = dpace_weights(loss, torch.ones(1, 6, dtype=torch.bool), 0.5)[0]
    assert (w[:-1] > w[1:]).all()
    with pytest.raises(ValueError, match="dpace_alpha"):
        dpace_weights(loss, torch.ones(1, 6, dtype=torch.bool), 0.0)


def _draft(heads, algorithm, **kw):
    torch.manual_seed(0)
    defaults = {"dflash": dict(num_layers=2, block_size=4), "eagle3": dict(draft_vocab_size=300)}[algorithm]
    return build_draft(get_config_class(algorithm)(aux_layer_ids=(1, 2, 3), **{**defaults, **kw}), heads)


def test_muon_takes_the_weight_matrices_and_adamw_the_rest(heads):
    model = _draft(heads, "eagle3", freeze_lm_head=False)
    muon, rest = split_for_muon(model)
    names = {id(p): n for n, p in model.named_parameters()}
    assert {names[id(p)] for p in rest} == {n for n, p in model.named_parameters() if p.ndim == 1} | {
        "lm_head.weight"
    }
    assert all(p.ndim == 2 for p in muon) and "fc.weight" in {names[id(p)] for p in muon}
    opts = build_optimizers(model, OptimConfig(optimizer="muon", lr=1e-3, muon_lr=2e-2), lambda s: 1.0)
    assert [type(o).__name__ for o in opts.optimizers] == ["SkippableMuon", "AdamW"]
    assert isinstance(opts.optimizers[0], torch.optim.Muon)
    assert opts.optimizers[0].param_groups[0]["lr"] == 2e-2 and opts.lr == 1e-3
    H = heads.hidden_size
    fc = 5 * (4.0 * H * H * 3 * H + 2.0 * H**3)  # fc is [H, 3H]
    assert opts.flops_per_step > fc
    frozen = _draft(heads, "eagle3")  # the default
    assert "lm_head.weight" not in {n for n, p in frozen.named_parameters() if p.requires_grad}
    assert build_optimizers(model, OptimConfig(), lambda s: 1.0).flops_per_step == 0.0
    with pytest.raises(ValueError, match="optimizer: 'sgd'"):
        build_optimizers(model, OptimConfig(optimizer="sgd"), lambda s: 1.0)


def test_muon_trains_and_its_state_round_trips(heads, tiny_store):
    from spectrain.data.sources import PackedLoader, StoreSource

    src = StoreSource(tiny_store, val_fraction=0.0)
    batch = next(iter(PackedLoader(src, src.plan(0)[:4], total_seq_len=256, layers=[0, 1, 2, 3],
                                   hidden_dtype=torch.bfloat16)))  # fmt: skip
    model = _draft(heads, "dflash", max_anchors=32)
    opts = build_optimizers(model, OptimConfig(optimizer="muon", lr=3e-3), lambda s: 1.0)
    before = model.fc.weight.detach().clone()
    loss, _ = model(batch, torch.Generator().manual_seed(0))
    loss.backward()
    opts.step()
    opts.zero_grad()
    assert not torch.equal(before, model.fc.weight)
    again = build_optimizers(model, OptimConfig(optimizer="muon", lr=3e-3), lambda s: 1.0)
    again.load_state_dict(opts.state_dict())
    with pytest.raises(ValueError, match="holds 2 optimizer state"):
        build_optimizers(model, OptimConfig(), lambda s: 1.0).load_state_dict([{}, {}][:1] * 2)


@pytest.mark.parametrize(
    "algorithm,field,value",
    [("dflash", "loss_weighting", "linear"), ("dflash", "anchor_rule", "sequence"), ("dflash", "block_attention", "full"),
     ("dflash", "dpace_alpha", 0.0), ("dflash", "loss_norm", "mean"), ("eagle3", "loss_mask_on", "next"),
     ("eagle3", "target_mode", "kl"), ("eagle3", "sliding_window", 0)],
)  # fmt: skip
def test_bad_options_name_the_field(algorithm, field, value):
    with pytest.raises(ValueError, match=field):
        get_config_class(algorithm)(**{field: value})


def test_aux_layer_ids_are_sorted_on_every_path(caplog, tiny_store, tiny_model_dir, tmp_path):
    with caplog.at_level(logging.WARNING):
        cfg = get_config_class("dflash")(aux_layer_ids=(3, 1, 2))
    assert cfg.aux_layer_ids == (1, 2, 3) and "ascending" in caplog.text
    assert get_config_class("eagle3").from_dict({"aux_layer_ids": [3, 2, 1]}).aux_layer_ids == (1, 2, 3)
    with pytest.raises(ValueError, match="repeats"):
        get_config_class("dflash")(aux_layer_ids=(1, 1, 2))
    from spectrain.train.loop import resolve_layers

    cfg = get_config_class("dflash")()
    idx = resolve_layers(cfg, [3, 1, 2, 4], 4)  # a store listing its aux layers out of order
    assert cfg.aux_layer_ids == (1, 2, 3) and idx == [1, 2, 0, 3]
    from spectrain.cli.train import build_train_config

    tc = build_train_config({"store": str(tiny_store), "verifier": str(tiny_model_dir), "save_path": str(tmp_path),
                             "target_layer_ids": "3 1 2"})  # fmt: skip
    assert tuple(get_config_class("dflash").from_dict(tc.draft).aux_layer_ids) == (1, 2, 3)


def test_retired_options_still_load():
    cfg = get_config_class("eagle3").from_dict({"logits_chunk": 4096, "ttt_steps": 2})
    assert cfg.ttt_steps == 2


def _doc_batch(heads, n=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, heads.vocab_size - 1, (n,), generator=g)
    states = torch.randn(n, 4, heads.hidden_size, generator=g)
    return Batch(ids, torch.ones(n, dtype=torch.bool), torch.arange(n), torch.zeros(n, dtype=torch.long),
                 torch.full((n,), n), states)  # fmt: skip


def test_causal_windowed_dflash_proposes_what_it_trains(heads):
    m = _draft(heads, "dflash", block_attention="causal", sliding_window=5, max_anchors=1000).eval()
    b = _doc_batch(heads)
    with torch.no_grad():
        m(b)
    for i in (3, len(m.last_anchors) - 1):
        a = int(m.last_anchors[i])
        got = m.propose(DraftContext(b.aux_hidden[:a].reshape(a, -1), b.input_ids[: a + 1].tolist()))
        assert got == m.last_predictions[i].tolist()
    bidir = _draft(heads, "dflash", max_anchors=1000).eval()
    with torch.no_grad():
        bidir(b)
    assert not torch.equal(bidir.last_predictions, m.last_predictions)


def test_eagle31_norms_propose_what_they_train(heads):
    m = _draft(heads, "eagle3", norm_before_fc=True, norm_output=True, ttt_steps=3).eval()
    with torch.no_grad():
        m.input_norm.weight.uniform_(0.5, 1.5)
    b = _doc_batch(heads)
    T = 20
    chain = m.propose(DraftContext(b.aux_hidden[:T].reshape(T, -1), b.input_ids[: T + 1].tolist()), 3)
    ids = b.input_ids.clone()
    ids[T + 1 : T + 3] = torch.tensor(chain[:2])
    with torch.no_grad():
        m(Batch(ids, b.loss_mask, b.position_ids, b.doc_ids, b.doc_ends, b.hidden_states))
    assert m.last_predictions[T - 1].tolist() == chain


def test_exports_carry_the_recipe_vllm_serves(heads, tmp_path):
    d = export_draft(_draft(heads, "dflash", block_attention="causal", sliding_window=64), tmp_path / "d",
                     verifier_name="org/m")  # fmt: skip
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["sliding_window_non_causal"] is False
    assert cfg["transformer_layer_config"]["layer_types"] == ["sliding_attention"] * 2
    assert cfg["transformer_layer_config"]["sliding_window"] == 64
    d = export_draft(_draft(heads, "dflash"), tmp_path / "d2", verifier_name="org/m")
    assert json.loads((d / "config.json").read_text())["sliding_window_non_causal"] is True
    e = export_draft(_draft(heads, "eagle3", norm_before_fc=True, norm_output=True), tmp_path / "e",
                     verifier_name="org/m", include_embeddings=True)  # fmt: skip
    cfg = json.loads((e / "config.json").read_text())
    assert cfg["norm_before_fc"] is True and cfg["norm_output"] is True
    from safetensors.torch import load_file

    weights = load_file(str(e / "model.safetensors"))
    assert weights["input_norm.weight"].shape == (3 * heads.hidden_size,)
    assert torch.equal(weights["embed_tokens.weight"], heads.embed_tokens.bfloat16())
