"""The quality benchmark's sizes (target, data, the drafts' common budget) and draft recipes.

Each :class:`BenchSize` fixes everything a run of ``bench_quality.py`` depends on; the figures in
docs/benchmarks.md name the size they were measured on. Not a benchmark itself.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from quality_target import TargetSpec


@dataclass(frozen=True)
class BenchSize:
    """One benchmark size: target, data and the drafts' common budget."""

    target: TargetSpec
    num_train_prompts: int
    prompt_tokens: int
    """Tokens of standard-library text before the target's continuation."""
    continuation_tokens: int
    """Greedy tokens of the target after each training prompt (the trained positions)."""
    num_eval_prompts: int
    eval_new_tokens: int
    draft_epochs: int
    """Passes over the training prompts, the same for both drafts (the equal budget)."""
    dflash_lr: float
    """Peak learning rate of each draft, swept on this size with its default optimizer."""
    eagle3_lr: float
    draft_seq_len: int
    """Tokens per packed training sequence (``--total-seq-len``)."""
    dflash_layers: int
    dflash_max_anchors: int
    """DFlash anchors drawn per packed sequence (the paper: 512 per 3072-token sequence)."""
    dflash_block_size: int
    """DFlash block; both drafts are evaluated with ``K = dflash_block_size - 1`` tokens per step."""
    eagle3_ttt_steps: int
    """Eagle3 training-time-test steps (its chain still drafts K tokens at evaluation, as in vLLM)."""
    peer_dflash_lr: float = 1e-3
    """The peer's (speculators 0.9.0's trainer) learning rate, swept on this size as ours
    (``bench_quality.py --peer --lrs``); 1e-3 is its default, for sizes not swept."""
    peer_eagle3_lr: float = 1e-3
    peer_dspark_lr: float = 1e-3
    """Not swept on its own: the peer's swept DFlash rate where one exists (the same optimizer and
    block drafter; ours trains DSpark at our DFlash rate too)."""
    in_process: bool = False
    """Run each command (``spectrain train``/``export``/``eval``) inside the benchmark's process and
    ``hsgen serve`` in a thread of it, rather than one process each: the same code, without a torch
    import (~5 s on 2 cores) per step; for the quick size, whose steps take seconds."""

    @property
    def num_speculative_tokens(self) -> int:
        return self.dflash_block_size - 1


SIZES: dict[str, BenchSize] = {
    "quick": BenchSize(
        target=TargetSpec(64, 4, 2, 1, 32, 192, 512, 60, 16, 64, 1e-2, corpus_share=8),
        num_train_prompts=32,
        prompt_tokens=24,
        continuation_tokens=32,
        num_eval_prompts=4,
        eval_new_tokens=24,
        draft_epochs=2,
        dflash_lr=3e-3,
        eagle3_lr=3e-3,
        draft_seq_len=512,
        dflash_layers=1,
        dflash_max_anchors=64,
        dflash_block_size=8,
        eagle3_ttt_steps=3,
        in_process=True,
    ),
    "small": BenchSize(
        target=TargetSpec(128, 4, 4, 2, 32, 384, 1024, 120, 16, 128, 6e-3),
        num_train_prompts=128,
        prompt_tokens=32,
        continuation_tokens=64,
        num_eval_prompts=8,
        eval_new_tokens=40,
        draft_epochs=2,
        dflash_lr=3e-3,
        eagle3_lr=3e-3,
        draft_seq_len=1024,
        dflash_layers=2,
        dflash_max_anchors=256,
        dflash_block_size=8,
        eagle3_ttt_steps=3,
    ),
    "default": BenchSize(
        target=TargetSpec(192, 6, 6, 2, 32, 512, 2048, 500, 8, 256, 4e-3),
        num_train_prompts=640,
        prompt_tokens=32,
        continuation_tokens=96,
        num_eval_prompts=24,
        eval_new_tokens=64,
        draft_epochs=3,
        dflash_lr=3e-3,
        eagle3_lr=2e-3,
        draft_seq_len=1024,
        dflash_layers=2,
        dflash_max_anchors=256,
        dflash_block_size=8,
        eagle3_ttt_steps=3,
        peer_dflash_lr=3e-3,
        peer_eagle3_lr=5e-3,
        peer_dspark_lr=3e-3,
    ),
    "gpu": BenchSize(
        target=TargetSpec(512, 8, 8, 4, 64, 1536, 4096, 6000, 32, 512, 1.5e-3),
        num_train_prompts=8192,
        prompt_tokens=64,
        continuation_tokens=192,
        num_eval_prompts=64,
        eval_new_tokens=128,
        draft_epochs=6,
        dflash_lr=6e-4,
        eagle3_lr=6e-4,
        draft_seq_len=8192,
        dflash_layers=5,
        dflash_max_anchors=2048,
        dflash_block_size=16,
        eagle3_ttt_steps=7,
    ),
}


SIZES["guard"] = dataclasses.replace(
    SIZES["small"], num_train_prompts=96, num_eval_prompts=6, eval_new_tokens=32, in_process=True
)
"""The CI smoke's recipe guard (``bench_quality.py --guard``): the small size's target (the quick
target's greedy continuations are loops, on which a broken recipe can score above today's), fewer
samples and prompts, every command in the benchmark's process. docs/benchmarks.md, "The recipe guard"."""


SPECULATORS_OPTIMIZER = (
    "--optimizer muon --lr 1e-3 --weight-decay 0.01 --betas 0.9,0.999 --schedule linear --warmup-ratio 0.01"
)
SPECULATORS_RECIPE = {
    "dflash": "--target-mode hard --loss-weighting dpace --loss-norm count --anchor-rule packed "
    "--block-attention causal --sliding-window 2048 " + SPECULATORS_OPTIMIZER,
    "dspark": "--target-mode soft --loss-weighting exp-decay --anchor-rule packed --draft-option slot_mask=input "
    "--draft-option anchor_needs_label=false "
    "--loss-gamma 4 --block-attention causal --sliding-window 2048 " + SPECULATORS_OPTIMIZER,
    "eagle3": "--target-mode soft --loss-norm count --train-region loss --loss-mask-on source --freeze-lm-head --norm-before-fc "
    "--norm-output --ttt-step-loss-decay 1.0 --sliding-window 2048 " + SPECULATORS_OPTIMIZER,
}
"""speculators 0.9.0's defaults as our options (tests/spectrain/models/test_differential_*.py prove them equal):
``--recipe speculators`` trains with these, standing in for its trainer in a side-by-side run."""


# --------------------------------------------------------------------------- layers


def draft_layers(num_hidden_layers: int) -> tuple[list[int], list[int]]:
    """``(dflash aux ids, eagle3 aux ids)``: the project defaults, spread out when they collapse.

    The defaults (DFlash: 5 layers from 1 to L-3; Eagle3: 2, L//2, L-3) assume a deep verifier;
    on a 4-6 layer target they collapse to one or two distinct layers.
    """
    from hsgen.protocol import extraction as protocol

    L = num_hidden_layers
    dflash = protocol.default_dflash_layer_ids(L, 5)[:-1]
    if len(dflash) < 3:
        dflash = sorted({round(1 + i * (L - 2) / 4) for i in range(5)})
    eagle = protocol.default_eagle3_layer_ids(L)[:-1]
    if len(eagle) != 3:
        eagle = [1, L // 2, L - 1]
    return dflash, eagle
