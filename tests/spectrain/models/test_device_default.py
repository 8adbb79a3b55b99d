"""Both drafts built and stepped on a non-CPU device, with it the default: fake CUDA tensors.

A CPU run never sees a host tensor meet a tensor made on the default device (issue 20's crash:
``build_vocab_map`` subtracting an ``arange`` on the GPU from a host tensor). Under
:func:`_fake_cuda.fake_cuda` every such mix raises as on a GPU. The drafts are built as
``scripts/bench_train.py`` builds them (the verifier's heads on the device, the draft under
``with torch.device("cuda")``, token counts from the host), then take a step: the training
forward (the draws, the masks, the vocabulary loss), the gradient clipping and both optimizers'
updates. The gradients are stand-ins of the parameters' shapes: a CPU build of torch aborts the
process when autograd records a leaf on a CUDA device, fake or not.
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import pytest
import torch
from _fake_cuda import fake_cuda

from spectrain.models import build_draft, get_config_class, layers
from spectrain.models.verifier import VerifierHeads, VerifierInfo
from spectrain.train.optim import OptimConfig, build_optimizers

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "scripts"))
import bench_train  # noqa: E402

SHAPE = bench_train.TINY_SHAPE


@contextlib.contextmanager
def flex_as_dense():
    """FlexAttention's block mask cannot be compiled for fake tensors: the flex backend reads the
    same ``MaskSpec`` as a dense mask (evaluated on the device, so its index tensors are checked)."""
    saved = layers.attend, layers.block_mask_for

    def attend(q, k, v, spec, backend, *, block_mask=None, dense_mask=None):
        assert backend == "flex" and spec.device == q.device, (backend, spec.device, q.device)
        return saved[0](q, k, v, spec, "sdpa", dense_mask=block_mask)

    layers.attend, layers.block_mask_for = attend, lambda spec: spec.dense()
    try:
        yield
    finally:
        layers.attend, layers.block_mask_for = saved


def device_heads() -> VerifierHeads:
    V, H = SHAPE["vocab"], SHAPE["hidden"]
    info = VerifierInfo(path="s", name_or_path="s", architectures=("Qwen3ForCausalLM",), model_type="qwen3",
                        hidden_size=H, vocab_size=V, num_hidden_layers=36, num_attention_heads=SHAPE["heads"],
                        num_key_value_heads=SHAPE["kv"], head_dim=SHAPE["head_dim"],
                        intermediate_size=SHAPE["inter"], rms_norm_eps=1e-6, rope_theta=1e6,
                        max_position_embeddings=4096, tie_word_embeddings=False)  # fmt: skip
    emb, head = torch.randn(V, H, dtype=torch.bfloat16), torch.randn(V, H, dtype=torch.bfloat16)
    return VerifierHeads(info, emb, torch.ones(H, dtype=torch.bfloat16), head)


VARIANTS = {  # (options, optimizer): every draft, vocabulary map and optimizer once
    "dflash": (bench_train.TINY_OPTS["dflash"], "muon"),
    "dflash-reduced": ({**bench_train.TINY_OPTS["dflash"], "draft_vocab_size": 256}, "adamw"),
    "eagle3": (bench_train.TINY_OPTS["eagle3"], "adamw"),
    "eagle3-trainable-head": ({**bench_train.TINY_OPTS["eagle3"], "freeze_lm_head": False}, "muon"),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_build_and_step_with_cuda_the_default_device(variant):
    name = variant.split("-")[0]
    options, optimizer = VARIANTS[variant]
    with fake_cuda():
        heads = device_heads()
        assert heads.lm_head.device.type == "cuda"
        model = build_draft(get_config_class(name)(aux_layer_ids=bench_train.AUX_LAYERS, **options), heads)
        if model.needs_token_counts:
            model.prepare(torch.arange(SHAPE["vocab"], dtype=torch.float64, device="cpu"))
        assert {p.device.type for p in model.state_dict().values()} == {"cuda"}
        opt = build_optimizers(model, OptimConfig(optimizer=optimizer, lr=1e-4), lambda s: 1.0, fused=True)
        with torch.device("cpu"):  # the loader's batch comes from the host
            batch = bench_train.synthetic_batch(SHAPE, 3, "cpu")
        batch = batch.to("cuda", non_blocking=True)
        with flex_as_dense(), torch.no_grad():
            loss, metrics = model(batch, None)
        assert loss.device.type == "cuda" and all(v.device.type == "cuda" for v in metrics.values())
        params = [p for p in model.parameters() if p.requires_grad]
        for p in params:
            p.grad = torch.empty_like(p)
        norm = torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step(skip=~torch.isfinite(norm))
        opt.zero_grad()
        assert torch.isfinite(model.last_flops).device.type == "cuda"


def test_bench_train_builds_on_the_device(monkeypatch):
    """``bench_train.build`` itself, the crash of issue 20 (its verifier comes from a CUDA generator,
    which a CPU build cannot make: the heads are drawn without one)."""
    monkeypatch.setattr(bench_train, "synthetic_verifier", lambda shape, device, dtype: device_heads())
    with fake_cuda():
        for name in ("dflash", "eagle3"):
            model, heads = bench_train.build(name, bench_train.TINY_OPTS[name], SHAPE, torch.device("cuda"),
                                             torch.bfloat16)  # fmt: skip
            assert heads.lm_head.device.type == "cuda"
            assert {t.device.type for t in model.state_dict().values()} == {"cuda"}


def test_the_fake_device_refuses_what_a_gpu_refuses():
    """The harness itself: a host tensor meeting a device tensor raises; indexing keeps shapes."""
    from torch._subclasses.fake_tensor import FakeTensorDeviceMismatchError

    idx = [0, 2]
    indexes = [lambda i: (i,), lambda i: (slice(None), i), lambda i: (Ellipsis, i), lambda i: (0, slice(1, 3)),
               lambda i: (None, i, 1), lambda i: (i, Ellipsis, slice(2))]  # fmt: skip
    want = [torch.zeros(4, 5, 6)[f(torch.tensor(idx))].shape for f in indexes]
    with fake_cuda():
        host = torch.arange(6, device="cpu")
        with pytest.raises(FakeTensorDeviceMismatchError):
            host - torch.arange(6)  # the arange lands on the default device, as in build_vocab_map
        x = torch.zeros(4, 5, 6)
        for f, shape in zip(indexes, want, strict=True):
            got = x[f(torch.tensor(idx))]
            assert got.shape == shape and got.device.type == "cuda", (f(idx), got.shape, shape)
        x[:, 0] = 1.0
        x[torch.tensor(idx)] = torch.ones(5, 6)
