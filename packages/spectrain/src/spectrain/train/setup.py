"""What a run is built from: its data sources, the checks that they fit the verifier, the
stored layers the draft reads, the draft vocabulary's token counts and the LR schedule's length."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from spectrain.data.sources import LENGTH_SAMPLE, SampleSource, StoreSource, estimate_packed_sequences
from spectrain.data.sources import token_frequencies as count_tokens
from spectrain.models.registry import DraftConfig, DraftModel, build_draft, get_config_class
from spectrain.train.config import TrainConfig
from spectrain.train.distributed import DistInfo, all_min, gather

if TYPE_CHECKING:
    from spectrain.models.verifier import VerifierHeads

log = logging.getLogger(__name__)


def resolve_layers(draft_cfg: DraftConfig, store_layer_ids: Sequence[int], verifier_layers: int, *,
                   origin: str = "the store's layers", targets: str = "states", where: str = "the store") -> list[int]:  # fmt: skip
    """Fill ``aux_layer_ids``/``target_layer_id``; return indices into the stored layers (aux..., target).
    ``origin`` names where the layer ids came from in errors (online: the ``--layer-ids`` flag).

    A store of target ids (``targets = "argmax"``) stores no final layer: every stored layer may
    be auxiliary, the target layer is the verifier's last (where its argmax came from), and the
    indices name the auxiliary layers only. Soft targets need the verifier's distribution, which
    such a store lacks: refused (``ValueError``, one line).
    """
    ids = [int(i) for i in store_layer_ids]
    if targets == "argmax":
        return _resolve_aux_only(draft_cfg, ids, verifier_layers, where)
    beyond = [i for i in ids if i > verifier_layers]
    if beyond:
        raise ValueError(
            f"{origin} {ids} include {beyond}, beyond the verifier's {verifier_layers} layers "
            f"(ids run from 0, the embeddings, to {verifier_layers}, the last layer)"
            + (": another verifier made it" if origin.startswith("the store") else "")
        )
    target = draft_cfg.target_layer_id if draft_cfg.target_layer_id is not None else ids[-1]
    if target not in ids:
        raise ValueError(f"--target-layer-id {target} is not in {origin} {ids}")
    if target != verifier_layers:
        log.warning(
            "target layer %d is not the verifier's last layer %d: targets lm_head(norm(h)) assume the last",
            target,
            verifier_layers,
        )
    aux = list(draft_cfg.aux_layer_ids) if draft_cfg.aux_layer_ids else [i for i in ids if i != target]
    missing = [i for i in aux if i not in ids]
    if missing:
        raise ValueError(f"--target-layer-ids {missing} are not in {origin} {ids}")
    if not aux:
        raise ValueError(f"{origin} {ids} leave no auxiliary layer besides the target {target}")
    if draft_cfg.algorithm == "eagle3" and len(aux) != 3:
        raise ValueError(
            f"eagle3 needs 3 auxiliary layers; pick 3 of the store's {ids} with --target-layer-ids"
        )
    if aux != sorted(aux):
        log.warning("aux layer ids %s sorted to %s: vLLM concatenates auxiliary states in ascending order",
                    aux, sorted(aux))  # fmt: skip
        aux = sorted(aux)
    if len(set(aux)) != len(aux):
        raise ValueError(f"aux layer ids {aux} repeat a layer")
    draft_cfg.aux_layer_ids = tuple(aux)
    draft_cfg.target_layer_id = target
    return [ids.index(i) for i in aux] + [ids.index(target)]


def _resolve_aux_only(draft_cfg: DraftConfig, ids: list[int], verifier_layers: int, where: str) -> list[int]:
    """:func:`resolve_layers` for a store of target ids."""
    mode = getattr(draft_cfg, "target_mode", "hard")
    if mode != "hard":
        raise ValueError(
            f"--target-mode {mode} needs the verifier's distribution, but {where} keeps only its argmax "
            "(targets argmax): train with --target-mode hard, or on a store of final-layer states"
        )
    if draft_cfg.target_layer_id not in (None, verifier_layers):
        raise ValueError(
            f"target layer {draft_cfg.target_layer_id}: {where} keeps the argmax of the verifier's last "
            f"layer {verifier_layers} only"
        )
    aux = sorted(draft_cfg.aux_layer_ids) if draft_cfg.aux_layer_ids else ids
    missing = [i for i in aux if i not in ids]
    if missing:
        raise ValueError(f"--target-layer-ids {missing} are not in the store's layers {ids}")
    if draft_cfg.algorithm == "eagle3" and len(aux) != 3:
        raise ValueError(
            f"eagle3 needs 3 auxiliary layers; pick 3 of the store's {ids} with --target-layer-ids"
        )
    draft_cfg.aux_layer_ids = tuple(aux)
    draft_cfg.target_layer_id = verifier_layers
    return [ids.index(i) for i in aux]


def check_tokenizer(
    store_fingerprint: str, verifier: str, chat_template: str | None, store: str | None
) -> None:
    """Raise ``ValueError`` when the store was rendered with another tokenizer or chat template.

    The store's header records the fingerprint of the tokenizer and chat template its prompts
    were rendered with (``""`` when unknown, e.g. pre-tokenized input); it must equal the
    verifier's (with ``chat_template`` overriding the verifier's own template, as at generation).
    """
    if not store_fingerprint or not (Path(verifier) / "tokenizer.json").is_file():
        return
    from hsgen.inputs.render import ChatRenderer, RenderConfig

    mine = ChatRenderer(RenderConfig(tokenizer_path=verifier, chat_template=chat_template)).fingerprint
    if mine != store_fingerprint:
        hint = (
            "" if chat_template else " (if generate used --chat-template FILE, pass the same --chat-template)"
        )
        raise ValueError(
            f"{store}: rendered with another tokenizer or chat template than the verifier {verifier} "
            f"(fingerprint {store_fingerprint[:12]}..., verifier's {mine[:12]}...){hint}"
        )


def build_source(cfg: TrainConfig, info: DistInfo, split: str = "train") -> SampleSource:
    """StoreSource offline; ``spectrain.online.OnlineSource`` (imported here only) online."""
    if cfg.online:
        from spectrain.online import OnlineSource

        return OnlineSource(cfg, rank=info.rank, world_size=info.world_size)
    return StoreSource(cfg.store, split=split, val_fraction=cfg.val_fraction, seed=cfg.seed, rank=info.rank,
                       world_size=info.world_size, verify=cfg.verify_samples)  # fmt: skip


def validation_source(cfg: TrainConfig, source: SampleSource, info: DistInfo) -> SampleSource | None:
    """The validation split beside ``source`` (its own ``validation_source()``, or the store's), or None."""
    if cfg.val_fraction <= 0:
        return None
    getter = getattr(source, "validation_source", None)
    if getter is not None:
        return getter()
    if isinstance(source, StoreSource):
        return StoreSource(source.path, split="validation", val_fraction=cfg.val_fraction, seed=cfg.seed,
                           rank=info.rank, world_size=info.world_size, verify=cfg.verify_samples)  # fmt: skip
    return None


def check_there_is_data(cfg: TrainConfig, source: SampleSource, val_source: SampleSource | None,
                        info: DistInfo) -> None:  # fmt: skip
    """Training on nothing is an error; an empty validation split is worth a warning (a collective)."""
    where = f"--prompts {cfg.prompts}" if cfg.online else f"store {cfg.store}"
    if sum(gather(len(source.plan(0)), info)) == 0:
        raise ValueError(
            f"nothing to train on: {where} holds no sample of the training split "
            f"(empty, or every sample falls in the --val-fraction {cfg.val_fraction} validation split)"
        )
    empty_val = val_source is not None and sum(gather(len(val_source.plan(0)), info)) == 0
    if empty_val and info.is_main:  # the gather above is a collective: every rank runs it
        log.warning("%s: the validation split (--val-fraction %g) is empty: no validation", where,
                    cfg.val_fraction)  # fmt: skip


def token_counts(source: SampleSource, vocab: int, scan_samples: int, info: DistInfo,
                 device: torch.device) -> torch.Tensor:  # fmt: skip
    """Token frequencies of up to ``scan_samples`` training samples (counted on rank 0, broadcast)."""
    counts = torch.zeros(vocab, dtype=torch.float64)
    if info.is_main:
        ids_fn = getattr(source, "ids", None)
        ids = ids_fn() if ids_fn is not None else source.plan(0)
        ids = sorted(ids)[:scan_samples] if scan_samples else sorted(ids)
        log.info("counting tokens of %d training samples for the draft vocabulary", len(ids))
        counts = torch.from_numpy(count_tokens(source, ids, vocab)).double()
    if info.enabled:
        dev = device if device.type == "cuda" else torch.device("cpu")
        counts = counts.to(dev)
        dist.broadcast(counts, 0)
        counts = counts.cpu()
    return counts


def estimate_total_steps(cfg: TrainConfig, source: SampleSource, info: DistInfo) -> int:
    """Optimizer steps of the whole run: the packed sequences of every epoch's plan over
    ``grad_accum`` (the fewest of any rank), or ``max_steps`` when that comes first; the LR
    schedule's length, so a ``max_steps`` beyond the data still decays to its end."""
    data = _data_steps(cfg, source, info)
    if cfg.max_steps:
        if cfg.max_steps > data:
            log.warning("--max-steps %d is beyond the data (%d steps in %d epoch(s)): the run and its LR schedule "
                        "end at step %d; raise --epochs for more", cfg.max_steps, data, cfg.epochs, data)  # fmt: skip
        return min(cfg.max_steps, data)
    return data


def _data_steps(cfg: TrainConfig, source: SampleSource, info: DistInfo) -> int:
    return max(1, sum(epoch_steps(cfg, source, info, e) for e in range(cfg.epochs)))


def epoch_steps(cfg: TrainConfig, source: SampleSource, info: DistInfo, epoch: int = 0) -> int:
    """Optimizer steps of one epoch's plan: its packed sequences over ``grad_accum`` (the fewest
    of any rank; a collective), at least 1."""
    lengths = getattr(source, "lengths", None)
    plan = source.plan(epoch)
    if lengths is not None:
        exact = getattr(source, "lengths_exact", True)
        seqs = estimate_packed_sequences(plan, lengths, cfg.total_seq_len, exact=exact)
        if not exact and len(plan) > LENGTH_SAMPLE and epoch == 0:
            log.info("LR schedule: packed sequences per epoch estimated from %d of %d prompts' rendered "
                     "lengths", LENGTH_SAMPLE, len(plan))  # fmt: skip
    else:
        if epoch == 0:
            log.warning("source gives no sample lengths; LR schedule assumes one sample per sequence")
        seqs = len(plan)
    return all_min(seqs, info) // cfg.grad_accum or 1


def save_interval(cfg: TrainConfig, steps_per_epoch: int) -> int:
    """``save_every``, or ``save_every_epochs`` as steps: ``round(F x steps per epoch)``, at least 1."""
    if cfg.save_every_epochs is None:
        return cfg.save_every
    return max(1, round(cfg.save_every_epochs * steps_per_epoch))


def check_header(cfg: TrainConfig, header: Any, verifier: VerifierHeads) -> None:
    """Refuse a source whose hidden size or (offline) tokenizer is not the verifier's."""
    if int(header.hidden_size) != verifier.hidden_size:
        raise ValueError(
            f"store hidden_size {header.hidden_size} differs from verifier {cfg.verifier} "
            f"hidden_size {verifier.hidden_size}"
        )
    if not cfg.online:  # the online source checks its store against the prompts' renderer
        check_tokenizer(
            getattr(header, "tokenizer_fingerprint", ""), cfg.verifier, cfg.chat_template, cfg.store
        )


def build_model(cfg: TrainConfig, verifier: VerifierHeads, source: SampleSource, state: dict[str, Any] | None,
                info: DistInfo, device: torch.device) -> tuple[DraftModel, list[int]]:  # fmt: skip
    """The draft (on the host) and the indices of the stored layers it reads (aux..., target).

    Resuming (``state``): the checkpoint's draft config and weights. Otherwise the exported draft of
    ``--from-pretrained``, or a new draft of ``cfg.draft``'s options whose vocabulary, when it needs
    one, comes from the training samples' token counts.
    """
    draft_opts = dict(cfg.draft) if state is None else state["draft_config"]
    layers = verifier.info.num_hidden_layers
    origin = "the servers' layers (--layer-ids)" if cfg.online else f"the store's layers ({cfg.store})"
    targets = getattr(source.header, "targets", "states")
    where = f"the store {cfg.store}" if cfg.store else "the run's store"
    if cfg.from_pretrained and state is None:
        model = pretrained_draft(cfg, cfg.from_pretrained, verifier, draft_opts)
        layer_index = resolve_layers(model.cfg, source.header.layer_ids, layers, origin=origin, targets=targets,
                                     where=where)  # fmt: skip
    else:
        draft_cfg = get_config_class(cfg.speculator_type).from_dict(draft_opts, where="draft options")
        layer_index = resolve_layers(draft_cfg, source.header.layer_ids, layers, origin=origin, targets=targets,
                                     where=where)  # fmt: skip
        model = build_draft(draft_cfg, verifier)
    if state is not None:
        model.load_state_dict(state["model"])
    elif model.needs_token_counts and not cfg.from_pretrained:
        model.prepare(token_counts(source, verifier.vocab_size, cfg.vocab_scan_samples, info, device))
    return model, layer_index


def pretrained_draft(
    cfg: TrainConfig, draft_dir: str, verifier: VerifierHeads, options: dict[str, Any]
) -> DraftModel:
    """The exported draft at ``draft_dir`` (its weights, vocabulary map and architecture) with
    the run's training options set on its config."""
    from spectrain.export.read import build_exported_draft, read_draft_algorithm

    algorithm = read_draft_algorithm(draft_dir)
    if algorithm != cfg.speculator_type:
        raise ValueError(f"--from-pretrained {draft_dir}: a {algorithm} draft, but speculator_type is "
                         f"{cfg.speculator_type}")  # fmt: skip
    model, _ = build_exported_draft(draft_dir, verifier, overrides=options)
    log.info("starting from %s (%s)", draft_dir, algorithm)
    return model
