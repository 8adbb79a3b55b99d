"""The chunked vocabulary loss equals the eager one (value, gradients, argmaxes) and stays chunk-sized."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from spectrain.models.vocab_loss import default_chunk_rows, vocab_loss

N, H, V = 37, 24, 300


def eager(hidden, head, target_hidden, target_head, mode):
    """Reference: full logits, log_softmax over the whole vocabulary (as models/common.py does)."""
    autocast = torch.is_autocast_enabled(hidden.device.type)
    logits = F.linear(hidden, head if autocast else head.to(hidden.dtype))
    with torch.no_grad():
        target = F.linear(target_hidden if autocast else target_hidden.to(target_head.dtype), target_head)
    logp = F.log_softmax(logits.float(), dim=-1)
    tgt = target.argmax(-1)
    if mode == "soft":
        loss = F.kl_div(logp, F.softmax(target.float(), dim=-1), reduction="none").sum(-1)
    else:
        loss = F.nll_loss(logp, tgt, reduction="none")
    return loss, logits.detach().argmax(-1), tgt


def _inputs(seed=0, n=N):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, H, generator=g)
    head = torch.randn(V, H, generator=g) * 0.5
    # the verifier's rows: correlated with the draft's so targets are not uniform noise
    target_hidden = hidden + 0.3 * torch.randn(n, H, generator=g)
    target_head = head + 0.1 * torch.randn(V, H, generator=g)
    row_w = torch.rand(n, generator=g)  # a per-row weighting as the drafts apply one
    return hidden, head, target_hidden, target_head, row_w


def _run(fn, mode, train_head, autocast, seed=0, **kw):
    hidden, head, th, tw, row_w = _inputs(seed)
    hidden.requires_grad_(True)
    head.requires_grad_(train_head)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss, pred, tgt = fn(hidden, head, th, tw, mode, **kw)
    (loss * row_w).sum().backward()
    return loss.detach(), pred, tgt, hidden.grad, head.grad


def _rel(a, b):
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


HEADS = [(False, None), (True, True), (True, False)]  # (trainable head, keep_logit_grads)


@pytest.mark.parametrize("mode", ["soft", "hard"])
@pytest.mark.parametrize(("train_head", "keep"), HEADS)
@pytest.mark.parametrize("chunk", [5, 37, 8, 1000])  # 37 = N; 5 and 8 do not divide it
def test_fp32_equals_eager(mode, train_head, keep, chunk):
    ref = _run(eager, mode, train_head, False)
    got = _run(vocab_loss, mode, train_head, False, chunk_rows=chunk, keep_logit_grads=keep)
    assert got[0].dtype == torch.float32 and got[0].shape == (N,)
    assert _rel(got[0], ref[0]) < 1e-5
    assert torch.equal(got[1], ref[1]) and torch.equal(got[2], ref[2])
    assert _rel(got[3], ref[3]) < 1e-5
    if train_head:
        assert got[4] is not None and _rel(got[4], ref[4]) < 1e-5
    else:
        assert got[4] is None


@pytest.mark.parametrize("mode", ["soft", "hard"])
@pytest.mark.parametrize(("train_head", "keep"), HEADS)
@pytest.mark.parametrize("chunk", [6, 37])
def test_bf16_autocast_close_to_eager(mode, train_head, keep, chunk):
    """Under bf16 autocast both paths run the same bf16 matmuls and fp32 softmax; the chunked
    one rounds in another order (it scales the row gradient after the bf16 matmul, and sums the
    head gradient over chunks in fp32). Measured: values within 5e-6 relative, gradients within
    4e-3 (bf16's epsilon is 3.9e-3); asserted: 1e-4 and 1e-2."""
    ref = _run(eager, mode, train_head, True)
    got = _run(vocab_loss, mode, train_head, True, chunk_rows=chunk, keep_logit_grads=keep)
    assert got[0].dtype == torch.float32
    assert _rel(got[0], ref[0]) < 1e-4
    assert (got[1] == ref[1]).float().mean() > 0.95 and torch.equal(got[2], ref[2])
    assert _rel(got[3], ref[3]) < 1e-2
    if train_head:
        assert _rel(got[4], ref[4]) < 1e-2


def test_no_grad_and_float64():
    hidden, head, th, tw, _ = _inputs(1)
    with torch.no_grad():
        got = vocab_loss(hidden, head, th, tw, "soft", chunk_rows=7)
    ref = eager(hidden, head, th, tw, "soft")
    assert _rel(got[0], ref[0]) < 1e-5 and torch.equal(got[2], ref[2])
    d = [t.double() for t in (hidden, head, th, tw)]
    loss = vocab_loss(*d, "hard", chunk_rows=9)[0]
    assert loss.dtype == torch.float64
    assert _rel(loss, F.cross_entropy(d[0] @ d[1].T, (d[2] @ d[3].T).argmax(-1), reduction="none")) < 1e-12


def test_soft_loss_is_kl_zero_at_the_target():
    hidden, head, _, _, _ = _inputs(2)
    loss, pred, tgt = vocab_loss(hidden, head, hidden, head, "soft", chunk_rows=10)
    assert loss.abs().max() < 1e-5 and torch.equal(pred, tgt)


def test_bad_input_names_the_field():
    hidden, head, th, tw, _ = _inputs(0)
    with pytest.raises(ValueError, match="target_mode"):
        vocab_loss(hidden, head, th, tw, "kl")
    with pytest.raises(ValueError, match="target_head_weight"):
        vocab_loss(hidden, head, th, tw[:10], "soft")
    with pytest.raises(ValueError, match="target_hidden"):
        vocab_loss(hidden, head, th[:3], tw, "soft")


def test_keep_logit_grads_defaults_by_size(monkeypatch):
    """A trainable head keeps its logit gradients when they fit KEEP_BYTES, else recomputes."""
    import spectrain.models.vocab_loss as vl

    hidden, head, th, tw, _ = _inputs(5)
    head.requires_grad_(True)
    for budget, want in ((N * V * 4, 1), (N * V * 4 - 1, 0)):
        monkeypatch.setattr(vl, "KEEP_BYTES", budget)
        rec = _SavedBytes()
        with torch.autograd.graph.saved_tensors_hooks(rec.pack, lambda t: t):
            vocab_loss(hidden, head, th, tw, "soft")
        assert sum(s == (N, V) for s in rec.shapes) == want


def test_default_chunk_rows():
    assert default_chunk_rows(151936) == 384  # 256 MiB / (4 * 151936) = 441 -> 384
    assert default_chunk_rows(32000) == 2048
    assert default_chunk_rows(10**9) == 64


# --------------------------------------------------------------------------- memory


class _SavedBytes:
    """Bytes of the distinct storages autograd keeps for backward (saved-tensor hooks)."""

    def __init__(self):
        self.storages: dict[int, int] = {}
        self.shapes: list[tuple[int, ...]] = []

    def pack(self, t):
        self.storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        self.shapes.append(tuple(t.shape))
        return t

    @property
    def total(self) -> int:
        return sum(self.storages.values())


@pytest.mark.parametrize(("train_head", "keep"), HEADS)
@pytest.mark.parametrize("mode", ["soft", "hard"])
def test_saved_for_backward_has_no_vocabulary_sized_activation(train_head, keep, mode):
    n, v = 256, 4096
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(n, H, generator=g, requires_grad=True)
    head = torch.randn(v, H, generator=g).requires_grad_(train_head)
    th, tw = torch.randn(n, H, generator=g), torch.randn(v, H, generator=g)
    saved = {}
    for name, fn, kw in (("eager", eager, {}), ("chunked", vocab_loss, {"keep_logit_grads": keep})):
        rec = _SavedBytes()
        with torch.autograd.graph.saved_tensors_hooks(rec.pack, lambda t: t):
            loss = fn(hidden, head, th, tw, mode, **kw)[0]
        loss.sum().backward()
        saved[name] = rec
    weights = {head.untyped_storage().data_ptr(), tw.untyped_storage().data_ptr()}
    chunked_acts = {p: b for p, b in saved["chunked"].storages.items() if p not in weights}
    # what the chunked loss keeps: [N, H] rows (grad or inputs) and [N] vectors, nothing [N, V]
    # unless asked to keep a trainable head's logit gradients (one [N, V] tensor then)
    kept = n * v * 4 if keep else 0
    assert sum(chunked_acts.values()) <= 2 * n * H * 4 + 3 * n * 8 + kept
    assert sum(s == (n, v) for s in saved["chunked"].shapes) == (1 if keep else 0)
    assert any(s == (n, v) for s in saved["eager"].shapes)  # the eager loss keeps [N, V] logits
    eager_acts = sum(b for p, b in saved["eager"].storages.items() if p not in weights)
    assert eager_acts >= n * v * 4


def _peak_extra_bytes(fn, *external) -> int:
    """Peak bytes of tensor storage created while ``fn`` ran, above the ``external`` tensors
    (torch's MemTracker: a dispatch mode that follows every storage until it is freed)."""
    from torch.distributed._tools.mem_tracker import MemTracker

    mt = MemTracker()
    mt.track_external(*external)
    base = mt.get_tracker_snapshot("current")[torch.device("cpu")]["Total"]
    with mt:
        fn()
    return mt.get_tracker_snapshot("peak")[torch.device("cpu")]["Total"] - base


@pytest.mark.parametrize("train_head", [False, True])
def test_peak_extra_memory_is_bounded_by_one_chunk(train_head):
    """Frozen head, and trainable head recomputing in backward (keeping is opt-in above a size)."""
    n, v, chunk = 512, 8192, 32
    g = torch.Generator().manual_seed(4)
    hidden = torch.randn(n, H, generator=g, requires_grad=True)
    head = torch.randn(v, H, generator=g).requires_grad_(train_head)
    th, tw = torch.randn(n, H, generator=g), torch.randn(v, H, generator=g)

    def step(fn, **kw):
        def run():
            loss = fn(hidden, head, th, tw, "soft", **kw)[0]
            loss.sum().backward()
            hidden.grad = head.grad = None

        return run

    chunk_bytes = chunk * v * 4
    got = _peak_extra_bytes(step(vocab_loss, chunk_rows=chunk, keep_logit_grads=False), hidden, head, th, tw)
    ref = _peak_extra_bytes(step(eager), hidden, head, th, tw)
    head_grad = v * H * 4 if train_head else 0
    # about three fp32 chunks at once, plus [N, H]/[N] tensors and the head's own gradient
    assert got <= 4 * chunk_bytes + 4 * n * H * 4 + head_grad + 64 * n, (got, chunk_bytes)
    assert ref >= 2 * n * v * 4  # the eager loss holds at least two [N, V] fp32 tensors
    assert got * 4 < ref


# --------------------------------------------------------------------------- targets formed once


def _run_targets(mode, train_head, autocast, index, **kw):
    """The loss on the verifier targets of rows ``index`` of a larger set, formed once beforehand."""
    from spectrain.models.vocab_loss import verifier_targets

    hidden, head, th, tw, row_w = _inputs(6)
    hidden.requires_grad_(True)
    head.requires_grad_(train_head)
    extra = torch.randn(11, H, generator=torch.Generator().manual_seed(9))
    pool = torch.cat([th, extra])[torch.randperm(N + 11, generator=torch.Generator().manual_seed(1))]
    rows = torch.cat([(pool == r).all(1).nonzero()[0] for r in th])  # th[i] == pool[rows[i]]
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        targets = (
            verifier_targets(pool, tw, mode, chunk_rows=7).take(rows)
            if index
            else verifier_targets(th, tw, mode)
        )
        loss, pred, tgt = vocab_loss(hidden, head, mode=mode, targets=targets, **kw)
    (loss * row_w).sum().backward()
    return loss.detach(), pred, tgt, hidden.grad, head.grad


@pytest.mark.parametrize("mode", ["soft", "hard"])
@pytest.mark.parametrize(("train_head", "keep"), HEADS)
@pytest.mark.parametrize("autocast", [False, True])
@pytest.mark.parametrize("index", [False, True])
def test_targets_formed_once_equal_targets_formed_per_chunk(mode, train_head, keep, autocast, index):
    """Eagle3 forms the verifier's targets once per sequence and each TTT step takes its rows:
    the same loss, argmaxes and gradients as forming them from the rows inside the loss (up to
    the matmul's rounding for a different row count: soft targets are one [N, V] product)."""
    ref = _run(vocab_loss, mode, train_head, autocast, seed=6, chunk_rows=8, keep_logit_grads=keep)
    got = _run_targets(mode, train_head, autocast, index, chunk_rows=8, keep_logit_grads=keep)
    assert torch.equal(got[1], ref[1]) and torch.equal(got[2], ref[2])
    assert _rel(got[0], ref[0]) < 1e-5 and _rel(got[3], ref[3]) < 1e-5
    assert (got[4] is None) == (ref[4] is None) and (got[4] is None or _rel(got[4], ref[4]) < 1e-5)


def test_targets_formed_once_are_not_changed_by_the_loss():
    from spectrain.models.vocab_loss import verifier_targets

    hidden, head, th, tw, _ = _inputs(7)
    targets = verifier_targets(th, tw, "soft")
    before = targets.logits.clone()
    hidden.requires_grad_(True)
    vocab_loss(hidden, head, mode="soft", targets=targets, chunk_rows=5)[0].sum().backward()
    assert torch.equal(targets.logits, before)
    with pytest.raises(ValueError, match="targets"):
        vocab_loss(hidden, head, mode="soft", targets=verifier_targets(th, tw, "hard"))


def test_chunks_on_cuda_fill_the_gpu():
    """On CUDA a chunk is at least 2560 rows (its gradient GEMM: 640 tiles at H 4096, ~4.85 waves
    of 132 SMs); off CUDA the 256 MiB budget holds."""
    assert default_chunk_rows(151936, device_type="cuda") == 2560
    assert default_chunk_rows(32000, device_type="cuda") == 2560
    assert default_chunk_rows(1000, device_type="cuda") == default_chunk_rows(1000) == 67072
    assert default_chunk_rows(151936, device_type="cpu") == 384
