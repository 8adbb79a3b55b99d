#!/usr/bin/env python
"""Training step of DFlash and Eagle3 drafts: timed (tokens/s, peak memory) or planned (FLOPs, memory).

Reference shape (the issue's): Qwen3-8B verifier, one packed sequence of 8192 tokens, hidden
4096, 32 heads, 8 KV heads, head dim 128, intermediate 12288, vocab 151936, 3 aux layers;
DFlash 5 layers, block 16, 512 anchors, full-vocabulary loss; Eagle3 1 layer, 3 TTT steps, draft
vocab 32000; fp32 master weights, bf16 autocast, AdamW, FlexAttention. The packed sequence holds
documents of random lengths in [S/16, S/3) with the loss on the last 65% of each, as the
peer's benchmark (``--layout equal --docs N`` for N equal documents, loss everywhere).

Timed (default): ``spectrain train``'s own step (``spectrain.train.step.train_step``: forward,
backward, clipping, the non-finite check, the update; no host-device sync) on a batch already
on the device; on a GPU at the reference shape (AdamW, and the default optimizer of
``spectrain train`` too when it differs), on CPU at a small shape. ``--compile on|both`` times
the ``torch.compile``'d training forward (``both``: eager and compiled side by side, keys
``*_compiled`` and ``*_compile_speedup``; ``*_first_step_s`` holds the compile). Last stdout
line: JSON with ``device``, ``dflash_tokens_per_s``, ``eagle3_tokens_per_s``,
``dflash_peak_gib``, ``eagle3_peak_gib`` (``torch.cuda.max_memory_allocated``; null on CPU),
``loader_tokens_per_s``, ``dflash_mfu``, ``eagle3_mfu``, and ``loader_gbps`` / ``loader_ratio``
from ``scripts/bench_loader.py`` (store -> packed sequence against a raw ``preadv`` of the same
bytes, side by side). ``--sync-census`` adds ``*_syncs`` (what would synchronise, by source
line) and ``*_sync_free`` (on CUDA: one step under ``set_sync_debug_mode("error")``).
Each part (a draft with an optimizer, eager or compiled) prints the result so far as a JSON line
when it ends (``parts_done`` lists them; ``--json-out FILE`` also replaces FILE with it), so a
run cut by a time bound keeps what it finished; the last line of a whole run has
``"complete": true``. ``--models dflash``, ``dspark`` or ``eagle3`` times one draft (one process per
draft; DSpark at DFlash's shape with a rank-256 Markov head and the confidence head, timed only).

``--plan``: no GPU needed. Builds both drafts at the reference shape with the real model classes
under FakeTensorMode and runs two whole steps through them (``spectrain.train.accounting``): FLOPs
of forward + backward, peak memory (weights, gradients, AdamW state, activations, loss
temporaries). Each variant the code offers is planned: ``as-is`` (the models unchanged), and
where the models route their vocabulary loss through ``vocab_loss`` the eager and the chunked
loss (``spectrain.models.vocab_loss``), and where Eagle3 has ``freeze_lm_head`` both heads.
Last stdout line: JSON with ``dflash_tflop_per_step``, ``eagle3_tflop_per_step``,
``dflash_est_peak_gib``, ``eagle3_est_peak_gib`` (the leanest variant, named in ``*_variant``),
every variant, and the peer's figures; ``*_muon_split``: with ``spectrain train``'s Muon, the
Newton-Schulz TFLOP of the busiest rank when 1, 2 or 8 DDP ranks share the orthogonalisation
(``spectrain.train.muon``), and that rank's whole step (its forward + backward, plus its share).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import gc
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
TINY_SHAPE = dict(seq=512, hidden=64, heads=4, kv=2, head_dim=16, inter=128, vocab=1024)
AUX_LAYERS = (2, 18, 33)

GPU_OPTS = {"dflash": dict(num_layers=5, block_size=16, max_anchors=512),
            "dspark": dict(num_layers=5, block_size=16, max_anchors=512, markov_rank=256),
            "eagle3": dict(ttt_steps=3, draft_vocab_size=32000)}  # fmt: skip
CPU_OPTS = {"dflash": dict(num_layers=2, block_size=8, max_anchors=64),
            "dspark": dict(num_layers=2, block_size=8, max_anchors=64, markov_rank=64),
            "eagle3": dict(ttt_steps=3, draft_vocab_size=2048)}  # fmt: skip
TINY_OPTS = {"dflash": dict(num_layers=2, block_size=8, max_anchors=32),
             "dspark": dict(num_layers=2, block_size=8, max_anchors=32, markov_rank=16),
             "eagle3": dict(ttt_steps=3, draft_vocab_size=256)}  # fmt: skip
MODELS = ("dflash", "dspark", "eagle3")

PEER = {
    "source": "speculators 0.9.0 on an H200 (../shared/peer-bench/README.md), AdamW, sliding window 2048",
    "dflash_tflop_per_step": 84.2,
    "dflash_peak_gib": 36.8,
    "dflash_tokens_per_s": 45847,
    "eagle3_tflop_per_step": 49.9,  # 444 TFLOP/s x 112.4 ms, from the same table
    "eagle3_peak_gib": 17.0,
    "eagle3_tokens_per_s": 72848,
}
TARGETS = {"dflash_tflop_per_step": 84.0, "dflash_est_peak_gib": 30.0,
           "eagle3_tflop_per_step": 55.0, "eagle3_est_peak_gib": 16.0}  # fmt: skip


# --------------------------------------------------------------------------- inputs


def synthetic_verifier(shape: dict, device: torch.device, dtype: torch.dtype):
    """Random frozen heads with the verifier's shape (no checkpoint needed), drawn where they
    live (2 x 622M normals at the reference shape): ``spectrain.train.cost.synthetic_heads``."""
    from spectrain.models.verifier import VerifierInfo
    from spectrain.train.cost import synthetic_heads

    info = VerifierInfo(
        path="synthetic", name_or_path="Qwen/Qwen3-8B", architectures=("Qwen3ForCausalLM",), model_type="qwen3",
        hidden_size=shape["hidden"], vocab_size=shape["vocab"], num_hidden_layers=36,
        num_attention_heads=shape["heads"], num_key_value_heads=shape["kv"], head_dim=shape["head_dim"],
        intermediate_size=shape["inter"], rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=40960,
        tie_word_embeddings=False,
    )  # fmt: skip
    return synthetic_heads(info, device, dtype)


def synthetic_batch(shape: dict, n_aux: int, device, layout: str = "peer", docs: int = 1, seed: int = 1,
                    hidden: int | None = None):  # fmt: skip
    """One packed sequence of ``shape`` (``spectrain.train.cost.synthetic_batch``): ``peer`` documents
    have the loss on their last 65%, ``equal`` ones everywhere."""
    from spectrain.train.cost import synthetic_batch as batch

    return batch(shape["seq"], hidden or shape["hidden"], shape["vocab"], n_aux, device, layout, docs, seed)


def build(name: str, opts: dict, shape: dict, device, heads_dtype):
    from spectrain.models import build_draft, get_config_class

    heads = synthetic_verifier(shape, device, heads_dtype)
    with torch.device(device):  # parameters initialised on the device (1B of them for DFlash)
        model = build_draft(get_config_class(name)(aux_layer_ids=AUX_LAYERS, **opts), heads)
    if name == "eagle3":
        model.prepare(torch.arange(shape["vocab"], dtype=torch.float64))
    if next(model.parameters()).device.type != torch.device(device).type:
        model.to(device)  # (fake tensors cannot be swapped in place, so only when it moves)
    return model.train(), heads


def default_optimizer(algorithm: str) -> str:
    """The optimizer ``spectrain train`` uses by default for ``algorithm`` (``auto`` resolved)."""
    from spectrain.models import get_config_class
    from spectrain.train.loop import TrainConfig

    kind = next((f.default for f in dataclasses.fields(TrainConfig) if f.name == "optimizer"), "adamw")
    return get_config_class(algorithm).default_optimizer if kind == "auto" else kind


def make_optimizer(model, kind: str):
    """``spectrain train``'s optimizers (fused AdamW, or Muon + AdamW): ``Optimizers``."""
    from spectrain.train.optim import OptimConfig, build_optimizers

    return build_optimizers(model, OptimConfig(optimizer=kind, lr=1e-4), lambda s: 1.0, fused=True)


def train_step(model, opt, batch, amp_device: str | None, seed: int):
    """One step of ``spectrain train`` (``spectrain.train.step.train_step``): forward, backward,
    clipping, the non-finite check and the update, with no host-device sync; returns its result."""
    from spectrain.train.step import train_step as step

    device = batch.input_ids.device
    gen = torch.Generator(device=device).manual_seed(seed)

    def autocast():
        return torch.autocast(amp_device or "cpu", dtype=torch.bfloat16, enabled=amp_device is not None)

    return step(model, model, opt, [batch], [gen], autocast=autocast, max_grad_norm=1.0, device=device)


# --------------------------------------------------------------------------- timed


def sync_check(step) -> dict:
    """Run ``step`` under ``torch.cuda.set_sync_debug_mode("error")``: any host-device sync raises."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()
        out = {"sync_free": True}
    except RuntimeError as e:
        out = {"sync_free": False, "sync_error": str(e).strip().splitlines()[0][:300]}
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    return out


def bench_model(name, opts, shape, device, steps, warmup, layout, docs, optimizer, compile_model,
                sync_census=False, compile_backend="inductor") -> dict:  # fmt: skip
    gpu = device.type == "cuda"
    model, _ = build(name, opts, shape, device, torch.bfloat16 if gpu else torch.float32)
    if compile_model:
        model.compile_training(backend=compile_backend)
    opt = make_optimizer(model, optimizer)
    batch = synthetic_batch(shape, 3, device, layout, docs)
    amp = "cuda" if gpu else None
    times, flops, first = [], 0.0, None
    if gpu:
        torch.cuda.reset_peak_memory_stats(device)
    for i in range(warmup + steps):
        if gpu:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        result = train_step(model, opt, batch, amp, i)
        if gpu:
            torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        first = dt if first is None else first
        if i >= warmup:
            times.append(dt)
            flops = float(result.flops)
        log.info("%s/%s%s step %d: %.1f ms loss %.3f", name, optimizer, " compiled" if compile_model else "", i,
                 dt * 1e3, float(result.loss))  # fmt: skip
    step = float(np.median(times))
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if gpu else None
    out = {
        "step_s": step,
        "tokens_per_s": shape["seq"] / step,
        "flops": flops,
        "peak_gib": peak,
        "first_step_s": first,
    }
    if sync_census:
        from spectrain.train.sync_census import census

        run = functools.partial(train_step, model, opt, batch, amp, 0)
        out["syncs"] = census(run, device)
        log.info("%s: host-device syncs in one step: %s", name, json.dumps(out["syncs"], indent=1))
        out.update(sync_check(run) if gpu else {"sync_free": not out["syncs"]})
    del model, opt, batch
    gc.collect()
    if gpu:
        torch.cuda.empty_cache()
    return out


def bench_loader(hidden: int, samples: int, tokens: int, seq: int, workers: int) -> float:
    """Tokens/s of PackedLoader (DataLoader workers) over a fresh store of 3 aux + 1 target layers."""
    from hsgen.store import HiddenStateStore, StoreHeader
    from hsgen.store.synthetic import make_sample
    from spectrain.data.sources import PackedLoader, StoreSource

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


def emit(result: dict, path: Path | None) -> None:
    """The result so far: one JSON line on stdout (flushed) and, with ``--json-out``, the file
    replaced atomically, so a run cut by a time bound keeps every part it finished."""
    line = json.dumps(result)
    print(line, flush=True)
    if path is not None:
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(line + "\n")
        tmp.replace(path)


def run_timed(args) -> dict:
    if args.device == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    else:
        device = torch.device(args.device)
    gpu = device.type == "cuda"
    shape = GPU_SHAPE if gpu else (TINY_SHAPE if args.tiny else CPU_SHAPE)
    opts = GPU_OPTS if gpu else (TINY_OPTS if args.tiny else CPU_OPTS)
    steps = args.steps or (1 if args.quick else 3 if args.tiny else 10)  # quick: after one warm-up step
    warmup = 3 if gpu else 1
    peak = args.peak_tflops * 1e12
    result: dict = {"device": torch.cuda.get_device_name(device) if gpu else "cpu", "shape": shape,
                    "layout": args.layout, "optimizer": "adamw", "compile": args.compile}  # fmt: skip
    modes = {"off": [False], "on": [True], "both": [False, True]}[args.compile]
    result["parts_done"] = []
    for name in args.models:
        default = default_optimizer(name)
        optimizers = ["adamw"] if default == "adamw" or args.adamw_only else ["adamw", default]
        for compiled in modes:
            for kind in optimizers:
                census = args.sync_census and kind == "adamw" and compiled == modes[0]
                r = bench_model(name, opts[name], shape, device, steps, warmup, args.layout, args.docs, kind,
                                compiled, census, args.compile_backend)  # fmt: skip
                suffix = ("" if kind == "adamw" else f"_{kind}") + ("_compiled" if compiled else "")
                result[f"{name}_tokens_per_s{suffix}"] = round(r["tokens_per_s"], 1)
                result[f"{name}_step_ms{suffix}"] = round(r["step_s"] * 1e3, 2)
                result[f"{name}_peak_gib{suffix}"] = (
                    None if r["peak_gib"] is None else round(r["peak_gib"], 2)
                )
                result[f"{name}_first_step_s{suffix}"] = round(r["first_step_s"], 2)
                if "syncs" in r:
                    result[f"{name}_syncs"] = r["syncs"]
                    result[f"{name}_sync_free"] = r["sync_free"]
                    if "sync_error" in r:
                        result[f"{name}_sync_error"] = r["sync_error"]
                if kind == "adamw":
                    result[f"{name}_mfu{suffix}"] = round(r["flops"] / r["step_s"] / peak, 4) if gpu else None
                result["parts_done"].append(f"{name}_{kind}" + ("_compiled" if compiled else ""))
                emit(result, args.json_out)
        if args.compile == "both":
            eager, comp = result[f"{name}_tokens_per_s"], result[f"{name}_tokens_per_s_compiled"]
            result[f"{name}_compile_speedup"] = round(comp / eager, 3)
    if args.no_loader:
        result["loader_tokens_per_s"] = None
    else:
        samples, tokens = (8, 1024) if (args.quick or args.tiny) else (48, 1024)
        hidden = 256 if args.tiny else 4096
        result["loader_tokens_per_s"] = round(
            bench_loader(hidden, samples, tokens, 8192, args.loader_workers), 1
        )
        from bench_loader import bench_loader as bench_loader_limit  # scripts/bench_loader.py

        limit = bench_loader_limit(
            quick=args.quick or args.tiny, tokens=12_000 if args.quick or args.tiny else None
        )
        result["loader_gbps"] = limit["loader_gbps"]
        result["loader_ratio"] = limit["loader_ratio"]
    result["complete"] = True
    return result


# --------------------------------------------------------------------------- plan


@contextlib.contextmanager
def patched_loss(kind: str | None):
    """Route the models' ``vocab_loss`` through the eager reference or the chunked loss (None: as-is)."""
    from spectrain.models import common, dflash, eagle3
    from spectrain.models import vocab_loss as chunked

    modules = [m for m in (dflash, eagle3) if hasattr(m, "vocab_loss")]
    saved = [m.vocab_loss for m in modules]
    if kind is not None:
        fn = chunked.vocab_loss if kind == "chunked" else common.eager_vocab_loss
        for m in modules:
            m.vocab_loss = fn
    try:
        yield
    finally:
        for m, f in zip(modules, saved, strict=True):
            m.vocab_loss = f


def plan_variants(name: str) -> list[dict]:
    """The configurations the code offers for ``name``: ``as-is`` first, then the switches that exist."""
    from spectrain.models import dflash, eagle3, get_config_class

    module = dflash if name == "dflash" else eagle3
    losses = ["eager", "chunked"] if hasattr(module, "vocab_loss") else [None]
    fields = {f.name: f.default for f in dataclasses.fields(get_config_class(name))}
    heads = [False, True] if name == "eagle3" and "freeze_lm_head" in fields else [None]
    out = [{"label": "as-is", "loss": None, "freeze_lm_head": None}]
    for loss in losses:
        for frozen in heads:
            if loss is None and frozen is None:
                continue
            parts = ([f"loss={loss}"] if loss else []) + ([f"head={'frozen' if frozen else 'trainable'}"]
                                                           if frozen is not None else [])  # fmt: skip
            out.append({"label": ",".join(parts), "loss": loss, "freeze_lm_head": frozen})
    return out


def mask_density(name: str, opts: dict, shape: dict, layout: str) -> dict:
    """Allowed-pair fraction of every attention mask, from a tiny-width real copy of the draft
    on the same batch layout (the masks depend on positions, documents and anchors only)."""
    from spectrain.train.accounting import measure_mask_density

    narrow = dict(shape, hidden=64, heads=4, kv=2, head_dim=16, inter=64, vocab=min(shape["vocab"], 4096))
    small = dict(opts, attention_backend="flex")
    if "draft_vocab_size" in small:
        small["draft_vocab_size"] = min(small["draft_vocab_size"], narrow["vocab"])
    model, _ = build(name, small, narrow, torch.device("cpu"), torch.float32)
    batch = synthetic_batch(narrow, 3, "cpu", layout, 1)
    return measure_mask_density(lambda: model(batch, torch.Generator().manual_seed(0)))


@contextlib.contextmanager
def cuda_chunking():
    """The vocabulary loss chunked as on CUDA (the plan's fake tensors are CPU tensors)."""
    from spectrain.models import vocab_loss

    rows = vocab_loss.default_chunk_rows
    vocab_loss.default_chunk_rows = lambda vocab, budget_bytes=None, device_type="cpu": rows(
        vocab, budget_bytes, "cuda"
    )
    try:
        yield
    finally:
        vocab_loss.default_chunk_rows = rows


def plan_one(name: str, opts: dict, shape: dict, layout: str, variant: dict, density: dict) -> dict:
    """Plan one configuration of one draft (two steps under fake tensors, the loss chunked as on CUDA)."""
    from spectrain.train.accounting import account_steps, fake_tensors

    cfg = dict(opts, attention_backend="flex")
    if variant["freeze_lm_head"] is not None:
        cfg["freeze_lm_head"] = variant["freeze_lm_head"]
    with patched_loss(variant["loss"]), cuda_chunking(), fake_tensors():
        model, heads = build(name, cfg, shape, torch.device("cpu"), torch.bfloat16)
        opt = make_optimizer(model, "adamw")
        batch = synthetic_batch(shape, 3, "cpu", layout, 1)
        seeds = iter(range(100))
        acct = account_steps(
            lambda: train_step(model, opt, batch, "cpu", next(seeds)),
            [model, *opt.optimizers, batch.hidden_states, batch.input_ids, heads.lm_head, heads.embed_tokens],
            density,
        )
        out = acct.summary()
        out["muon_ns_tflop_by_ranks"] = muon_split_plan(model)
    out["params_trainable_m"] = round(sum(p.numel() for p in model.parameters() if p.requires_grad) / 1e6, 1)
    return out


MUON_RANKS = (1, 2, 8)


def muon_split_plan(model) -> dict[str, float]:
    """Newton-Schulz TFLOP of one step on the busiest rank when ``spectrain train``'s Muon splits
    the orthogonalisation over 1, 2 and 8 DDP ranks (the optimizer's own assignment and count)."""
    from spectrain.train.optim import MuonSplit, OptimConfig, build_optimizers

    cfg = OptimConfig(optimizer="muon", lr=1e-4)
    out = {}
    for world in MUON_RANKS:
        per_rank = [build_optimizers(model, cfg, lambda s: 1.0, fused=True, split=MuonSplit(r, world)).flops_per_step
                    for r in range(world)]  # fmt: skip
        out[str(world)] = round(max(per_rank) / 1e12, 2)
    return out


def run_plan(args) -> dict:
    shape = TINY_SHAPE if args.tiny else GPU_SHAPE
    opts = TINY_OPTS if args.tiny else GPU_OPTS
    result: dict = {"shape": shape, "layout": args.layout, "precision": "fp32 master, bf16 autocast (CPU rules)",
                    "optimizer": "adamw (fused)", "attention_flops": "pairs the mask allows (3x forward)"}  # fmt: skip
    for name in ("dflash", "eagle3"):
        t0 = time.perf_counter()
        density = mask_density(name, opts[name], shape, args.layout)
        variants = {}
        for v in plan_variants(name):
            variants[v["label"]] = plan_one(name, opts[name], shape, args.layout, v, density)
            log.info("%s %s: %s", name, v["label"], variants[v["label"]])
        best = min(variants, key=lambda k: (variants[k]["est_peak_gib"], variants[k]["tflop_per_step"]))
        result[f"{name}_tflop_per_step"] = variants[best]["tflop_per_step"]
        result[f"{name}_est_peak_gib"] = variants[best]["est_peak_gib"]
        result[f"{name}_variant"] = best
        result[f"{name}_variants"] = variants
        ns = variants[best]["muon_ns_tflop_by_ranks"]
        result[f"{name}_muon_split"] = {
            "ns_tflop_per_rank": ns,
            "rank_tflop_per_step": {w: round(variants[best]["tflop_per_step"] + t, 2) for w, t in ns.items()},
        }
        log.info("%s planned in %.1f s", name, time.perf_counter() - t0)
    result["peer"] = PEER
    result["targets"] = TARGETS
    result["within_targets"] = all(result[k] <= v for k, v in TARGETS.items()) if not args.tiny else None
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--plan", action="store_true", help="count FLOPs and memory at the reference shape (no GPU)"
    )
    ap.add_argument("--tiny", action="store_true", help="a tiny shape (tests; seconds on CPU)")
    ap.add_argument(
        "--quick",
        action="store_true",
        help="1 timed step per part, small loader stores (~30 s on 2 CPU cores)",
    )
    ap.add_argument("--device", default="auto", help="auto | cuda | cpu")
    ap.add_argument("--steps", type=int, default=None, help="timed steps per model")
    ap.add_argument(
        "--layout", choices=["peer", "equal"], default="peer", help="documents in the packed sequence"
    )
    ap.add_argument("--docs", type=int, default=1, help="documents per packed sequence (--layout equal)")
    ap.add_argument("--compile", choices=["off", "on", "both"], default="off",
                    help="torch.compile the draft's training forward (as train --compile); both: eager and "
                         "compiled side by side (keys *_compiled, *_compile_speedup)")  # fmt: skip
    ap.add_argument(
        "--compile-backend",
        default="inductor",
        help="torch.compile backend (inductor; aot_eager for a quick CPU smoke)",
    )
    ap.add_argument(
        "--adamw-only", action="store_true", help="skip the default optimizer when it is not AdamW"
    )
    ap.add_argument(
        "--sync-census",
        action="store_true",
        help="after timing, list the host-device syncs of one step (CUDA: sync debug mode 'warn') and, on "
        "CUDA, run one under set_sync_debug_mode('error') (*_sync_free)",
    )
    ap.add_argument("--no-loader", action="store_true", help="skip the loader measurement")
    ap.add_argument("--peak-tflops", type=float, default=800.0, help="bf16 matmul peak for MFU (H200: ~800)")
    ap.add_argument(
        "--loader-workers", type=int, default=0, help="0 = prefetch thread (the default of train)"
    )
    ap.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    ap.add_argument("--models", type=lambda s: s.split(","), default=["dflash", "eagle3"],
                    help="timed drafts, comma-separated (dflash,dspark,eagle3); one process per draft keeps a crash or "
                         "a time bound in one from costing the other")  # fmt: skip
    ap.add_argument(
        "--json-out",
        type=Path,
        default=None,
        help="timed: also write the result so far to this file after each part (atomically)",
    )
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.plan:
        print(json.dumps(run_plan(args)))
        return
    unknown = sorted(set(args.models) - set(MODELS))
    if unknown:
        ap.error(f"--models: unknown draft {unknown[0]!r} ({', '.join(MODELS)})")
    emit(run_timed(args), args.json_out)


if __name__ == "__main__":
    main()
