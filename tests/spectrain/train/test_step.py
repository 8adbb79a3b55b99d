"""The training step never waits for the device: fixed-shape anchors, device-side skips, read-later checks."""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import logging

import pytest
import torch
from _tiny_drafts import S, V, draft, heads, packed

from spectrain.train.optim import OptimConfig, SkippableMuon, build_optimizers
from spectrain.train.step import NonFiniteTraining, StepChecks, train_step
from spectrain.train.sync_census import census

CPU = torch.device("cpu")


def _step(model, opt, batches, seed=0, **kw):
    gens = [torch.Generator().manual_seed(seed + i) for i in range(len(batches))]
    return train_step(model, model, opt, batches, gens, autocast=contextlib.nullcontext, max_grad_norm=1.0,
                      device=CPU, **kw)  # fmt: skip


def _optimizer(model, kind):
    return build_optimizers(model, OptimConfig(optimizer=kind, lr=1e-2), lambda s: 1.0, fused=True)


def _old_sample_anchors(model, batch, generator):
    """The variable-length draw DFlash made before its shapes were fixed (nonzero, then topk of rand(n))."""
    cand = model.anchor_candidates(batch).nonzero().flatten()
    if cand.numel() > model.cfg.max_anchors:
        scores = torch.rand(cand.numel(), generator=generator)
        cand = cand[scores.topk(model.cfg.max_anchors).indices].sort().values
    return cand


@pytest.mark.parametrize("max_anchors", [4, 16, 64, 1000])
@pytest.mark.parametrize("rule", ["document", "packed"])
def test_anchors_are_drawn_in_a_fixed_buffer_as_the_variable_length_draw_was(max_anchors, rule):
    model = draft("dflash", max_anchors=max_anchors, anchor_rule=rule)
    for seed in range(5):
        batch = packed(seed)
        anchors, valid = model.draw_anchors(batch, torch.Generator().manual_seed(seed))
        assert anchors.shape == valid.shape == (min(max_anchors, S),)
        want = _old_sample_anchors(model, batch, torch.Generator().manual_seed(seed))
        assert torch.equal(anchors[valid], want)
        assert valid[: want.numel()].all() and not valid[want.numel() :].any()  # valid first, ascending
        assert (anchors[~valid] == 0).all()


def test_a_sequence_without_anchors_trains_nothing_and_reports_zeros():
    model = draft("dflash")
    batch = dataclasses.replace(packed(), loss_mask=torch.zeros(S, dtype=torch.bool))
    loss, metrics = model(batch, torch.Generator().manual_seed(0))
    loss.backward()
    assert float(loss.detach()) == 0.0
    assert all(float(p.grad.abs().sum()) == 0.0 for p in model.parameters() if p.requires_grad)
    assert set(metrics) == {"acc_correct", "acc_total", "accepted_sum", "chains", "loss_sum", "weight_sum"}
    assert all(float(v.abs().sum()) == 0.0 for v in metrics.values())
    assert metrics["acc_total"].shape == (model.cfg.block_size - 1,)


@pytest.mark.parametrize("algorithm", ["dflash", "dspark", "eagle3"])
@pytest.mark.parametrize("kind", ["adamw", "muon"])
def test_a_whole_step_makes_no_host_device_sync(algorithm, kind):
    """Forward, backward, clipping, the non-finite decision and the update (two sequences, as with
    gradient accumulation): nothing that would make the host wait for a GPU."""
    model = draft(algorithm)
    opt = _optimizer(model, kind)
    batches = [packed(1), packed(2)]
    _step(model, opt, batches)  # the optimizer's state exists from here on
    syncs = census(lambda: _step(model, opt, batches, seed=5), CPU)
    assert syncs == {}
    # the census sees what would sync: a value read on the host, a data-sized result
    seen = census(lambda: (float(model.fc.weight.sum()), model.fc.weight[model.fc.weight > 0]), CPU)
    assert sorted(k.split()[0] for k in seen) == ["bool-index", "item"]


@pytest.mark.parametrize("algorithm", ["dflash", "dspark", "eagle3"])
def test_step_results_stay_on_the_device_and_equal_the_plain_step(algorithm):
    """train_step's loss, metrics and update are those of model(batch), backward, clip, optimizer."""
    model = draft(algorithm)
    twin = copy.deepcopy(model)
    batch = packed(3)
    result = _step(model, _optimizer(model, "adamw"), [batch], seed=7)
    opt = _optimizer(twin, "adamw")
    loss, metrics = twin(batch, torch.Generator().manual_seed(7))
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_([p for p in twin.parameters() if p.requires_grad], 1.0)
    opt.step()  # no skip flag at all
    assert torch.equal(result.loss, loss.detach()) and torch.equal(result.grad_norm, norm)
    assert bool(result.applied) and result.loss.device == CPU and result.flops.dtype == torch.float64
    assert float(result.flops) > 0
    assert all(torch.equal(result.sums[k], v.double()) for k, v in metrics.items())
    for (n, p), q in zip(model.named_parameters(), twin.parameters(), strict=True):
        assert torch.equal(p, q), n


def _state(model, opt):
    weights = {n: p.detach().clone() for n, p in model.named_parameters()}
    states = [{k: v.clone() if torch.is_tensor(v) else v for s in o.state.values() for k, v in s.items()}
              for o in opt.optimizers]  # fmt: skip
    return weights, states


@pytest.mark.parametrize("kind", ["adamw", "muon"])
def test_a_nonfinite_step_changes_nothing_and_the_next_one_is_exact(kind):
    model = draft("dflash")
    twin = copy.deepcopy(model)
    opt, twin_opt = _optimizer(model, kind), _optimizer(twin, kind)
    good, bad = packed(1), packed(2)
    bad = dataclasses.replace(bad, hidden_states=torch.full_like(bad.hidden_states, float("nan")))
    for m, o in ((model, opt), (twin, twin_opt)):
        _step(m, o, [good], seed=0)
    before = _state(model, opt)
    result = _step(model, opt, [bad], seed=1)
    assert not bool(result.applied) and not torch.isfinite(result.loss)
    after = _state(model, opt)
    assert all(torch.equal(before[0][n], after[0][n]) for n in before[0])
    for a, b in zip(before[1], after[1], strict=True):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)  # moments, step counters
    # the model that skipped continues exactly as one that never saw the bad sequence
    _step(model, opt, [good], seed=2)
    _step(twin, twin_opt, [good], seed=2)
    for (n, p), q in zip(model.named_parameters(), twin.parameters(), strict=True):
        assert torch.equal(p, q), n


def test_skippable_muon_is_torch_muon_operation_for_operation():
    torch.manual_seed(0)
    ps = [torch.nn.Parameter(torch.randn(40, 24)), torch.nn.Parameter(torch.randn(12, 30))]
    qs = [torch.nn.Parameter(p.detach().clone()) for p in ps]
    ref = torch.optim.Muon(ps, lr=0.02, adjust_lr_fn="match_rms_adamw")
    ours = SkippableMuon(qs, lr=0.02, adjust_lr_fn="match_rms_adamw")
    for _ in range(3):
        for p, q in zip(ps, qs, strict=True):
            p.grad = torch.randn_like(p)
            q.grad = p.grad.clone()
        ref.step()
        ours.found_inf = torch.zeros(())
        ours.step()
        assert all(torch.equal(p, q) for p, q in zip(ps, qs, strict=True))


def test_a_token_beyond_the_vocabulary_is_clamped_flagged_and_refused_later(caplog):
    model = draft("eagle3")
    batch = packed(4)
    batch.input_ids[7] = V + 3
    result = _step(model, _optimizer(model, "adamw"), [batch], vocab_size=V)
    assert bool(result.vocab_over) and bool(result.applied)  # trained on a clamped id, no crash
    checks = StepChecks(10, lambda ids: ValueError(f"samples {ids} beyond the vocabulary"))
    checks.record(1, result, batch.sample_ids)
    with pytest.raises(ValueError, match="s4"):
        checks.check()


def test_checks_count_skips_name_samples_and_stop_a_streak(caplog):
    model = draft("dflash")
    opt = _optimizer(model, "adamw")
    bad = packed(2)
    bad = dataclasses.replace(bad, hidden_states=torch.full_like(bad.hidden_states, float("nan")))
    checks = StepChecks(3)
    plan = [packed(1), bad, packed(3), bad, bad]
    for step, b in enumerate(plan, 1):
        checks.record(step, _step(model, opt, [b]), b.sample_ids)
    with caplog.at_level(logging.WARNING):
        checks.check()  # 1 ok, 2 skipped, 3 ok, 4-5 skipped: a streak of two
    assert checks.skipped == 3 and checks.streak == 2
    assert caplog.text.count("not finite, the step is skipped") == 3 and "'s2'" in caplog.text
    assert checks.last_loss() is not None and checks.last_loss() == checks.last_loss()
    checks.record(6, _step(model, opt, [bad]), bad.sample_ids)
    with pytest.raises(NonFiniteTraining, match="3 steps in a row"):
        checks.check()


def test_eagle3_frozen_head_is_kept_in_the_verifiers_dtype():
    bf16 = heads(torch.bfloat16)
    frozen = draft("eagle3", bf16)
    assert frozen.lm_head.weight.dtype == torch.bfloat16 and not frozen.lm_head.weight.requires_grad
    rows = bf16.lm_head.index_select(0, frozen.d2t + torch.arange(frozen.d2t.numel()))
    assert torch.equal(frozen.lm_head.weight, rows)
    trained = draft("eagle3", bf16, freeze_lm_head=False)
    assert trained.lm_head.weight.dtype == torch.float32 and trained.lm_head.weight.requires_grad
    assert torch.equal(trained.lm_head.weight, rows.float())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize(
    ("algorithm", "kind"), [("dflash", "muon"), ("dflash", "adamw"), ("eagle3", "adamw")]
)
def test_a_whole_cuda_step_passes_sync_debug_mode_error(algorithm, kind, compiled):
    """Forward (FlexAttention), backward, clipping, the skip decision, Muon/AdamW: under
    ``torch.cuda.set_sync_debug_mode("error")`` any host-device sync raises."""
    cuda = torch.device("cuda")
    model = draft(algorithm, heads(torch.bfloat16, "cuda"))
    if compiled:
        model.compile_training()
    opt = build_optimizers(model, OptimConfig(optimizer=kind, lr=1e-2), lambda s: 1.0, fused=True)
    batches = [packed(1, device="cuda"), packed(2, device="cuda")]

    def step(seed):
        gens = [torch.Generator(device=cuda).manual_seed(seed + i) for i in range(2)]
        return train_step(model, model, opt, batches, gens, autocast=lambda: torch.autocast("cuda", torch.bfloat16),
                          max_grad_norm=1.0, device=cuda, vocab_size=V)  # fmt: skip

    step(0)  # first step: compilation, optimizer state
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        result = step(1)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert bool(result.applied) and torch.isfinite(result.loss)
