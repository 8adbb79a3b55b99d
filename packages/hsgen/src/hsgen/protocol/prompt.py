"""What one request sends: a prompt's token ids and the loss mask over them (:class:`RenderedPrompt`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class RenderedPrompt:
    """A prompt ready to send: token ids and the loss mask over them.

    Attributes:
        sample_id: the stable id the sample is stored under.
        token_ids: prompt token ids, exactly as sent to the server.
        loss_mask: one 0/1 entry per token (1 = train on this token).
        truncated: whether ``--max-len`` cut the prompt.
        source: ``file:line`` the sample came from ("" when unknown).
    """

    sample_id: str
    token_ids: list[int]
    loss_mask: list[int]
    truncated: bool = False
    source: str = ""

    def __post_init__(self) -> None:
        if len(self.token_ids) != len(self.loss_mask):
            raise ValueError(
                f"sample {self.sample_id!r}: {len(self.token_ids)} token ids but {len(self.loss_mask)} mask entries"
            )

    def to_json(self) -> dict[str, Any]:
        """The JSONL record ``hsgen render`` prints (and ``hsgen generate`` reads)."""
        return {"id": self.sample_id, "input_ids": self.token_ids, "loss_mask": self.loss_mask}


__all__ = ["RenderedPrompt"]
