#!/usr/bin/env python
"""Training throughput of DFlash and Eagle3 drafts, and the loader's tokens/s from a store.

GPU: the issue's reference shape (Qwen3-8B verifier: one packed sequence of 8192 tokens,
hidden 4096, 32 heads, 8 KV heads, head dim 128, intermediate 12288, vocab 151936, 3 aux
layers; DFlash 5 layers, block 16, 512 anchors, full-vocabulary loss; Eagle3 1 layer, 3 TTT
steps, draft vocab 32000; AdamW, bf16). CPU: a small shape (``--quick`` shorter still).
MFU = the model's counted matmul FLOPs per step / step time / ``--peak-tflops``.

Progress goes to stderr; the last stdout line is one JSON object with the keys ``device``,
``dflash_tokens_per_s``, ``eagle3_tokens_per_s``, ``loader_tokens_per_s``, ``dflash_mfu``,
``eagle3_mfu`` (the MFU values are null on CPU), and ``loader_gbps`` / ``loader_ratio`` from
``scripts/bench_loader.py`` (store -> packed sequence against a raw ``preadv`` of the same bytes).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

log = logging.getLogger("bench_train")

GPU_SHAPE = dict(seq=8192, hidden=4096, heads=32, kv=8, head_dim=128, inter=12288, vocab=151936)
CPU_SHAPE = dict(seq=1024, hidden=256, heads=4, kv=2, head_dim=64, inter=768, vocab=8192)


def synthetic_verifier(shape: dict, device: torch.device, dtype: torch.dtype):
    """Random frozen heads with the verifier's shape (no checkpoint needed)."""
    from spectrain.verifier import VerifierHeads, VerifierInfo

    info = VerifierInfo(
        path="synthetic", name_or_path="Qwen/Qwen3-8B", architectures=("Qwen3ForCausalLM",), model_type="qwen3",
        hidden_size=shape["hidden"], vocab_size=shape["vocab"], num_hidden_layers=36,
        num_attention_heads=shape["heads"], num_key_value_heads=shape["kv"], head_dim=shape["head_dim"],
        intermediate_size=shape["inter"], rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=40960,
        tie_word_embeddings=False,
    )  # fmt: skip
    g = torch.Generator().manual_seed(0)
    emb = (torch.randn(shape["vocab"], shape["hidden"], generator=g) * 0.02).to(dtype)
    head = (torch.randn(shape["vocab"], shape["hidden"], generator=g) * 0.02).to(dtype)
    return VerifierHeads(info, emb, torch.ones(shape["hidden"], dtype=dtype), head).to(device)


def synthetic_batch(shape: dict, n_aux: int, device: torch.device, docs: int):
    """One packed sequence of ``docs`` equal documents, loss mask 1 everywhere."""
    from spectrain.data import Batch

    S = shape["seq"]
    doc_len = S // docs
    pos = torch.arange(S) % doc_len
    doc = torch.arange(S) // doc_len
    ends = (doc + 1) * doc_len
    g = torch.Generator().manual_seed(1)
    hs = torch.randn(S, n_aux + 1, shape["hidden"], generator=g).to(torch.bfloat16)
    ids = torch.randint(0, shape["vocab"], (S,), generator=g)
    return Batch(ids, torch.ones(S, dtype=torch.bool), pos, doc, ends, hs, num_tokens=S).to(device)


def bench_model(name: str, opts: dict, shape: dict, device, steps: int, warmup: int, docs: int) -> dict:
    from spectrain.models import build_draft, get_config_class

    amp = device.type == "cuda"
    heads = synthetic_verifier(shape, device, torch.bfloat16 if amp else torch.float32)
    cfg = get_config_class(name)(aux_layer_ids=(2, 18, 33), **opts)
    model = build_draft(cfg, heads)
    if name == "eagle3":
        model.prepare(torch.arange(shape["vocab"], dtype=torch.float64))
    model.to(device).train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, fused=amp)
    batch = synthetic_batch(shape, 3, device, docs)
    times, flops = [], 0.0
    for i in range(warmup + steps):
        if amp:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
            loss, _ = model(batch, torch.Generator().manual_seed(i))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if amp:
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        if i >= warmup:
            times.append(dt)
            flops = model.last_flops
        log.info("%s step %d: %.1f ms loss %.3f", name, i, dt * 1e3, float(loss))
    step = float(np.median(times))
    return {"step_s": step, "tokens_per_s": shape["seq"] / step, "flops": flops}


def bench_loader(hidden: int, samples: int, tokens: int, seq: int, workers: int) -> float:
    """Tokens/s of PackedLoader (DataLoader workers) over a fresh store of 3 aux + 1 target layers."""
    from hsgen.store import HiddenStateStore, StoreHeader
    from hsgen.store.synthetic import make_sample
    from spectrain.data import PackedLoader, StoreSource

    with tempfile.TemporaryDirectory(prefix="bench-train-") as tmp:
        header = StoreHeader(
            verifier="bench", layer_ids=(2, 18, 33, 36), hidden_size=hidden, dtype="bfloat16"
        )
        store = HiddenStateStore.create(Path(tmp) / "store", header)
        with store.writer("bench") as w:
            for i in range(samples):
                s = make_sample(header, f"b{i:05d}", tokens, seed=i)
                w.add(s.sample_id, s.hidden_states, s.token_ids, s.loss_mask)
        log.info("loader: store of %d samples x %d tokens written", samples, tokens)
        src = StoreSource(Path(tmp) / "store", val_fraction=0.0)
        plan = src.plan(0)
        loader = PackedLoader(src, plan, total_seq_len=seq, layers=[0, 1, 2, 3], hidden_dtype=torch.bfloat16,
                              num_workers=workers, pin_memory=torch.cuda.is_available())  # fmt: skip
        t0 = time.perf_counter()
        n = sum(b.num_tokens for b in loader)
        dt = time.perf_counter() - t0
        log.info("loader: %d tokens in %.2f s", n, dt)
        return n / dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--quick", action="store_true", help="fewer steps, smaller loader store (~1 minute on CPU)"
    )
    ap.add_argument("--device", default="auto", help="auto | cuda | cpu")
    ap.add_argument("--steps", type=int, default=None, help="timed steps per model")
    ap.add_argument("--docs", type=int, default=1, help="documents per packed sequence")
    ap.add_argument("--peak-tflops", type=float, default=800.0, help="bf16 matmul peak for MFU (H200: ~800)")
    ap.add_argument(
        "--loader-workers", type=int, default=0, help="0 = prefetch thread (the default of train)"
    )
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(message)s")
    device = torch.device("cuda" if (args.device == "auto" and torch.cuda.is_available()) else
                          ("cpu" if args.device == "auto" else args.device))  # fmt: skip
    gpu = device.type == "cuda"
    shape = GPU_SHAPE if gpu else CPU_SHAPE
    steps = args.steps or (3 if args.quick else 10)
    warmup = 3 if gpu else 1
    if gpu:
        dflash = dict(num_layers=5, block_size=16, max_anchors=512)
        eagle = dict(ttt_steps=3, draft_vocab_size=32000)
    else:
        dflash = dict(num_layers=2, block_size=8, max_anchors=64)
        eagle = dict(ttt_steps=3, draft_vocab_size=2048)
    d = bench_model("dflash", dflash, shape, device, steps, warmup, args.docs)
    e = bench_model("eagle3", eagle, shape, device, steps, warmup, args.docs)
    loader_hidden = 4096
    samples, tokens = (16, 1024) if args.quick else (48, 1024)
    loader = bench_loader(loader_hidden, samples, tokens, 8192, args.loader_workers)
    from bench_loader import bench_loader as bench_loader_limit  # scripts/bench_loader.py

    limit = bench_loader_limit(quick=args.quick)
    peak = args.peak_tflops * 1e12
    result = {
        "device": torch.cuda.get_device_name(device) if gpu else "cpu",
        "dflash_tokens_per_s": round(d["tokens_per_s"], 1),
        "eagle3_tokens_per_s": round(e["tokens_per_s"], 1),
        "loader_tokens_per_s": round(loader, 1),
        "loader_gbps": limit["loader_gbps"],
        "loader_ratio": limit["loader_ratio"],
        "dflash_mfu": round(d["flops"] / d["step_s"] / peak, 4) if gpu else None,
        "eagle3_mfu": round(e["flops"] / e["step_s"] / peak, 4) if gpu else None,
    }
    log.info(
        "shape %s; dflash %.1f ms/step, eagle3 %.1f ms/step", shape, d["step_s"] * 1e3, e["step_s"] * 1e3
    )
    print(json.dumps(result))


if __name__ == "__main__":
    main()
