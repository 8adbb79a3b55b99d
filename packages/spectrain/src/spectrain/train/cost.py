"""What a training run will cost, before it runs: ``spectrain train --dry-run`` and the memory
check that refuses a run its device cannot hold.

:func:`data_plan` counts samples, tokens and steps from the store's manifest (no sample read);
:func:`step_plan` builds the run's own draft at the verifier's shape under fake tensors and
counts one step's FLOPs and peak memory with :mod:`spectrain.train.accounting` (two steps, so the
optimizer state is in the peak). The synthetic verifier heads and packed batch are shared with
``scripts/bench_train.py``.
"""

from __future__ import annotations

import logging
import random
from typing import Any

import numpy as np
import torch

from spectrain.train.accounting import GIB

log = logging.getLogger(__name__)


def synthetic_heads(info, device: torch.device | str, dtype: torch.dtype, *, random_values: bool = True):
    """Frozen verifier heads of ``info``'s shape (random, or empty under fake tensors)."""
    from spectrain.models.verifier import VerifierHeads

    device = torch.device(device)
    V, H = info.vocab_size, info.hidden_size
    if random_values:
        g = torch.Generator(device=device).manual_seed(0)
        emb = (torch.randn(V, H, generator=g, device=device) * 0.02).to(dtype)
        head = (torch.randn(V, H, generator=g, device=device) * 0.02).to(dtype)
    else:
        emb = torch.empty(V, H, dtype=dtype, device=device)
        head = torch.empty(V, H, dtype=dtype, device=device)
    return VerifierHeads(info, emb, torch.ones(H, dtype=dtype, device=device), head)


def doc_lengths(seq: int, layout: str, docs: int, seed: int = 0) -> list[int]:
    """Document lengths filling ``seq`` slots: ``peer`` (random in [seq/16, seq/3)) or ``equal``."""
    if layout == "equal":
        base = seq // docs
        return [base] * (docs - 1) + [seq - base * (docs - 1)]
    rng = random.Random(seed)
    lo = max(16, seq // 16)
    hi = max(lo + 1, seq // 3)
    out: list[int] = []
    while sum(out) < seq:
        out.append(rng.randrange(lo, hi))
    out[-1] -= sum(out) - seq
    if out[-1] < 2 and len(out) > 1:
        out[-2] += out.pop()
    return out


def synthetic_batch(seq: int, hidden: int, vocab: int, n_aux: int, device, layout: str = "peer", docs: int = 1,
                    seed: int = 1):  # fmt: skip
    """One packed sequence: ``peer`` documents have the loss on their last 65%, ``equal`` ones everywhere."""
    from spectrain.data.batch import Batch

    lengths = doc_lengths(seq, layout, docs, seed)
    pos = torch.cat([torch.arange(n) for n in lengths])
    doc = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)])
    starts = torch.tensor([0, *np.cumsum(lengths)[:-1].tolist()])
    ends = (starts + torch.tensor(lengths))[doc]
    loss = (
        torch.ones(seq, dtype=torch.bool)
        if layout == "equal"
        else pos >= (0.35 * (ends - starts[doc])).long()
    )
    g = torch.Generator().manual_seed(seed)
    hs = torch.randn(seq, n_aux + 1, hidden, generator=g).to(torch.bfloat16)
    ids = torch.randint(0, vocab, (seq,), generator=g)
    return Batch(ids, loss, pos, doc, ends, hs, num_tokens=seq).to(device)


def data_plan(cfg, source=None) -> dict[str, Any]:
    """Samples, tokens and optimizer steps of an offline run (from the manifest; nothing read)."""
    from spectrain.data.sources import StoreSource, count_packed_sequences

    if cfg.online:
        steps = cfg.max_steps
        return {"source": "online", "prompts": cfg.prompts, "steps": steps,
                "note": "samples and tokens are known once the prompts are rendered"
                + ("" if steps else "; the schedule is sized then")}  # fmt: skip
    src = source or StoreSource(cfg.store, split="train", val_fraction=cfg.val_fraction, seed=cfg.seed,
                                verify=False)  # fmt: skip
    per_epoch, samples, tokens = [], 0, 0
    for epoch in range(cfg.epochs):
        plan = src.plan(epoch)
        lengths = src.lengths(plan)
        if epoch == 0:
            samples, tokens = len(plan), int(sum(min(n, cfg.total_seq_len) for n in lengths))
        per_epoch.append(max(1, count_packed_sequences(lengths, cfg.total_seq_len) // cfg.grad_accum))
    data_steps = sum(per_epoch) if samples else 0
    steps = min(cfg.max_steps, data_steps) if cfg.max_steps else data_steps
    out = {"source": "store", "store": str(cfg.store), "samples_per_epoch": samples, "tokens_per_epoch": tokens,
           "epochs": cfg.epochs, "steps_per_epoch": per_epoch[0] if per_epoch else 0, "steps": steps,
           "tokens": tokens * cfg.epochs}  # fmt: skip
    if cfg.max_steps and cfg.max_steps > data_steps:
        out["note"] = (
            f"--max-steps {cfg.max_steps} is beyond the data ({data_steps} steps); the run stops there"
        )
    return out


def resolve_draft(cfg, info, store_layer_ids):
    """The run's draft config and the stored layers feeding it (as the trainer resolves them)."""
    from spectrain.models import get_config_class
    from spectrain.train.setup import resolve_layers

    draft_cfg = get_config_class(cfg.speculator_type).from_dict(dict(cfg.draft), where="draft options")
    return draft_cfg, resolve_layers(draft_cfg, store_layer_ids, info.num_hidden_layers)


def _build(draft_cfg, info, device, heads_dtype, fake: bool):
    from spectrain.models import build_draft

    heads = synthetic_heads(info, device, heads_dtype, random_values=not fake)
    with torch.device(device):
        model = build_draft(draft_cfg, heads)
    if model.needs_token_counts:
        model.prepare(torch.arange(info.vocab_size, 0, -1, dtype=torch.float64))
    return model.train(), heads


def _narrow(info):
    """A tiny-width copy of ``info`` (masks depend on positions, documents and anchors only)."""
    import dataclasses

    return dataclasses.replace(info, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                               intermediate_size=64, vocab_size=min(info.vocab_size, 4096))  # fmt: skip


def step_plan(cfg, info, store_layer_ids, *, bf16: bool) -> dict[str, Any]:
    """FLOPs and peak memory of one optimizer step of this run (fake tensors; seconds on a CPU)."""
    import dataclasses

    from spectrain.train.accounting import account_steps, fake_tensors, measure_mask_density
    from spectrain.train.optim import build_optimizers
    from spectrain.train.step import train_step

    draft_cfg, layer_index = resolve_draft(cfg, info, store_layer_ids)
    n_aux = len(layer_index) - 1 if isinstance(layer_index, list | tuple) else 3
    seq = cfg.total_seq_len
    opts = {f.name for f in dataclasses.fields(draft_cfg)}
    small = dataclasses.replace(
        draft_cfg, **({"attention_backend": "flex"} if "attention_backend" in opts else {})
    )
    narrow = _narrow(info)
    if getattr(small, "draft_vocab_size", None):
        small = dataclasses.replace(small, draft_vocab_size=min(small.draft_vocab_size, narrow.vocab_size))
    tiny, _ = _build(small, narrow, "cpu", torch.float32, fake=False)
    batch = synthetic_batch(seq, narrow.hidden_size, narrow.vocab_size, n_aux, "cpu")
    density = measure_mask_density(lambda: tiny(batch, torch.Generator().manual_seed(0)))
    full_cfg = dataclasses.replace(draft_cfg, **({"attention_backend": "flex"} if "attention_backend" in opts
                                                  else {}))  # fmt: skip
    with fake_tensors():
        model, heads = _build(full_cfg, info, "cpu", torch.bfloat16 if bf16 else torch.float32, fake=True)
        opt = build_optimizers(
            model, cfg.optim_config(draft_cfg.default_optimizer), lambda s: 1.0, fused=True
        )
        micro = [synthetic_batch(seq, info.hidden_size, info.vocab_size, n_aux, "cpu", seed=1 + k)
                 for k in range(cfg.grad_accum)]  # fmt: skip
        seeds = iter(range(100))

        def step():
            gens = [torch.Generator().manual_seed(next(seeds)) for _ in micro]
            return train_step(
                model,
                model,
                opt,
                micro,
                gens,
                autocast=lambda: torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16),
                max_grad_norm=cfg.max_grad_norm,
                device="cpu",
            )

        acct = account_steps(
            step,
            [
                model,
                *opt.optimizers,
                *(b.hidden_states for b in micro),
                *(b.input_ids for b in micro),
                heads.lm_head,
                heads.embed_tokens,
            ],
            density,
        )
    out = acct.summary()
    out["gflop_per_step"] = round(acct.flops / 1e9, 3)
    out["est_peak_mib"] = round(acct.peak_bytes / 2**20, 1)
    out["params_trainable_m"] = round(sum(p.numel() for p in model.parameters() if p.requires_grad) / 1e6, 2)
    return out


def plan(cfg) -> dict[str, Any]:
    """The resolved plan of ``cfg``: data, steps, FLOPs and peak memory (``--dry-run`` prints it)."""
    from spectrain.models.verifier import read_verifier_info

    info = read_verifier_info(cfg.verifier)
    out: dict[str, Any] = {"speculator_type": cfg.speculator_type, "verifier": cfg.verifier,
                           "save_path": cfg.save_path}  # fmt: skip
    cache = None
    if cfg.hidden_states_path and not cfg.online:  # a speculators cache: planned as it is, nothing imported
        from spectrain.data.speculators_cache import view

        cache = view(cfg)
    out["data"] = data_plan(cfg, cache)
    if cache is not None:
        out["data"]["store"] = cache.summary["store"]
        out["data"]["speculators_cache"] = cache.summary
    out["checkpoints"] = checkpoint_plan(cfg, out["data"])
    layer_ids = cache.layer_ids if cache is not None else _store_layer_ids(cfg, info)
    device = _device_type(cfg)
    bf16 = cfg.precision == "bf16" or (cfg.precision == "auto" and device == "cuda")
    out["step"] = step_plan(cfg, info, layer_ids, bf16=bf16)
    out["step"]["precision"] = "bf16 autocast" if bf16 else "fp32"
    steps = out["data"].get("steps")
    if steps:
        out["total_pflop"] = round(out["step"]["flops"] * steps / 1e15, 3)
    out["device"] = device
    return out


def checkpoint_plan(cfg, data: dict[str, Any]) -> dict[str, Any]:
    """How often the run checkpoints: ``save_every`` steps, or ``save_every_epochs`` as steps."""
    from spectrain.train.setup import save_interval

    out: dict[str, Any] = {
        "save_every": cfg.save_every,
        "save_final": cfg.save_final,
        "save_best": cfg.save_best,
    }
    if cfg.save_every_epochs is not None:
        per_epoch = data.get("steps_per_epoch")
        if per_epoch:
            out["save_every"] = save_interval(cfg, per_epoch)
            out["note"] = (f"--checkpoint-freq {cfg.save_every_epochs:g} epochs = a checkpoint every "
                           f"{out['save_every']} steps ({per_epoch} steps per epoch)")  # fmt: skip
        else:
            out["save_every"] = None
            out["note"] = (f"--checkpoint-freq {cfg.save_every_epochs:g} epochs: the step interval is known once "
                           "the prompts are rendered (the run logs it)")  # fmt: skip
    return out


def _store_layer_ids(cfg, info) -> list[int]:
    if cfg.store and not cfg.online:
        from hsgen.store import HiddenStateStore

        return list(HiddenStateStore.open(cfg.store).header.layer_ids)
    layer_ids = (cfg.online_options or {}).get("layer_ids")
    if layer_ids:
        return list(layer_ids)
    aux = cfg.draft.get("aux_layer_ids")
    if aux:
        return [*aux, info.num_hidden_layers]
    n = info.num_hidden_layers
    return sorted({2, n // 2, max(0, n - 3)}) + [n]


def _device_type(cfg) -> str:
    if cfg.device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return cfg.device


def check_memory(cfg, device: torch.device) -> dict[str, Any] | None:
    """Refuse (``ValueError``, one line) a CUDA run whose estimated step peak exceeds the device's
    memory; returns the estimate (None off CUDA)."""
    if device.type != "cuda":
        return None
    from spectrain.models.verifier import read_verifier_info

    info = read_verifier_info(cfg.verifier)
    est = step_plan(cfg, info, _store_layer_ids(cfg, info), bf16=cfg.precision != "fp32")
    free, total = torch.cuda.mem_get_info(device)
    need = int(est["peak_bytes"] * 1.1)  # allocator fragmentation and the CUDA context
    if need > free:
        raise ValueError(
            f"estimated peak {need / GIB:.1f} GiB per step (draft, optimizer, activations; --dry-run shows "
            f"the breakdown) exceeds the {free / GIB:.1f} GiB free of {total / GIB:.1f} GiB on {device}: lower "
            "--total-seq-len or --max-anchors, or use --distributed fsdp"
        )
    return est
