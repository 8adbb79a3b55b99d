"""The built-in tiny verifier: a small Qwen3-style causal LM with a BPE tokenizer and a ChatML
chat template, built deterministically and offline.

``hsgen serve --model tiny``, the demo and the tests use it. The model is saved to a cache
directory once and then loaded like any local Hugging Face model, so every code path that
handles a real model handles this one. Building needs the ``serve`` extra (torch,
transformers, tokenizers); nothing here is imported by the client.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import math
import os
import shutil
import tempfile
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

BUILD_VERSION = 1
"""Bump when the build changes in a way that must invalidate cached models."""

CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
"""Qwen-style ChatML without tools or thinking blocks."""

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


@dataclass(frozen=True)
class TinyModelSpec:
    """Shape and seed of a built-in model. Two equal specs build identical models."""

    hidden_size: int = 64
    """Width of the residual stream."""
    num_hidden_layers: int = 4
    """Decoder layers (vLLM layer ids run 0..num_hidden_layers)."""
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 16
    intermediate_size: int = 128
    tokenizer_vocab_size: int = 1024
    """Target size of the trained BPE vocabulary (special tokens included)."""
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    seed: int = 0
    corpus: str = "sample_chats"
    """Text the tokenizer (and the pretraining) uses: ``sample_chats`` (the shipped dataset)."""
    pretrain_steps: int = 0
    """AdamW steps of next-token training on the corpus after the random init (0 = random weights).
    A briefly trained verifier has peaked, learnable next-token distributions, so drafts trained
    on it reach an acceptance length above 1; a random one is near-uniform."""
    pretrain_seq_len: int = 256
    pretrain_batch: int = 16
    pretrain_lr: float = 3e-3

    def fingerprint(self) -> str:
        """Short stable hash naming the cache directory."""
        payload = json.dumps({"v": BUILD_VERSION, **asdict(self)}, sort_keys=True)
        return hashlib.sha256(payload.encode()).hexdigest()[:12]


DEFAULT_SPEC = TinyModelSpec(pretrain_steps=150, pretrain_seq_len=128, pretrain_batch=8)
"""The model ``--model tiny`` serves: the default shape, briefly pretrained on the sample chats."""

VLLM_SPEC = TinyModelSpec(head_dim=32, pretrain_steps=150, pretrain_seq_len=128, pretrain_batch=8)
"""The tiny model the real-vLLM tier serves: :data:`DEFAULT_SPEC` with ``head_dim`` 32 (vLLM's CPU
attention kernel refuses 16: ``Unsupported CPU attention configuration: head_dim=16``)."""


def default_cache_dir() -> Path:
    """``$HSGEN_CACHE`` or ``~/.cache/hsgen``."""
    return Path(os.environ.get("HSGEN_CACHE", Path.home() / ".cache" / "hsgen"))


def _sample_chat_texts() -> Iterable[str]:
    from hsgen.inputs.sample_data import iter_sample_chats

    for row in iter_sample_chats():
        for message in row["messages"]:
            yield f"<|im_start|>{message['role']}\n{message['content']}<|im_end|>\n"


def build_tokenizer(
    texts: Iterable[str],
    vocab_size: int,
    *,
    special_tokens: Iterable[str] = SPECIAL_TOKENS,
    chat_template: str = CHATML_TEMPLATE,
    **token_names: str,
):
    """Train a byte-level BPE tokenizer (GPT-2/Qwen style) with ChatML special tokens.

    Returns a ``transformers.PreTrainedTokenizerFast`` with the ChatML chat template set.
    ``special_tokens``, ``chat_template`` and ``token_names`` (``eos_token``, ``bos_token``,
    ``pad_token``) give another family's (the chat-template tests build one per family).
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    names = token_names or {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, clean_up_tokenization_spaces=False, **names)
    fast.chat_template = chat_template
    return fast


def _padded_vocab(n_tokens: int, multiple: int = 64) -> int:
    """Round up like Qwen's padded embedding tables, keeping at least one unused id (DFlash's mask)."""
    return ((n_tokens + 1 + multiple - 1) // multiple) * multiple


def build_model_dir(out_dir: Path, spec: TinyModelSpec, texts: Iterable[str] | None = None) -> Path:
    """Build the model described by ``spec`` into ``out_dir`` (which must not exist yet)."""
    import torch
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    if texts is None:
        if spec.corpus != "sample_chats":
            raise ValueError(f"unknown corpus {spec.corpus!r}: pass the texts explicitly")
        texts = list(_sample_chat_texts())
    else:
        texts = list(texts)
    tokenizer = build_tokenizer(texts, spec.tokenizer_vocab_size)
    config = Qwen3Config(
        vocab_size=_padded_vocab(len(tokenizer)),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_hidden_layers,
        num_attention_heads=spec.num_attention_heads,
        num_key_value_heads=spec.num_key_value_heads,
        head_dim=spec.head_dim,
        max_position_embeddings=spec.max_position_embeddings,
        tie_word_embeddings=spec.tie_word_embeddings,
        bos_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tokenizer.convert_tokens_to_ids("<|endoftext|>"),
        torch_dtype="float32",
    )
    generator_state = torch.random.get_rng_state()
    try:
        torch.manual_seed(spec.seed)
        model = Qwen3ForCausalLM(config)
        if spec.pretrain_steps > 0:
            _pretrain(model, tokenizer, texts, spec)
    finally:
        torch.random.set_rng_state(generator_state)
    model.eval()
    out_dir.mkdir(parents=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id, do_sample=False
    ).save_pretrained(out_dir)
    (out_dir / "hsgen_tiny_spec.json").write_text(json.dumps(asdict(spec), indent=2) + "\n")
    return out_dir


def _pretrain(model, tokenizer, texts: list[str], spec: TinyModelSpec) -> None:
    """A short next-token training run on ``texts`` (random windows of the joined token stream)."""
    import torch

    stream = torch.tensor([t for text in texts for t in tokenizer(text)["input_ids"]], dtype=torch.long)
    n_windows = len(stream) - spec.pretrain_seq_len - 1
    if n_windows <= 0:
        raise ValueError(f"corpus of {len(stream)} tokens is shorter than pretrain_seq_len")
    generator = torch.Generator().manual_seed(spec.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec.pretrain_lr, weight_decay=0.0)
    model.train()
    for step in range(spec.pretrain_steps):
        lr_scale = min(1.0, (step + 1) / 20) * 0.5 * (1 + math.cos(math.pi * step / spec.pretrain_steps))
        for group in optimizer.param_groups:
            group["lr"] = spec.pretrain_lr * lr_scale
        starts = torch.randint(0, n_windows, (spec.pretrain_batch,), generator=generator)
        batch = torch.stack([stream[s : s + spec.pretrain_seq_len + 1] for s in starts.tolist()])
        loss = model(input_ids=batch[:, :-1], labels=batch[:, :-1].clone()).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()


def ensure_tiny_model(
    cache_dir: str | os.PathLike[str] | None = None, spec: TinyModelSpec | None = None
) -> Path:
    """Return a local model directory for ``spec``, building it on first use.

    Safe under concurrency: one process builds (under an ``flock`` on a lock file beside the
    cache entry) in a temporary directory renamed into place; the others wait and reuse it.
    """
    spec = spec or DEFAULT_SPEC
    root = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = root / f"tiny-qwen3-{spec.fingerprint()}"
    if (target / "config.json").exists():
        return target
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (target / "config.json").exists():
            return target
        staging = Path(tempfile.mkdtemp(prefix=".building-", dir=root))
        try:
            build_model_dir(staging / "model", spec)
            os.rename(staging / "model", target)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    return target
