"""Checkpoints both ways between spectrain and speculators 0.9.0.

- A draft saved by speculators' own classes (``save_pretrained`` of a model built with
  ``from_training_args`` on the tiny verifier) loads in ``load_exported_draft`` (``spectrain
  eval``) and in ``spectrain train --from-pretrained``, and computes the same logits as the
  peer's own forward; every config field is honoured or refused with an error naming it.
- Our export loads in speculators' classes and computes the same logits as ours.
"""

from __future__ import annotations

import json
import logging
import shutil

import pytest
import torch
from _peer import assert_same_tensor, import_peer, layer_config, packed_batch, perturb_norms
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from spectrain.eval.decode import load_exported_draft
from spectrain.export.read import DraftLoadError
from spectrain.export.write import export_draft
from spectrain.models import build_draft, get_config_class
from spectrain.models.verifier import VerifierHeads

dflash_core = import_peer("models.dflash.core")
eagle3_core = import_peer("models.eagle3.core")

AUX = [1, 2, 3]
B = 4


def _randomize(model: torch.nn.Module) -> None:
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "embed_tokens" in name or "lm_head" in name:
                continue
            p.copy_(
                0.05 * torch.randn(p.shape, generator=g)
                if p.ndim > 1
                else 1 + 0.3 * torch.randn(p.shape, generator=g)
            )


@pytest.fixture(scope="module")
def batch(tiny_model_dir):
    heads = VerifierHeads.load(tiny_model_dir)
    b = packed_batch([15, 13, 11], [3, 4, 3], 4, 3, heads.hidden_size, heads.vocab_size)
    return type(b)(b.input_ids, b.loss_mask, b.position_ids, b.doc_ids, b.doc_ends, b.hidden_states.float())


def _save_peer_dflash(tiny_model_dir, out, sliding: bool):
    vocab = VerifierHeads.load(tiny_model_dir).vocab_size
    peer = dflash_core.DFlashDraftModel.from_training_args(
        layer_config(tiny_model_dir, "qwen3", 2, 2048 if sliding else None),
        verifier_name_or_path=str(tiny_model_dir), draft_vocab_size=vocab, block_size=B, mask_token_id=vocab - 1,
        target_layer_ids=AUX, draft_attn_impl="eager",
    )  # fmt: skip
    _randomize(peer)
    peer.save_pretrained(out)
    return peer


def _save_peer_eagle3(tiny_model_dir, out):
    vocab = VerifierHeads.load(tiny_model_dir).vocab_size
    peer = eagle3_core.Eagle3DraftModel.from_training_args(
        layer_config(tiny_model_dir, "llama", 1), verifier_name_or_path=str(tiny_model_dir),
        draft_vocab_size=vocab, norm_before_residual=True, norm_before_fc=True, norm_output=True, ttt_steps=3,
        target_layer_ids=AUX, draft_attn_impl="eager",
    )  # fmt: skip
    _randomize(peer)
    peer.save_pretrained(out)
    return peer


def _dflash_peer_logits(peer, batch, anchors):
    S, M = batch.seq_len, anchors.numel()
    valid = torch.ones(M, dtype=torch.bool)
    orig = dflash_core.select_anchors
    dflash_core.select_anchors = lambda loss_mask, num, block: (anchors.clone(), valid)
    try:
        _, logits, _, _, _ = peer._backbone_forward(
            hidden_states=batch.aux_hidden.reshape(1, S, -1), input_ids=batch.input_ids[None],
            loss_mask=batch.loss_mask.long()[None], verifier_last_hidden_states=batch.last_hidden[None],
            document_ids=batch.doc_ids[None], position_ids=batch.position_ids[None], max_anchors=M,
        )  # fmt: skip
    finally:
        dflash_core.select_anchors = orig
    return logits.view(M, B, -1)[:, 1:]


def _dflash_our_logits(model, batch, anchors):
    with torch.no_grad():
        h, _, _ = model.block_states(batch, anchors, torch.ones(anchors.numel(), dtype=torch.bool))
    return h @ model.verifier.lm_head.T


@pytest.mark.parametrize("sliding", [True, False], ids=["sliding-causal", "full-bidirectional"])
def test_speculators_dflash_loads_and_runs_like_the_peer(tiny_model_dir, batch, tmp_path, sliding, caplog):
    out = tmp_path / "peer"
    peer = _save_peer_dflash(tiny_model_dir, out, sliding)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["sliding_window_non_causal"] is False and "speculators_version" in cfg
    with caplog.at_level(logging.WARNING, logger="spectrain.export.read"):
        proposer = load_exported_draft(out, tiny_model_dir)
    served = proposer.model.cfg
    anchors = proposer.model.anchor_candidates(batch).nonzero().flatten()[:16]
    with torch.no_grad():
        theirs = _dflash_peer_logits(peer.eval(), batch, anchors)
    if sliding:  # sliding layers with the field false: causal in training and in vLLM alike, no warning
        assert (served.block_attention, served.sliding_window) == ("causal", 2048)
        assert "served" not in caplog.text
        assert_same_tensor(_dflash_our_logits(proposer.model, batch, anchors), theirs, "logits")
        return
    # full attention: the peer trained bidirectionally, vLLM serves the field (false) causally
    assert served.block_attention == "causal" and "vLLM serves them causally" in caplog.text
    assert not torch.allclose(_dflash_our_logits(proposer.model, batch, anchors), theirs, atol=1e-3)
    trained = load_exported_draft(out, tiny_model_dir, block_attention="bidirectional")
    assert_same_tensor(_dflash_our_logits(trained.model, batch, anchors), theirs, "logits")


def test_speculators_eagle3_loads_and_runs_like_the_peer(tiny_model_dir, batch, tmp_path):
    out = tmp_path / "peer"
    peer = _save_peer_eagle3(tiny_model_dir, out)
    saved = load_file(str(out / "model.safetensors"))
    assert "embed_tokens.weight" in saved and "input_norm.weight" in saved and "d2t" not in saved
    proposer = load_exported_draft(out, tiny_model_dir)
    ours = proposer.model
    assert ours.cfg.norm_before_fc and ours.cfg.norm_output and ours.input_norm is not None
    T = int(batch.doc_ends[0]) - 4  # chains from slot T - 1 stay inside the document for 3 steps
    from spectrain.models import DraftContext

    ours_logits, peer_logits = _eagle3_step_logits(ours, peer.eval(), batch)
    chain = ours.propose(DraftContext(batch.aux_hidden[:T], batch.input_ids[: T + 1].tolist()), 1)
    assert chain == [int(peer_logits[0][T - 1].argmax())]
    for j in range(3):
        assert_same_tensor(ours_logits[j], peer_logits[j], f"step {j}")


def _eagle3_step_logits(ours, peer, batch):
    """Each TTT step's logits on the first document, ours and the peer's (teacher forcing on both
    sides; the peer reads the document shifted as its data pipeline does), on the rows whose
    three-step chains stay inside the document."""
    n = int(batch.doc_ends[0])
    seen, logits = [], []
    hook = peer.lm_head.register_forward_hook(lambda m, i, o: seen.append(o[0].detach()))
    with torch.no_grad():
        peer(hidden_states=batch.aux_hidden[: n - 1].reshape(1, n - 1, -1), input_ids=batch.input_ids[1:n][None],
             document_ids=torch.zeros(1, n - 1, dtype=torch.long), position_ids=torch.arange(1, n)[None],
             ttt_steps=3)  # fmt: skip
    hook.remove()
    hook = ours.norm.register_forward_hook(lambda m, i, o: logits.append(o.detach() @ ours.lm_head.weight.T))
    with torch.no_grad():
        ours(batch)
    hook.remove()
    rows = [torch.arange(0, n - 2 - j) for j in range(3)]
    return [logits[j][rows[j]] for j in range(3)], [seen[j][rows[j]] for j in range(3)]


def test_full_vocabulary_maps_and_verifier_tensors_are_checked(tiny_model_dir, tmp_path):
    out = tmp_path / "peer"
    _save_peer_eagle3(tiny_model_dir, out)
    weights = load_file(str(out / "model.safetensors"))
    vocab = weights["embed_tokens.weight"].shape[0]
    ok = tmp_path / "with-maps"
    shutil.copytree(out, ok)
    save_file({**weights, "d2t": torch.zeros(vocab, dtype=torch.int64), "t2d": torch.ones(vocab, dtype=torch.bool)},
              str(ok / "model.safetensors"))  # fmt: skip
    load_exported_draft(ok, tiny_model_dir)  # identity maps at full vocabulary: accepted
    bad_embed = {**weights, "embed_tokens.weight": weights["embed_tokens.weight"] + 1}
    save_file(bad_embed, str(ok / "model.safetensors"))
    with pytest.raises(DraftLoadError, match="embed_tokens.weight differs from the verifier's"):
        load_exported_draft(ok, tiny_model_dir)


@pytest.mark.parametrize(
    "edit,message",
    [
        (lambda c: c.update(fc_norm=True), "fc_norm"),
        (lambda c: c.update(surprise=1), r"fields \['surprise'\] are not understood"),
        (lambda c: c["transformer_layer_config"].update(model_type="qwen3"), "model_type 'qwen3'"),
        (lambda c: c["transformer_layer_config"].update(rms_norm_eps=1e-3), "rms_norm_eps"),
        (lambda c: c["transformer_layer_config"].update(hidden_act="gelu"), "hidden_act"),
        (lambda c: c["transformer_layer_config"].update(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4}),
         "rope type 'yarn'"),
    ],
)  # fmt: skip
def test_eagle3_config_fields_are_honoured_or_refused(tiny_model_dir, tmp_path, edit, message):
    out = tmp_path / "peer"
    _save_peer_eagle3(tiny_model_dir, out)
    cfg = json.loads((out / "config.json").read_text())
    edit(cfg)
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(DraftLoadError, match=message):
        load_exported_draft(out, tiny_model_dir)


@pytest.mark.parametrize(
    "edit,message",
    [
        (lambda c: c.update(sample_from_anchor=True), "sample_from_anchor"),
        (lambda c: c["transformer_layer_config"].update(layer_types=["sliding_attention", "full_attention"]),
         "mix sliding and full"),
        (lambda c: c.update(target_hidden_size=32), "target_hidden_size 32"),
    ],
)  # fmt: skip
def test_dflash_config_fields_are_honoured_or_refused(tiny_model_dir, tmp_path, edit, message):
    out = tmp_path / "peer"
    _save_peer_dflash(tiny_model_dir, out, sliding=True)
    cfg = json.loads((out / "config.json").read_text())
    edit(cfg)
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(DraftLoadError, match=message):
        load_exported_draft(out, tiny_model_dir)


def test_fine_tune_a_speculators_draft(tiny_model_dir, tiny_store, tmp_path):
    """``spectrain train --from-pretrained`` starts from the peer's weights and keeps its architecture."""
    from spectrain.cli import main
    from spectrain.train.loop import TrainConfig, Trainer

    out = tmp_path / "peer"
    _save_peer_eagle3(tiny_model_dir, out)
    saved = load_file(str(out / "model.safetensors"))
    cfg = TrainConfig(store=str(tiny_store), verifier=str(tiny_model_dir), save_path=str(tmp_path / "t"),
                      speculator_type="eagle3", from_pretrained=str(out), draft={"target_mode": "hard"},
                      total_seq_len=256, max_steps=2, val_fraction=0.0, num_workers=0)  # fmt: skip
    trainer = Trainer(cfg)
    try:
        state = trainer.model.state_dict()
        for name in ("fc.weight", "input_norm.weight", "layers.0.self_attn.q_proj.weight", "lm_head.weight"):
            assert torch.equal(state[name], saved[name].float()), name
        assert trainer.draft_cfg.target_mode == "hard" and trainer.draft_cfg.norm_output
    finally:
        trainer.close()
    save = tmp_path / "run"
    args = ["train", "--store", str(tiny_store), "--verifier", str(tiny_model_dir), "--save-path", str(save),
            "--from-pretrained", str(out), "--total-seq-len", "256", "--max-steps", "2", "--val-fraction", "0",
            "--num-workers", "0", "--verifier-name", "org/model"]  # fmt: skip
    res = CliRunner().invoke(main, args, catch_exceptions=False)
    assert res.exit_code == 0, res.output
    exported = json.loads((save / "checkpoint-00000002" / "config.json").read_text())
    assert exported["speculators_model_type"] == "eagle3"
    assert exported["norm_before_fc"] and exported["norm_output"]
    assert "input_norm.weight" in load_file(str(save / "checkpoint-00000002" / "model.safetensors"))
    res = CliRunner().invoke(main, [*args, "--save-path", str(tmp_path / "x"), "--num-layers", "2"])
    assert res.exit_code != 0 and "num_layers=2 conflicts" in res.output


def _our_draft(tiny_model_dir, algorithm):
    torch.manual_seed(0)
    heads = VerifierHeads.load(tiny_model_dir)
    options = {
        "dflash": dict(num_layers=2, block_size=B, max_anchors=64),
        "eagle3": dict(draft_vocab_size=500, ttt_steps=3, norm_before_fc=True, norm_output=True),
    }[algorithm]
    model = build_draft(get_config_class(algorithm)(aux_layer_ids=tuple(AUX), **options), heads)
    model.prepare(torch.arange(heads.vocab_size, 0, -1, dtype=torch.float64))
    perturb_norms(model)
    return model


def _peer_from_export(cls, path):
    config = cls.config_class.from_pretrained(path)
    config.transformer_layer_config._attn_implementation = "eager"
    return cls.from_pretrained(path, config=config, dtype=torch.float32).eval()


def test_our_dflash_export_loads_in_speculators(tiny_model_dir, batch, tmp_path):
    out = export_draft(
        _our_draft(tiny_model_dir, "dflash"), tmp_path / "ours", verifier_name=str(tiny_model_dir)
    )
    peer = _peer_from_export(dflash_core.DFlashDraftModel, out)
    ours = load_exported_draft(out, tiny_model_dir).model  # the same bf16-rounded weights
    anchors = ours.anchor_candidates(batch).nonzero().flatten()[:16]
    with torch.no_grad():
        theirs = _dflash_peer_logits(peer, batch, anchors)
    assert_same_tensor(_dflash_our_logits(ours, batch, anchors), theirs, "logits")


def test_our_eagle3_export_loads_in_speculators(tiny_model_dir, batch, tmp_path):
    # speculators' Eagle3 from_pretrained leaves embed_tokens uninitialised when a checkpoint omits it
    out = export_draft(_our_draft(tiny_model_dir, "eagle3"), tmp_path / "ours", verifier_name=str(tiny_model_dir),
                       include_embeddings=True)  # fmt: skip
    peer = _peer_from_export(eagle3_core.Eagle3DraftModel, out)
    ours = load_exported_draft(out, tiny_model_dir).model
    ours.verifier.embed_tokens = (
        ours.verifier.embed_tokens.bfloat16().float()
    )  # as exported, and as the peer has
    assert peer.config.norm_before_fc and peer.config.norm_output and peer.config.draft_vocab_size == 500
    assert torch.equal(peer.t2d, ours.t2d) and torch.equal(peer.d2t, ours.d2t)
    ours_logits, peer_logits = _eagle3_step_logits(ours, peer, batch)
    for j in range(3):
        assert_same_tensor(ours_logits[j], peer_logits[j], f"step {j}")
