"""DSpark: DFlash's block drafter with a Markov head and a confidence head (speculators 0.9.0's
``--speculator-type dspark``; served by vLLM >= 0.32 as method ``dspark``).

- :class:`DSparkConfig`: the options (``sample_from_anchor``, ``markov_rank``, ``markov_head_type``,
  the confidence head, ``loss_mix``, ``slot_mask``, ``anchor_needs_label`` and DFlash's).
- :class:`DSparkDraft`: training on DFlash's anchors and masks, the sequential Markov decoding,
  the vLLM export.
- :func:`mix_loss`: the chunked ``ce`` / ``kl_div`` / ``tv`` loss with the Markov bias as extra
  head columns.
"""

from spectrain.models.dspark.heads import ConfidenceHead, MarkovHead
from spectrain.models.dspark.loss import LOSS_TERMS, MixLoss, SlotWeighting, mix_loss, parse_loss_mix
from spectrain.models.dspark.model import MARKOV_HEADS, DSparkConfig, DSparkDraft

__all__ = [
    "LOSS_TERMS",
    "MARKOV_HEADS",
    "ConfidenceHead",
    "DSparkConfig",
    "DSparkDraft",
    "MarkovHead",
    "MixLoss",
    "SlotWeighting",
    "mix_loss",
    "parse_loss_mix",
]
