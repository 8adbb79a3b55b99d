"""What the server's handlers share: :class:`ServerState` (config, model, engine, writer, faults),
built and checked by :func:`build_state`, and :class:`HTTPError`, vLLM's JSON error body."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field

from aiohttp import web

from hsgen.protocol import extraction as protocol
from hsgen.serve.config import ServeConfig
from hsgen.serve.engine import Engine
from hsgen.serve.faults import FaultPlan
from hsgen.serve.hidden import (
    HiddenStateExtractor,
    LoadedModel,
    load_model,
    num_hidden_layers_of,
    resolve_model_path,
)
from hsgen.serve.writer import HiddenStatesWriter

STATE_KEY = web.AppKey("hsgen_serve_state", object)


class HTTPError(Exception):
    """Raised by request parsing; becomes vLLM's JSON error body."""

    def __init__(self, status: int, message: str, type_: str = "BadRequestError", param: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type_ = type_
        self.param = param

    def response(self) -> web.Response:
        body = protocol.error_body(self.message, type_=self.type_, code=self.status)
        body["error"]["param"] = self.param
        return web.json_response(body, status=self.status)


@dataclass
class ServerState:
    """Everything the handlers share: config, model, engine, writer, faults."""

    config: ServeConfig
    loaded: LoadedModel
    extractor: HiddenStateExtractor
    max_model_len: int
    engine: Engine | None = None
    writer: HiddenStatesWriter | None = None
    faults: FaultPlan | None = None
    created: int = field(default_factory=lambda: int(time.time()))
    requests_total: int = 0


def build_state(config: ServeConfig, loaded: LoadedModel | None = None) -> ServerState:
    """Load the model (unless given) and check the configuration against it."""
    config.validate()
    if loaded is None:
        path = resolve_model_path(config.model, config.tiny_cache_dir, config.revision)
        protocol.normalize_layer_ids(
            config.layer_ids, num_hidden_layers_of(path)
        )  # fail before loading weights
        loaded = load_model(
            str(path), dtype=config.dtype, device=config.device, tiny_cache_dir=config.tiny_cache_dir
        )
    extractor = HiddenStateExtractor(loaded, config.layer_ids)
    max_model_len = config.max_model_len or loaded.max_position_embeddings or 2048
    if loaded.max_position_embeddings and max_model_len > loaded.max_position_embeddings:
        raise ValueError(
            f"--max-model-len {max_model_len} exceeds the model's max_position_embeddings "
            f"{loaded.max_position_embeddings} ({loaded.path / 'config.json'})"
        )
    os.makedirs(config.shared_storage_path, exist_ok=True)
    return ServerState(config, loaded, extractor, max_model_len, faults=config.faults)
