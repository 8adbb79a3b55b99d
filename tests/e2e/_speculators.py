"""A speculators hidden-state cache made by speculators' own code: the prepared dataset's columns
(``input_ids``, ``loss_mask``, ``seq_len``) and ``generate-offline-data``'s files from ``hsgen serve``."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

LAYERS = [1, 2, 3, 4]
"""The tiny verifier's layers: 1, 2, 3 feed the draft (``--target-layer-ids 1 2 3``), 4 is the last."""


def prepared_dataset(
    path: Path, model_dir: Path, sample_chats_path: Path, n: int, max_len: int = 160
) -> dict:
    """The columns speculators' prepare-data writes (input_ids, loss_mask, seq_len; torch format)."""
    import datasets

    from hsgen.inputs.render import ChatRenderer, RenderConfig

    renderer = ChatRenderer(RenderConfig(tokenizer_path=str(model_dir), max_len=max_len))
    rows = {"input_ids": [], "loss_mask": [], "seq_len": []}
    for line in sample_chats_path.read_text().splitlines()[:n]:
        ids, mask = renderer.render_messages(json.loads(line)["messages"])
        rows["input_ids"].append(list(ids[:max_len]))
        rows["loss_mask"].append(list(mask[:max_len]))
        rows["seq_len"].append(min(len(ids), max_len))
    datasets.Dataset.from_dict(rows).with_format("torch").save_to_disk(str(path))
    return rows


def speculators_generate(url: str, data: Path, output: Path | None = None, concurrency: int = 4) -> None:
    """speculators 0.9.0's own generate-offline-data against ``url`` (skips without speculators)."""
    offline = pytest.importorskip("speculators.cli.generate_offline_data",
                                  reason="scripts/install.sh installs speculators 0.9.0")  # fmt: skip
    asyncio.run(offline._generate_and_save_hidden_states(
        model=None, endpoint=f"{url}/v1", preprocessed_data=str(data), output=None if output is None else str(output),
        max_samples=None, concurrency=concurrency, validate_outputs=True, request_timeout=600, max_retries=1,
        fail_on_error=True, max_consecutive_errors=None, world_size=1, rank=0))  # fmt: skip
