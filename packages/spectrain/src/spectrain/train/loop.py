"""The training loop: any :class:`~spectrain.data.sources.SampleSource`, one packed sequence per micro-step.

``train(cfg)`` runs on one process or under ``torchrun`` (DDP, or FSDP2 with
``distributed="fsdp"``). Every ``save_every`` steps and at the end it writes
``<save_path>/checkpoint-<step>/``: ``config.json`` + ``model.safetensors`` (servable by vLLM
as is) and ``trainer/`` (full fp32 weights, optimizer, scheduler, RNG, loop state, the data
cursor and the epoch plans). ``resume="auto"`` continues from ``<save_path>/latest``; the
cursor ``(epoch, position in plan)`` makes sure nothing is trained twice.

Sources: ``spectrain.data.sources.StoreSource`` offline; with ``online=True`` the loop builds
``spectrain.online.OnlineSource(cfg, rank=, world_size=)``, which must offer ``header``
(``layer_ids``, ``hidden_size``) besides the ``SampleSource`` methods, and may offer
``validation_source()`` and ``ids()``.

The jobs around the loop have their own modules: :mod:`spectrain.train.config` (settings),
:mod:`spectrain.train.setup` (sources, checks, the draft), :mod:`spectrain.train.distributed`,
:mod:`spectrain.train.metrics`, :mod:`spectrain.train.checkpoint` and :mod:`spectrain.train.signals`; the names
users import from here still are.
"""

from __future__ import annotations

import contextlib
import logging
import random
import signal
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

from spectrain.data.loader import BufferPool
from spectrain.data.sources import TORCH_DTYPES, PackedLoader, SampleSource
from spectrain.export.write import export_draft, vllm_refusal
from spectrain.models.verifier import VerifierHeads
from spectrain.train.checkpoint import (
    BEST,
    LATEST,
    STATE_DIR,
    CheckpointWriteError,
    check_resume,
    find_resume,
    full_states,
    load_checkpoint_model,
    load_trainer_state,
    prune_checkpoints,
    restore_optimizer,
    rng_state,
    set_rng_state,
    write_checkpoint,
    write_pointer,
)
from spectrain.train.config import REDACTED, SECRET_FIELDS, TrainConfig, load_config_file, redact_secrets
from spectrain.train.distributed import (
    DistInfo,
    all_min,
    all_min_each,
    gather,
    init_distributed,
    resolve_device,
    teardown_distributed,
    wrap_model,
)
from spectrain.train.metrics import LogWindow, MetricsLog, MetricSums, train_record
from spectrain.train.optim import MuonSplit, Optimizers, build_optimizers, lr_lambda
from spectrain.train.setup import (
    build_model,
    build_source,
    check_header,
    check_there_is_data,
    check_tokenizer,
    epoch_steps,
    estimate_total_steps,
    resolve_layers,
    save_interval,
    validation_source,
)
from spectrain.train.signals import StopSignals
from spectrain.train.step import NonFiniteTraining, StepChecks, StepResult, step_generator, train_step

__all__ = [  # the names users, scripts and tests import from here (their homes are the modules above)
    "LATEST", "REDACTED", "SECRET_FIELDS", "STATE_DIR", "DistInfo", "MetricSums", "MetricsLog", "StopSignals",
    "TrainConfig", "Trainer", "build_source", "check_tokenizer", "find_resume", "init_distributed",
    "load_checkpoint_model", "load_config_file", "redact_secrets", "resolve_device", "resolve_layers",
    "step_generator", "train",
]  # fmt: skip

log = logging.getLogger(__name__)


class Trainer:
    """One training run (see module docstring). ``run()`` returns a summary dict."""

    def __init__(self, cfg: TrainConfig, source: SampleSource | None = None,
                 val_source: SampleSource | None = None):  # fmt: skip
        cfg.validate()
        self.cfg = cfg
        self._closed = False
        self.cache_summary: dict[str, Any] | None = None
        if cfg.hidden_states_path:  # a speculators cache: imported into (or reused as) cfg.store first
            from spectrain.data.speculators_cache import prepare

            self.cache_summary = prepare(cfg)
        self.device = resolve_device(cfg)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.info = init_distributed(self.device)
        self.source = self.val_source = None
        try:  # a run that fails to start releases its sources (fetch threads, scratch store) and groups
            self.save_path = Path(cfg.save_path)
            if self.info.is_main:
                self.save_path.mkdir(parents=True, exist_ok=True)
            self.amp = cfg.precision == "bf16" or (cfg.precision == "auto" and self.device.type == "cuda")
            random.seed(cfg.seed)
            np.random.seed(cfg.seed)
            torch.manual_seed(cfg.seed)
            self.source = source if source is not None else build_source(cfg, self.info)
            self.val_source = (
                val_source if val_source is not None else validation_source(cfg, self.source, self.info)
            )
            check_there_is_data(cfg, self.source, self.val_source, self.info)

            self.resume_dir = find_resume(cfg)
            self.state: dict[str, Any] | None = None
            if self.resume_dir is not None:
                self.state = load_trainer_state(self.resume_dir, self.info.world_size)

            vdtype = torch.bfloat16 if self.amp else torch.float32
            self.verifier = VerifierHeads.load(cfg.verifier, dtype=vdtype).to(self.device)
            if self.state is not None:
                check_resume(self.resume_dir, cfg, self.state["draft_config"], self.verifier.vocab_size)
            resume_at = getattr(self.source, "resume_at", None)
            if self.state is not None and resume_at is not None:  # an online source's header probe
                loop, plans = self.state["loop"], self.state.get("plans")
                resume_at(loop["epoch"], loop["positions"][self.info.rank], plans and plans[self.info.rank])
            header = self.source.header
            check_header(cfg, header, self.verifier)
            self.hidden_dtype = TORCH_DTYPES.get(getattr(header, "dtype", "bfloat16"), torch.bfloat16)
            # built where it trains: a 1B-parameter draft's initialisation takes seconds on a GPU, minutes
            # on the host (the models make their host-side tensors on the host, whatever the default)
            with torch.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext():
                self.model, self.layer_index = build_model(
                    cfg, self.verifier, self.source, self.state, self.info, self.device
                )
            self.draft_cfg = self.model.cfg
            self.model.to(self.device)
            self.module = self.model
            self.wrapped = wrap_model(self.model, self.info, self.device, cfg.distributed, cfg.compile)
            self.steps_per_epoch: int | None = None
            if self.state is not None:
                self.total_steps = self.state["loop"]["total_steps"]
                self.steps_per_epoch = self.state["loop"].get("steps_per_epoch")
            elif cfg.save_every_epochs is not None:
                self.steps_per_epoch = epoch_steps(cfg, self.source, self.info, 0)
            if self.state is None:
                self.total_steps = estimate_total_steps(cfg, self.source, self.info)
            warm = (
                cfg.warmup_steps if cfg.warmup_steps is not None else int(cfg.warmup_ratio * self.total_steps)
            )
            self.warmup = warm
            self.optimizer: Optimizers = build_optimizers(
                self.wrapped, cfg.optim_config(self.draft_cfg.default_optimizer),
                lambda s: lr_lambda(s, self.total_steps, warm, cfg.schedule, cfg.min_lr_ratio),
                fused=True,  # fused AdamW skips a non-finite step on the device (spectrain.train.step)
                # DDP ranks share Muon's Newton-Schulz work; FSDP's matrices are sharded (decisions.md)
                split=MuonSplit(self.info.rank, self.info.world_size) if self._mode() == "ddp" else None,
            )  # fmt: skip
            self.global_step = 0
            self.epoch = 0
            self.position = 0
            self.plans: list[list[str]] | None = None
            self.current_plans: list[list[str]] | None = None
            if self.state is not None:
                self._restore(self.state)
            self.save_every = self._save_every()
            self.best_tau = self._best_tau_so_far() if cfg.save_best else None
            self.last_saved = -1
            self.best_checkpoint: Path | None = None
            from spectrain.train.trackers import parse_report_to, run_name

            if cfg.run_name:  # placeholders filled in once: the trackers and the saved config agree
                cfg.run_name = run_name(cfg.to_dict(), self.save_path)
            trackers = parse_report_to([*cfg.report_to, *(["tensorboard"] if cfg.tensorboard else [])])
            self.metrics = MetricsLog(self.save_path, self.info.is_main, trackers, cfg.to_dict())
            self.verifier_name = cfg.verifier_name or self.verifier.info.name_or_path
            self.checks = StepChecks(cfg.max_nonfinite_steps, lambda ids: self._vocab_error(ids))
        except BaseException:
            self.close(discard=True)
            raise

    # ------------------------------------------------------------------ setup

    def _restore(self, state: dict[str, Any]) -> None:
        loop = state["loop"]
        if loop.get("distributed") != self._mode() and {loop.get("distributed"), self._mode()} != {
            "ddp",
            "none",
        }:
            raise ValueError(
                f"{self.resume_dir}: saved under {loop.get('distributed')}, resuming under {self._mode()}"
            )
        saved_kind = loop.get("optimizer", "adamw")
        if saved_kind != self.optimizer.kind:
            raise ValueError(f"{self.resume_dir}: trained with optimizer {saved_kind}, resuming with "
                             f"{self.optimizer.kind}")  # fmt: skip
        restore_optimizer(self._mode(), self.wrapped, self.optimizer, state)
        set_rng_state(state["rng"])
        self.global_step = loop["global_step"]
        self.epoch = loop["epoch"]
        self.position = loop["positions"][self.info.rank]
        self.plans = state.get("plans")
        log.info("resumed from %s: step %d, epoch %d, position %d", self.resume_dir, self.global_step, self.epoch,
                 self.position)  # fmt: skip

    def _mode(self) -> str:
        return "none" if not self.info.enabled else self.cfg.distributed

    def _save_every(self) -> int:
        """The checkpoint interval in steps; ``save_every_epochs`` turned into steps (and logged)."""
        cfg = self.cfg
        if cfg.save_every_epochs is None:
            return cfg.save_every
        if self.steps_per_epoch is None:  # a checkpoint saved before the interval was asked for
            self.steps_per_epoch = max(1, self.total_steps // max(1, cfg.epochs))
        every = save_interval(cfg, self.steps_per_epoch)
        if self.info.is_main:
            log.info("--checkpoint-freq %g epochs: a checkpoint every %d steps (%d steps per epoch)",
                     cfg.save_every_epochs, every, self.steps_per_epoch)  # fmt: skip
        return every

    def _best_tau_so_far(self) -> float | None:
        """On a resume: the best validation tau logged up to the checkpoint's step (rank 0 reads it)."""
        if self.state is None:
            return None
        from spectrain.eval.report import read_metrics

        best = None
        if self.info.is_main:
            taus = [float(r["tau"]) for r in read_metrics(self.save_path / "metrics.jsonl").validation
                    if "tau" in r and int(r.get("step", 0)) <= self.global_step]  # fmt: skip
            best = max(taus) if taus else None
        return gather(best, self.info)[0]

    def _keep_if_best(self, rec: dict[str, Any]) -> None:
        """``save_best``: a validation tau above every earlier one checkpoints this step and names it ``best``."""
        tau = rec.get("tau")
        if not self.cfg.save_best or tau is None or (self.best_tau is not None and tau <= self.best_tau):
            return
        self.best_tau = float(tau)
        if self.last_saved != self.global_step:
            self.save()
        self.best_checkpoint = self.last_checkpoint
        if self.info.is_main and self.best_checkpoint is not None:
            write_pointer(self.save_path, BEST, self.best_checkpoint.name)
            log.info("best validation tau %.4f: %s", self.best_tau, self.best_checkpoint)

    # ------------------------------------------------------------------ loop

    def _plan(self, epoch: int) -> list[str]:
        plan = self.source.plan(epoch)
        if self.plans is not None and epoch == self.epoch and self.state is not None:
            saved = self.plans[self.info.rank]
            self.plans = None
            if saved != plan and "resplit_from" in self.state["loop"]:
                log.info(
                    "epoch %d: this rank's share of what the saved run left (%d samples)", epoch, len(saved)
                )
            elif saved != plan:
                log.warning(
                    "epoch %d plan changed since the checkpoint (samples added to or removed from the store); "
                    "continuing the saved plan",
                    epoch,
                )
            if saved != plan:
                use = getattr(self.source, "use_plan", None)
                if use is not None:
                    use(epoch, saved)
                plan = saved
        self.current_plans = gather(plan, self.info)
        return plan

    def _loader(self, source: SampleSource, plan: list[str], start: int) -> PackedLoader:
        if getattr(self, "_buffers", None) is None:  # one pool for every epoch and validation
            self._buffers = BufferPool(self.cfg.grad_accum + 4)
        return PackedLoader(
            source, plan, start=start, total_seq_len=self.cfg.total_seq_len, layers=self.layer_index,
            hidden_dtype=self.hidden_dtype, num_workers=self.cfg.num_workers,
            pin_memory=self.device.type == "cuda", prefetch=self.cfg.prefetch,
            read_threads=max(self.cfg.read_threads, getattr(source, "reads_in_flight", 0)),  # object storage: more
            ahead=self.cfg.grad_accum + 1, device=self.device, buffers=self._buffers,
        )  # fmt: skip

    def _autocast(self):
        if self.amp:
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return torch.autocast(self.device.type, enabled=False)

    def run(self) -> dict[str, Any]:
        """Train to the end (or ``max_steps`` / ``stop_after_steps``); returns a summary.

        SIGINT or SIGTERM stops every rank after the same step and saves a checkpoint there;
        the summary then says ``stopped_by``.
        """
        with StopSignals() as signals:
            return self._run(signals)

    def _run(self, signals: StopSignals) -> dict[str, Any]:
        cfg = self.cfg
        from hsgen.progress import progress_bar
        from spectrain.train.startup import startup_line

        if self.info.is_main:
            log.info("%s", startup_line(self))
            unservable = vllm_refusal(self.module)
            if unservable:
                log.warning("checkpoints of this run load in spectrain eval and speculators, not in vLLM: %s",
                            unservable)  # fmt: skip
        bar = progress_bar(total=self.total_steps, initial=self.global_step, disable=not self.info.is_main, unit="step",
                   desc=f"train {cfg.speculator_type}", dynamic_ncols=True)  # fmt: skip
        window = LogWindow()
        check_every = max(1, min(cfg.log_every, cfg.max_nonfinite_steps))
        refused = 0
        stop = False
        summary: dict[str, Any] = {}
        batches = None
        try:
            while self.epoch < cfg.epochs and not stop:
                plan = self._plan(self.epoch)
                loader = self._loader(self.source, plan, self.position)
                batches = iter(loader)
                while True:
                    if self._limit_reached():
                        stop = True
                        break
                    t0 = time.perf_counter()
                    micro = []
                    for _ in range(cfg.grad_accum):
                        b = next(batches, None)
                        if b is None:
                            break
                        micro.append(b)
                    wait = time.perf_counter() - t0
                    full = len(micro) == cfg.grad_accum or (not self.info.enabled and len(micro) > 0)
                    # one collective decides for all ranks: a rank out of data ends the epoch, a
                    # signal on any rank stops every rank at this same step
                    go_on, calm = all_min_each([int(full), int(signals.signum is None)], self.info)
                    if not calm:
                        stop = True
                        summary["stopped_by"] = signal.Signals(signals.signum or signal.SIGTERM).name
                        break
                    if go_on == 0:
                        break
                    result = self._step(micro)  # queued on the device; nothing is read back
                    ids = [s for b in micro for s in b.sample_ids]
                    self.position = micro[-1].plan_end
                    self.source.consumed(ids)
                    self.global_step += 1
                    self.checks.record(self.global_step, result, ids)
                    window.add(result, sum(b.num_tokens for b in micro), wait)
                    bar.update(1)
                    logs = self.global_step % cfg.log_every == 0
                    if logs or self.global_step % check_every == 0:
                        self.checks.check()
                    if logs:
                        rec = self._train_record(window)
                        self.metrics.write(rec)
                        bar.set_postfix(loss=f"{rec['loss']:.4f}", tau=rec.get("tau"))
                        window = LogWindow()
                    t1 = time.perf_counter()
                    if cfg.val_every and self.global_step % cfg.val_every == 0:
                        summary["validation"] = self.validate()
                    if (
                        self.save_every
                        and self.global_step % self.save_every == 0
                        and (self.last_saved != self.global_step)
                    ):
                        self.save()
                    window.exclude(time.perf_counter() - t1)
                batches.close()
                refused += len(loader.refused)
                if stop:
                    break
                self._skip_rest(plan)
                self.epoch += 1
                self.position = 0
                self.current_plans = None  # a checkpoint now holds no plan: the next epoch is planned afresh
                if self.val_source is not None and not cfg.val_every:
                    summary["validation"] = self.validate()
            if window.steps:  # the last step is always logged, however short the run
                self.checks.check()
                self.metrics.write(self._train_record(window))
            # a signal's stop always saves (the run resumes there); the end of a run unless told not to
            if self.last_saved != self.global_step and (cfg.save_final or "stopped_by" in summary):
                self.save()
            self.checks.check()
        finally:
            if batches is not None:  # an error mid-epoch: the loader's threads stop and are joined here
                batches.close()
            bar.close()
            self.metrics.close()
        summary.update(
            {
                "step": self.global_step,
                "epoch": self.epoch,
                "loss": self.checks.last_loss(),  # None (JSON null) when this run applied no step
                "checkpoint": str(self.last_checkpoint) if self.last_checkpoint else None,
                "nonfinite_steps_skipped": self.checks.skipped,
            }
        )
        if self.cfg.save_best:
            summary["best"] = {"checkpoint": str(self.best_checkpoint) if self.best_checkpoint else None,
                               "tau": self.best_tau}  # fmt: skip
        if self.cache_summary is not None:
            summary["speculators_cache"] = self.cache_summary
            refused += int(self.cache_summary.get("samples_refused") or 0)
        if refused:
            summary["samples_refused"] = refused  # failed their check as read: skipped (warnings name them)
        hidden = getattr(self.source, "samples_hidden", None)
        if callable(hidden) and (n_hidden := hidden()):
            summary["samples_hidden"] = n_hidden  # damaged manifest lines (warned at open): never planned
        stats = getattr(self.source, "stats", None)
        if callable(stats):  # online: samples generated, read, failed (see the failures file)
            summary["data"] = stats()
        return summary

    def _skip_rest(self, plan: list[str]) -> None:
        """Tell the source which samples this epoch leaves untrained (ranks step together, so the
        rank whose samples pack into more sequences drops its last ones, as does a partial
        accumulation under DDP)."""
        rest = plan[self.position :]
        if not rest:
            return
        log.info("epoch %d: the last %d samples of rank %d's plan are not trained (ranks step together)",
                 self.epoch, len(rest), self.info.rank)  # fmt: skip
        skipped = getattr(self.source, "skipped", None)
        if skipped is not None:
            skipped(rest)

    def _limit_reached(self) -> bool:
        cfg = self.cfg
        if cfg.max_steps is not None and self.global_step >= cfg.max_steps:
            return True
        return cfg.stop_after_steps is not None and self.global_step >= cfg.stop_after_steps

    def _step(self, micro: list) -> StepResult:
        """One optimizer step over ``micro`` (:func:`spectrain.train.step.train_step`): no host-device sync."""
        cfg = self.cfg
        on_host = micro[0].input_ids.device.type == "cpu"
        if on_host:  # host tensors: checked before they are sent, for free
            for b in micro:
                self._check_vocab(b)
        gens = [
            step_generator(cfg.seed, self.global_step, self.info.rank, i, self.device)
            for i in range(len(micro))
        ]
        return train_step(self.module, self.wrapped, self.optimizer, micro, gens, autocast=self._autocast,
                          max_grad_norm=cfg.max_grad_norm, device=self.device, distributed=self.info.enabled,
                          vocab_size=None if on_host else self.verifier.vocab_size)  # fmt: skip

    def _check_vocab(self, b) -> None:
        """Refuse a batch holding token ids the verifier does not have (another tokenizer made it)."""
        top = int(b.input_ids.max()) if b.input_ids.numel() else 0
        if top >= self.verifier.vocab_size:
            raise self._vocab_error(b.sample_ids, top)

    def _vocab_error(self, sample_ids: list[str], top: int | None = None) -> ValueError:
        held = f"token id {top}" if top is not None else "token ids"
        return ValueError(
            f"samples {sample_ids[:4]} hold {held}, beyond the verifier's vocabulary of "
            f"{self.verifier.vocab_size} ({self.cfg.verifier}): they were rendered with another tokenizer"
        )

    def _train_record(self, window: LogWindow) -> dict[str, Any]:
        """The log record of the steps since the last one (reads the device: the log-interval sync)."""
        epoch = self.epoch - 1 if self.position == 0 and self.epoch > 0 else self.epoch  # the step's epoch
        return train_record(window, self.info, step=self.global_step, epoch=epoch, position=self.position,
                            lr=self.optimizer.lr, skipped=self.checks.skipped, source=self.source)  # fmt: skip

    @torch.no_grad()
    def validate(self) -> dict[str, Any]:
        """Loss, per-position accuracy and tau on the validation split (all ranks take part)."""
        if self.val_source is None:
            return {}
        self.module.eval()
        sums = MetricSums()
        n = 0
        plan = self.val_source.plan(0)
        batches = iter(self._loader(self.val_source, plan, 0))
        try:
            while True:
                limit = self.cfg.val_max_sequences is not None and n >= self.cfg.val_max_sequences
                b = None if limit else next(batches, None)
                if all_min(int(b is not None), self.info) == 0:
                    break
                b = b.to(self.device, non_blocking=True)
                gen = step_generator(self.cfg.seed, 0, self.info.rank, n, self.device)
                with self._autocast():
                    _, metrics = self.module(b, gen)
                sums.add(metrics)
                n += 1
        finally:
            batches.close()
        rec = {"split": "validation", "step": self.global_step, "epoch": self.epoch, "sequences": n,
               **sums.summary(self.info)}  # fmt: skip
        self.metrics.write(rec)
        if self.info.is_main:
            log.info("validation step %d: loss %s tau %s acc %s", self.global_step, rec.get("loss"), rec.get("tau"),
                     rec.get("acc"))  # fmt: skip
        self._keep_if_best(rec)
        return rec

    # ------------------------------------------------------------------ checkpoints

    last_checkpoint: Path | None = None

    def save(self) -> Path:
        """Write ``checkpoint-<step>`` (servable export + trainer state) and point ``latest`` at it."""
        self.checks.check()  # a run over its non-finite limit stops here, before anything is written
        name = f"checkpoint-{self.global_step:08d}"
        model_sd, optim_sd = full_states(self._mode(), self.wrapped, self.module, self.optimizer)
        bad = [k for k, v in model_sd.items() if v.is_floating_point() and not bool(torch.isfinite(v).all())]
        if bad and self._mode() != "fsdp":  # FSDP gathers the weights on rank 0 only: no rank may raise alone
            raise NonFiniteTraining(f"refusing to save {name}: weights {bad[:3]} hold NaN/inf")
        positions = gather(self.position, self.info)
        plans = getattr(self, "current_plans", None)
        final = self.save_path / name
        if self.info.is_main:
            loop = {
                "global_step": self.global_step,
                "epoch": self.epoch,
                "positions": positions,
                "world_size": self.info.world_size,
                "total_steps": self.total_steps,
                "distributed": self._mode(),
                "optimizer": self.optimizer.kind,
                "steps_per_epoch": self.steps_per_epoch,
            }
            state = {"model": model_sd, "optimizer": optim_sd, "scheduler": self.optimizer.scheduler_state(),
                     "rng": rng_state(), "draft_config": self.draft_cfg.to_dict(), "loop": loop, "plans": plans}  # fmt: skip
            resolved = {"train": self.cfg.to_dict(), "draft": self.draft_cfg.to_dict(), "loop": loop}
            try:
                write_checkpoint(self.save_path, name, state, resolved,
                                 lambda d: export_draft(self.module, d, verifier_name=self.verifier_name,
                                                        architectures=self.verifier.info.architectures,
                                                        state=model_sd, for_vllm=False))  # fmt: skip
            except CheckpointWriteError as e:
                failed = e
            else:
                failed = None
                prune_checkpoints(self.save_path, self.cfg.keep_checkpoints)
                log.info("saved %s", final)
        else:
            failed = None
        # every rank learns whether the save failed (instead of waiting at a barrier for rank 0)
        if not all_min(int(failed is None), self.info):
            raise failed or CheckpointWriteError(
                f"{final}: rank 0 could not save the checkpoint (its line says why)"
            )
        self.last_checkpoint = final
        self.last_saved = self.global_step
        return final

    def close(self, discard: bool = False) -> None:
        """End what the run holds on this rank, in order (idempotent): the sources (their threads
        joined; ``discard``, a run that failed, also removes their scratch stores), the trackers,
        then the process groups (:func:`~spectrain.train.distributed.teardown_distributed`: after a clean
        end behind a barrier, after a failure at once)."""
        if self._closed:
            return
        self._closed = True
        try:
            for src in (getattr(self, "source", None), getattr(self, "val_source", None)):
                if src is None:
                    continue
                if discard and hasattr(src, "discard_scratch"):
                    src.discard_scratch()
                src.close()
            metrics = getattr(self, "metrics", None)
            if metrics is not None:
                metrics.close()
        finally:
            info = getattr(self, "info", None)
            if info is not None:
                teardown_distributed(info, clean=not discard)


def train(
    cfg: TrainConfig, source: SampleSource | None = None, val_source: SampleSource | None = None
) -> dict:
    """Run training end to end; returns the summary (last step, loss, checkpoint path, validation)."""
    trainer = Trainer(cfg, source, val_source)
    try:
        summary = trainer.run()
    except BaseException:
        trainer.close(discard=True)  # an error exit leaves no scratch store behind (in /dev/shm: RAM)
        raise
    trainer.close()
    return summary
