"""A new store's shape from what the user named, not from the first file a server sends.

A store that does not exist yet takes its layer count from the layer ids asked for
(``--layer-ids``), its hidden size from the model's ``config.json`` (``--verifier`` or
``--tokenizer``, each a directory or a hub id resolved through :mod:`hsgen.hf.hub`, or the model the
servers name in ``GET /v1/models`` when that is a directory or a cached hub id), its dtype from
``--dtype``. Every server file is checked on its header against them before any of its payload is
read (:class:`~hsgen.client.hidden_file.ExpectedStates`), so a misconfigured server (another model,
another layer set) ends the run at its first file instead of filling a store nobody can train on.
What nothing names is taken from the first file, and one line says so.

:class:`NewStore` is the store to create (a :class:`~hsgen.generate.sink.LazyStore`): the generate
run tells it the served models after its probe (:meth:`NewStore.learn_served`) and it creates the
store from its shape when the first sample lands.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hsgen.client.hidden_file import ExpectedStates
from hsgen.store.backend import is_remote

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelConfig:
    """What a model's ``config.json`` says of the states a server extracts from it."""

    path: str
    """The ``config.json`` read."""
    flag: str
    """What named the model (``--verifier``, ``--tokenizer``, ``the served model``)."""
    hidden_size: int
    num_hidden_layers: int | None = None

    @property
    def source(self) -> str:
        return f"{self.path}, {self.flag}"


def model_config(
    name: str | os.PathLike[str] | None, flag: str, *, revision: str | None = None, download: bool = False
) -> ModelConfig | None:
    """The config of the model ``name`` names: a directory with a ``config.json``, or a hub id
    (from the cache; with ``download``, else from the hub). None when it names no model config
    with a hidden size (a bare name is no error: the shape is then learnt elsewhere)."""
    if not name:
        return None
    path = Path(str(name)).expanduser()
    if path.is_dir():
        config = path / "config.json"
    else:
        from hsgen.hf import hub

        found = hub.config_file(str(name), revision=revision, download=download)
        if found is None:
            return None
        config = found
    size = ExpectedStates.model_hidden_size(config.parent)
    if size is None:
        return None
    try:
        doc = json.loads(config.read_text())
        layers = doc.get("text_config", doc).get("num_hidden_layers")
    except (OSError, ValueError, AttributeError):
        layers = None
    return ModelConfig(str(config), flag, size, layers if isinstance(layers, int) else None)


@dataclass(frozen=True)
class StoreShape:
    """What every sample of a new store holds, and where each figure comes from.

    Attributes:
        layer_ids: the layer ids asked for (their number is the layer count; none: not known).
        model: the model config the hidden size comes from (None: not known yet).
        dtype: the dtype asked for (None: the servers' first file's).
        unread: what the user named whose config could not be read (``--verifier ORG/NAME``: no
            directory, not in the hub cache, the hub not reached), said when the store is created.
    """

    layer_ids: tuple[int, ...]
    model: ModelConfig | None = None
    dtype: str | None = None
    unread: tuple[str, ...] = ()

    @classmethod
    def named(
        cls,
        layer_ids: Sequence[int],
        *,
        verifier: str | None = None,
        tokenizer_dir: str | None = None,
        dtype: str | None = None,
        revision: str | None = None,
    ) -> StoreShape:
        """The shape the user's flags name: the model is ``--verifier``'s when it names one (a
        directory, a cached hub id, else a hub id fetched), else ``--tokenizer``'s directory.

        Raises:
            ValueError: a layer id beyond the model's layers (its config names them).
        """
        model = model_config(verifier, "--verifier", revision=revision)
        model = model or model_config(tokenizer_dir, "--tokenizer")
        if model is None and verifier:
            model = model_config(verifier, "--verifier", revision=revision, download=True)
        named = (("--verifier", verifier), ("--tokenizer", tokenizer_dir))
        unread = tuple(f"{flag} {name}" for flag, name in named if name) if model is None else ()
        shape = cls(tuple(layer_ids), model, dtype, unread)
        shape.check_layer_ids()
        return shape

    def check_layer_ids(self) -> None:
        """Every layer id is one of the model's: 0 (embeddings) to ``num_hidden_layers``."""
        from hsgen.protocol import extraction as protocol

        if not self.layer_ids or self.model is None or self.model.num_hidden_layers is None:
            return
        try:
            protocol.normalize_layer_ids(self.layer_ids, self.model.num_hidden_layers)
        except ValueError as e:
            raise ValueError(f"--layer-ids: {e} ({self.model.path})") from None

    def with_served(self, models: Iterable[str]) -> StoreShape:
        """This shape, its hidden size taken from a served model when nothing else named one and
        the id is a model directory or a cached hub id (never downloaded: a served id may be any name)."""
        if self.model is not None:
            return self
        for model in dict.fromkeys(models):
            found = model_config(model, "the served model")
            if found is not None:
                return dataclasses.replace(self, model=found)
        return self

    def expected(self) -> ExpectedStates:
        """What each server file must hold to go into the store."""
        return ExpectedStates(
            len(self.layer_ids) or None,
            self.model.hidden_size if self.model else None,
            self.dtype,
            hidden_from=self.model.source if self.model else "",
        )

    def describe(self, path: Any, hidden_size: int, dtype: str) -> str:
        """The one line saying which shape the new store at ``path`` takes and from where."""
        ids = ",".join(map(str, self.layer_ids))
        layers = f"{len(self.layer_ids)} layers (--layer-ids {ids})"
        where_dtype = "--dtype" if self.dtype else "the servers' first file"
        if self.model is not None:
            return (f"new store {path}: {layers}, hidden size {hidden_size} (the model's, {self.model.source}), "
                    f"{dtype} ({where_dtype})")  # fmt: skip
        if self.unread:  # the user named a model, but its config could not be read here
            return (
                f"new store {path}: {layers}, hidden size {hidden_size} and {dtype} from the servers' first file: "
                f"{' and '.join(self.unread)} gave no config.json to check it against (neither a model directory "
                "nor a hub id in the cache or on a reachable hub)"
            )
        return (
            f"new store {path}: {layers}, hidden size {hidden_size} and {dtype} from the servers' first file: "
            "nothing names the model (pass --verifier or --tokenizer, a model directory or hub id, to have "
            "every file checked against its config)"
        )


class NewStore:
    """A store that does not exist yet, created with its expected shape when the first sample lands.

    It is a :class:`~hsgen.generate.sink.LazyStore` for :class:`~hsgen.generate.sink.StoreSink`: calling
    it with the first fetched sample creates the store (hidden size and dtype from the shape where
    it names them, else the sample's, which was checked against :attr:`expected` on its header).
    """

    def __init__(
        self, path: str | Path, shape: StoreShape, *, verifier: str | None = None, fingerprint: str = "",
        codec: str = "raw", targets: str = "states",
    ):  # fmt: skip
        self.path = path if is_remote(path) else Path(path)
        self.shape = shape
        self.verifier = verifier
        self.fingerprint = fingerprint
        self.codec = codec
        self.targets = targets
        self.served: str | None = None

    @property
    def expected(self) -> ExpectedStates:
        return self.shape.expected()

    def learn_served(self, models: dict[str, str]) -> bool:
        """Take the servers' model ids (``{url: model}`` of the probe): the header's verifier name
        when none was given, the hidden size when that model resolves and nothing else named one.
        Returns whether :attr:`expected` changed."""
        if models:
            self.served = self.served or next(iter(models.values()))
        before = self.shape
        self.shape = self.shape.with_served(models.values())
        return self.shape != before

    def __call__(self, sample: Any) -> Any:
        from hsgen.store import HiddenStateStore, StoreHeader

        expected = self.expected
        problem = expected.problem(tuple(sample.hidden_states.shape), sample.dtype)
        if problem is not None:  # a reader that did not check the header (the client always does)
            raise ValueError(problem)
        hidden = expected.hidden_size or int(sample.hidden_states.shape[2])
        dtype = expected.dtype or sample.dtype
        header = StoreHeader(
            verifier=self.verifier or self.served or sample.endpoint,
            layer_ids=self.shape.layer_ids,
            hidden_size=hidden,
            dtype=dtype,
            tokenizer_fingerprint=self.fingerprint,
            codec=self.codec,
            targets=self.targets,
        )
        store = HiddenStateStore.create(self.path, header)
        line = self.shape.describe(self.path, hidden, dtype)
        (log.info if self.shape.model is not None else log.warning)("%s", line)
        return store


__all__ = ["ModelConfig", "NewStore", "StoreShape", "model_config"]
