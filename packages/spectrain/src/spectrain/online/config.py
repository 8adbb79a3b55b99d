"""Settings of an online run: :class:`OnlineConfig`, its validation and its mapping from ``TrainConfig``."""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hsgen.client.config import normalize_endpoint

log = logging.getLogger(__name__)


@dataclass
class OnlineConfig:
    """Settings of :class:`OnlineSource`; ``spectrain train --online`` maps its flags onto these.

    Attributes:
        endpoints: vLLM (or ``hsgen serve``) base URLs, e.g. ``http://localhost:8000``.
        prompts: dataset files (JSONL, JSON, Parquet) read with :func:`hsgen.inputs.formats.read_inputs`.
        store: the offline store: samples present there are read, never fetched. It may be
            empty, missing (pure online) or still being filled by ``hsgen generate``.
        verifier: local verifier directory: its tokenizer and chat template render the prompts.
        save_path: the training run's output directory (scratch falls back here, failures file).
        layer_ids: vLLM layer ids the servers extract; needed only when ``store`` does not
            exist yet (otherwise the store header says).
        scratch_dir: where generated samples go (``<scratch_dir>/rank<r>`` with several ranks);
            default ``/dev/shm/spectrain-scratch-...`` when it has room, else
            ``<save_path>/online-scratch-rank<r>``.
        scratch_bytes: bound on scratch bytes per rank (in flight + written + not yet deletable) when
            ``delete_consumed``; without it, the bound applies to samples not yet consumed.
        prefetch_samples: most samples fetched or held ahead of the trainer.
        max_in_flight: most concurrent requests (the client may queue them further).
        delete_consumed: delete a generated shard once all its samples were consumed.
        delete_cached: also delete shards of the offline ``store`` once all their samples
            were consumed by this rank (explicit opt-in: it destroys the user's cache).
        cache_generated: write generated samples into ``store`` (kept for later epochs and
            runs) instead of the scratch store.
        persist_fetched: where a fetched sample goes. None (the default): read once with
            ``delete_consumed`` (and not ``cache_generated``), committed to the scratch store
            otherwise. Read once: the sample goes from the server's file straight into its
            batch, one copy per byte, and is held in memory (counted in the bound) until its
            optimizer step completes; after a crash the samples fetched but not trained are
            fetched again. True: every fetched sample is committed to the scratch store and
            read back from it, so a restarted run reads the ones it fetched but did not train.
            False: read once (needs ``delete_consumed``).
        rank: this process's rank; it fetches only its own share of the plan.
        world_size: number of ranks.
        seed: shuffle seed of the epoch plan.
        validation_fraction: share of sample ids held out of the plan (by
            :func:`spectrain.data.sources.split_of`, as offline).
        shared_dir: the servers' ``shared_storage_path`` as seen from this machine.
        split: ``"train"`` or ``"validation"``: which ids the plan holds.
        max_len: longest prompt in tokens (vLLM needs ``max_model_len - 1``).
        on_too_long: ``"truncate"`` or ``"skip"`` (a skipped prompt is reported as failed).
        chat_template: a template file overriding the verifier's.
        template_kwargs: extra chat-template variables (e.g. ``{"enable_thinking": false}``),
            as ``hsgen generate --template-kwargs`` takes them, so both render alike.
        prompts_split: the split read from a dataset input (hub id or datasets directory).
        max_prompts: rows read from each dataset input (None: all).
        prompts_streaming: stream a hub dataset instead of downloading its files first.
        api_key: bearer token for the servers; default ``$VLLM_API_KEY``, the place to keep it (saved
            configs redact it, and never print it).
        failures_path: JSONL file of samples that could not be produced
            (default ``<save_path>/online-failures-rank<r>.jsonl``).
        client_options: extra :class:`hsgen.client.fetch.ClientConfig` fields (timeouts, retries, ...).
        saturation: :class:`hsgen.client.saturate.SaturationConfig` fields: requests in flight per
            server adapt as in ``hsgen generate`` (queue just non-empty); ``{"concurrency": N}`` fixes it.
        shard_bytes: scratch shard size; default ``scratch_bytes / 8`` within [256 KiB, 8 MiB].
        flush_interval_s: longest a fetched sample waits in the writer buffer before commit.
        store_refresh_s: how often the offline store's manifests are re-read (mixed runs).
        endpoint_per_local_rank: each rank talks only to the ``LOCAL_RANK``-th of ``endpoints``
            (modulo their number): one node-local server per GPU. Endpoints may also be templates,
            ``http://localhost:{8000+local_rank}`` (see :mod:`hsgen.generate.launcher`).
    """

    endpoints: list[str]
    prompts: list[str]
    store: str
    verifier: str
    save_path: str | None = None
    layer_ids: list[int] | None = None
    scratch_dir: str | None = None
    scratch_bytes: int = 8 << 30
    prefetch_samples: int = 512
    max_in_flight: int = 64
    delete_consumed: bool = False
    delete_cached: bool = False
    cache_generated: bool = False
    persist_fetched: bool | None = None
    rank: int = 0
    world_size: int = 1
    seed: int = 0
    validation_fraction: float = 0.0
    shared_dir: str = "/tmp"
    split: str = "train"
    max_len: int | None = None
    on_too_long: str = "truncate"
    chat_template: str | None = None
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    prompts_split: str = "train"
    max_prompts: int | None = None
    prompts_streaming: bool = False
    api_key: str | None = field(default_factory=lambda: os.environ.get("VLLM_API_KEY") or None, repr=False)
    failures_path: str | None = None
    client_options: dict[str, Any] = field(default_factory=dict)
    saturation: dict[str, Any] = field(default_factory=dict)
    shard_bytes: int | None = None
    flush_interval_s: float = 0.05
    store_refresh_s: float = 0.5
    endpoint_per_local_rank: bool = False

    @classmethod
    def from_train_config(cls, cfg: Any, rank: int = 0, world_size: int = 1) -> OnlineConfig:
        """Build from a :class:`spectrain.train.config.TrainConfig` (``--online`` runs).

        ``cfg.online_options`` (``--online-option KEY=VALUE``) sets any other field of this class.
        Without a store and without ``layer_ids``, the layers are the draft's ``--target-layer-ids``
        plus its target layer, else the algorithm's default for the verifier's depth.
        """
        extra = dict(getattr(cfg, "online_options", None) or {})
        names = set(cls.__dataclass_fields__)
        unknown = sorted(set(extra) - names)
        if unknown:
            raise ValueError(f"online_options: unknown option(s) {unknown}; known: {sorted(names)}")
        prompts = cfg.prompts
        if isinstance(prompts, str):
            prompts = [prompts]
        save_path = cfg.save_path
        kwargs: dict[str, Any] = {
            "endpoints": list(cfg.endpoints),
            "prompts": list(prompts or []),
            "store": cfg.store or os.path.join(save_path, "online-store"),
            "verifier": cfg.verifier,
            "save_path": save_path,
            "delete_consumed": bool(cfg.delete_consumed),
            "cache_generated": bool(cfg.cache_generated),
            "rank": rank,
            "world_size": world_size,
            "seed": cfg.seed,
            "validation_fraction": cfg.val_fraction,
        }
        if getattr(cfg, "chat_template", None):
            kwargs["chat_template"] = cfg.chat_template
        kwargs.update(extra)
        kwargs["endpoints"] = _node_local(kwargs, rank, world_size)
        if not kwargs.get("layer_ids"):
            kwargs["layer_ids"] = _default_layer_ids(cfg)
        return cls(**kwargs)

    def prompt_inputs(self) -> list[Any]:
        """``prompts`` with dataset inputs as :class:`hsgen.inputs.hf_datasets.DatasetSpec` (split, max, streaming)."""
        from hsgen.inputs.hf_datasets import as_input

        return [as_input(p, split=self.prompts_split, max_samples=self.max_prompts,
                         streaming=self.prompts_streaming) for p in self.prompts]  # fmt: skip

    @property
    def reads_once(self) -> bool:
        """Whether fetched samples are read once from memory instead of committed (``persist_fetched``)."""
        if self.persist_fetched is None:
            return self.delete_consumed and not self.cache_generated
        return not self.persist_fetched

    def validate(self) -> None:
        """Raise ``ValueError`` naming the option for settings that cannot work."""
        if not self.endpoints:
            raise ValueError("--online needs at least one --endpoint URL")
        for url in self.endpoints:
            normalize_endpoint(url)
        if not self.prompts:
            raise ValueError("--online needs --prompts FILE (the training prompts)")
        if self.world_size < 1 or not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank {self.rank} is not in 0..{self.world_size - 1}")
        if self.scratch_bytes < 1 << 20:
            raise ValueError(f"--scratch-bytes must be at least 1 MiB, got {self.scratch_bytes}")
        if self.prefetch_samples < 1 or self.max_in_flight < 1:
            raise ValueError("--prefetch-samples and --max-in-flight must be >= 1")
        if self.delete_consumed and self.cache_generated:
            raise ValueError("--delete-consumed and --cache-generated contradict each other: pick one")
        if self.persist_fetched is False and not (self.delete_consumed and not self.cache_generated):
            raise ValueError(
                "persist_fetched=false reads each fetched sample once, so it needs --delete-consumed "
                "(and not --cache-generated): later epochs would have nothing to read"
            )
        if self.split not in ("train", "validation"):
            raise ValueError(f"split must be 'train' or 'validation', got {self.split!r}")
        if self.cache_generated and not self.store:
            raise ValueError("--cache-generated needs --store DIR (where generated samples are kept)")
        if not 0.0 <= self.validation_fraction < 1.0:
            raise ValueError(f"validation fraction must be in [0, 1), got {self.validation_fraction}")


def _node_local(kwargs: dict[str, Any], rank: int, world_size: int) -> list[str]:
    """The endpoints of this rank: templates expanded with its local rank, or the
    ``LOCAL_RANK``-th of the list with ``endpoint_per_local_rank``."""
    from hsgen.generate.launcher import Ranks, endpoints_for_rank, resolve_ranks
    from hsgen.protocol import extraction as protocol

    try:
        launch = resolve_ranks(env=os.environ)
    except ValueError:
        launch = Ranks()
    ranks = Ranks(world_size, rank, launch.local_rank, launch.node_rank, launch.source)
    urls = endpoints_for_rank(
        list(kwargs["endpoints"]), ranks, per_local_rank=bool(kwargs.get("endpoint_per_local_rank"))
    )
    if urls != list(kwargs["endpoints"]):
        shown = [protocol.redact_url(u) for u in urls]
        log.info("rank %d (local rank %d) uses endpoints %s", rank, ranks.local_rank, shown)
    return urls


def _default_layer_ids(cfg: Any) -> list[int] | None:
    """The layers a pure online run asks the servers for (see :meth:`OnlineConfig.from_train_config`)."""
    from hsgen.protocol import extraction as protocol

    draft = dict(getattr(cfg, "draft", None) or {})
    aux = draft.get("aux_layer_ids")
    try:
        num_layers = int(json.loads((Path(cfg.verifier) / "config.json").read_text())["num_hidden_layers"])
    except (OSError, KeyError, ValueError, TypeError):
        num_layers = None
    if aux:
        target = draft.get("target_layer_id", num_layers)
        return protocol.normalize_layer_ids([*aux, *([target] if target is not None else [])])
    if num_layers is None:
        return None
    if getattr(cfg, "speculator_type", "dflash") == "eagle3":
        return protocol.default_eagle3_layer_ids(num_layers)
    return protocol.default_dflash_layer_ids(num_layers)
