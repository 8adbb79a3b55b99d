"""The prompts of an online run: read once, split by id, rendered on demand (the request side)."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from spectrain.data.sources import split_of
from spectrain.online.config import OnlineConfig

log = logging.getLogger(__name__)


class PromptSet:
    """Every prompt of the run by sample id, its split, and the renderer that turns it into tokens.

    Args:
        config: the run's settings (prompt files, split, verifier and template, length limits).
        inputs: prompts already read, by sample id (the validation source shares the training
            source's, so ``--prompts -`` reads stdin once); default: read ``config.prompts``.
    """

    def __init__(self, config: OnlineConfig, inputs: dict[str, Any] | None = None):
        from hsgen.inputs.formats import read_inputs
        from hsgen.inputs.render import ChatRenderer, RenderConfig

        self.inputs: dict[str, Any] = {}
        if inputs is not None:
            self.inputs = inputs
        else:
            for sample in read_inputs(config.prompt_inputs(), on_bad_input="fail"):
                if sample.sample_id in self.inputs:
                    log.warning(
                        "%s: duplicate sample id %r: the first one is used", sample.source, sample.sample_id
                    )
                    continue
                self.inputs[sample.sample_id] = sample
            _warn_no_assistant_turn(config.prompts, self.inputs.values())
        if not self.inputs:
            raise ValueError(f"--prompts {config.prompts}: no samples")
        frac = config.validation_fraction
        self.train_ids = [i for i in self.inputs if split_of(i, frac) == "train"]
        self.validation_ids = [i for i in self.inputs if split_of(i, frac) == "validation"]
        self.split_ids = self.train_ids if config.split == "train" else self.validation_ids
        if not self.split_ids:
            raise ValueError(f"--prompts {config.prompts}: no samples in the {config.split} split")
        self.renderer = ChatRenderer(
            RenderConfig(
                tokenizer_path=config.verifier if os.path.isdir(config.verifier) else None,
                chat_template=config.chat_template,
                template_kwargs=dict(config.template_kwargs),
                max_len=config.max_len,
                on_too_long=config.on_too_long,  # type: ignore[arg-type]
            )
        )

    @property
    def fingerprint(self) -> str:
        """Tokenizer + chat template fingerprint (what a store's header must match)."""
        return self.renderer.fingerprint

    def render(self, sample_id: str):
        """The sample's :class:`hsgen.inputs.render.RenderedPrompt` (raises ``RenderError``)."""
        return self.renderer.render(self.inputs[sample_id])

    def source_of(self, sample_id: str) -> str:
        """Where the prompt came from (``file:line``), for failure reports."""
        return getattr(self.inputs.get(sample_id), "source", "")

    def token_ids(self, sample_id: str) -> tuple[np.ndarray, np.ndarray] | None:
        """``(token_ids, loss_mask)`` from rendering alone (None if it cannot be rendered)."""
        from hsgen.inputs.render import RenderError

        try:
            p = self.render(sample_id)
        except RenderError:
            return None
        return np.asarray(p.token_ids, dtype=np.int64), np.asarray(p.loss_mask, dtype=np.uint8)

    def rough_tokens(self, sample_ids: Sequence[str]) -> list[int]:
        """Token counts without rendering: exact for token-id prompts, 4 characters a token for text."""
        out = []
        for sid in sample_ids:
            s = self.inputs[sid]
            if s.input_ids is not None:
                out.append(len(s.input_ids))
            else:
                text = s.prompt or json.dumps([dict(m) for m in s.messages or ()])
                out.append(len(text) // 4 + 8)
        return out


def _warn_no_assistant_turn(prompts: Any, samples) -> int:
    """One warning for the chats with no assistant turn (their loss masks are all 0: nothing in
    them is trained on), as ``hsgen generate`` counts them; returns how many."""
    empty = [
        s
        for s in samples
        if s.kind == "messages" and not any(m.get("role") == "assistant" for m in s.messages)
    ]
    if empty:
        log.warning(
            "--prompts %s: %d chats have no assistant turn: their loss masks are all 0, nothing in them is "
            "trained on (the first: %s)", prompts, len(empty), empty[0].source or repr(empty[0].sample_id),
        )  # fmt: skip
    return len(empty)
