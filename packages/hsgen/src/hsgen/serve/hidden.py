"""Loading a causal LM and reading vLLM-numbered layer outputs from one batched forward.

Layer ids mean what they mean in vLLM: id ``k < L`` is the residual stream entering decoder
layer ``k`` (HF ``output_hidden_states[k]``; id 0 is the embeddings) and id ``L`` is the
output of the last decoder layer *before* the final norm. HF's own last hidden state is
after the norm, so both are read with hooks on the decoder layers.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from hsgen.hf.causal_lm import decoder_layers, load_causal_lm
from hsgen.protocol import extraction as protocol
from hsgen.protocol.dtypes import ALIASES

log = logging.getLogger(__name__)

_DTYPES = {alias: getattr(torch, name) for alias, name in ALIASES.items()}


def resolve_model_path(model: str, tiny_cache_dir: str | None = None, revision: str | None = None) -> Path:
    """``"tiny"`` -> the built-in model directory (built once); a Hugging Face model id -> its
    snapshot in the hub cache (see :mod:`hsgen.hf.hub`); anything else must be a local dir.

    Raises:
        FileNotFoundError: when ``model`` is not a directory with a ``config.json`` nor a
            resolvable model id.
    """
    if model == "tiny":
        from hsgen.hf.tiny import ensure_tiny_model

        return Path(ensure_tiny_model(tiny_cache_dir))
    from hsgen.hf import hub

    if hub.looks_like_hub_id(model):
        try:
            return hub.resolve(model, revision=revision, need="full")
        except hub.HubError as e:
            raise FileNotFoundError(f"--model {model!r}: {e}") from None
    path = Path(os.path.expanduser(model))
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"--model {model!r}: not 'tiny' and not a local Hugging Face model directory "
            f"(no {path / 'config.json'}) nor a Hugging Face model id"
        )
    return path


def num_hidden_layers_of(path: Path) -> int | None:
    """``num_hidden_layers`` from a model directory's ``config.json`` (or its ``text_config``)."""
    try:
        cfg = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return None
    for source in (cfg, cfg.get("text_config") or {}):
        if isinstance(source.get("num_hidden_layers"), int):
            return source["num_hidden_layers"]
    return None


@dataclass
class LoadedModel:
    """A causal LM ready for extraction, with the facts the server reports about it."""

    model: Any
    tokenizer: Any
    path: Path
    dtype: torch.dtype
    device: torch.device
    num_hidden_layers: int
    hidden_size: int
    max_position_embeddings: int
    eos_token_ids: frozenset[int]
    vocab_size: int


def load_model(
    model: str, *, dtype: str = "auto", device: str = "cpu", tiny_cache_dir: str | None = None
) -> LoadedModel:
    """Load tokenizer and model from a local directory (``local_files_only``), in eval mode."""
    from transformers import AutoTokenizer

    path = resolve_model_path(model, tiny_cache_dir)
    if dtype == "auto":
        from hsgen.serve.dtypes import resolve_auto_dtype

        dtype = resolve_auto_dtype(path, device)  # as vLLM: a float32 checkpoint is served in bf16
    torch_dtype: Any = _DTYPES[dtype]
    log.info("loading %s (dtype=%s, device=%s)", path, dtype, device)
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    lm = load_causal_lm(path, torch_dtype)
    lm.to(device).eval()
    cfg = lm.config.get_text_config() if hasattr(lm.config, "get_text_config") else lm.config
    eos: set[int] = set()
    for source in (tokenizer.eos_token_id, getattr(lm.generation_config, "eos_token_id", None)):
        if isinstance(source, int):
            eos.add(source)
        elif isinstance(source, list | tuple):
            eos.update(int(s) for s in source)
    param = next(lm.parameters())
    return LoadedModel(
        model=lm,
        tokenizer=tokenizer,
        path=path,
        dtype=param.dtype,
        device=param.device,
        num_hidden_layers=int(cfg.num_hidden_layers),
        hidden_size=int(cfg.hidden_size),
        max_position_embeddings=int(getattr(cfg, "max_position_embeddings", 0) or 0),
        eos_token_ids=frozenset(eos),
        vocab_size=int(cfg.vocab_size),
    )


@dataclass
class ForwardOutput:
    """One sequence's result of a forward: its hidden states and the greedy next token."""

    hidden_states: torch.Tensor  # [T, n_layers, H], model dtype, on CPU
    next_token: int
    prompt_logprobs: PromptLogprobs | None = None


@dataclass
class PromptLogprobs:
    """The distributions that predicted prompt tokens ``1..T-1`` (vLLM's ``prompt_logprobs``).

    Row ``i`` is the distribution after tokens ``0..i``, the one that predicted token ``i + 1``.
    """

    top_ids: torch.Tensor  # [T-1, k] int64, best first
    top_logprobs: torch.Tensor  # [T-1, k] float32
    token_logprobs: torch.Tensor  # [T-1] float32, of the prompt token itself
    token_ranks: torch.Tensor  # [T-1] int64, tokens at least as likely, itself included (vLLM's rank)


LOGPROB_ROWS = 1024
"""Positions whose full-vocabulary log-softmax is formed at once (bounds the memory of prompt_logprobs)."""


def prompt_logprobs_of(
    head: torch.nn.Module, last: torch.Tensor, ids: Sequence[int], k: int
) -> PromptLogprobs:
    """vLLM's prompt logprobs of one sequence from its final (normed) states ``last [T, H]``."""
    n = len(ids) - 1
    nxt = torch.tensor(list(ids[1:]), dtype=torch.long, device=last.device)
    parts: list[tuple[torch.Tensor, ...]] = []
    for lo in range(0, n, LOGPROB_ROWS):
        hi = min(n, lo + LOGPROB_ROWS)
        lp = torch.log_softmax(head(last[lo:hi]).float(), dim=-1)
        top = lp.topk(lp.shape[-1] if k == -1 else min(k, lp.shape[-1]), dim=-1)
        tok = lp.gather(1, nxt[lo:hi, None])
        rank = (lp >= tok).sum(-1)
        parts.append((top.indices, top.values, tok[:, 0], rank))
    if not parts:
        empty = torch.empty(0, k)
        return PromptLogprobs(empty.long(), empty, torch.empty(0), torch.empty(0, dtype=torch.long))
    cols = [torch.cat(c).cpu() for c in zip(*parts, strict=True)]
    return PromptLogprobs(*cols)


class HiddenStateExtractor:
    """Runs batched forwards of a causal LM and returns the requested layers per sequence.

    Sequences are right-padded into one batch; with causal attention the real tokens never
    see the padding, so each sequence's values are those of its own unbatched forward.
    Not thread-safe: call from one thread.
    """

    def __init__(self, loaded: LoadedModel, layer_ids: Sequence[int]):
        self.loaded = loaded
        self.layer_ids = protocol.normalize_layer_ids(layer_ids, loaded.num_hidden_layers)
        self._layers = decoder_layers(loaded.model)
        if len(self._layers) != loaded.num_hidden_layers:
            raise TypeError(
                f"model has {len(self._layers)} decoder layers, config says {loaded.num_hidden_layers}"
            )
        self._captured: dict[int, torch.Tensor] = {}
        self._active_thread: int | None = None  # hooks record only our own forwards
        self._handles = []
        L = loaded.num_hidden_layers
        for k in self.layer_ids:
            if k < L:
                self._handles.append(
                    self._layers[k].register_forward_pre_hook(self._pre_hook(k), with_kwargs=True)
                )
            else:
                self._handles.append(self._layers[L - 1].register_forward_hook(self._post_hook(k)))

    def _pre_hook(self, k: int):
        def hook(module, args, kwargs):
            if self._active_thread == threading.get_ident():
                self._captured[k] = args[0] if args else kwargs["hidden_states"]

        return hook

    def _post_hook(self, k: int):
        def hook(module, args, output):
            if self._active_thread == threading.get_ident():
                self._captured[k] = output[0] if isinstance(output, tuple | list) else output

        return hook

    def close(self) -> None:
        """Remove the hooks from the model."""
        for h in self._handles:
            h.remove()
        self._handles.clear()

    @torch.inference_mode()
    def forward(
        self, sequences: Sequence[Sequence[int]], prompt_logprobs: Sequence[int | None] | None = None
    ) -> list[ForwardOutput]:
        """One forward over ``sequences`` (each non-empty); results in the same order.

        ``prompt_logprobs[i]`` (k) also returns sequence ``i``'s top-k at every position.
        """
        if not sequences or any(len(s) == 0 for s in sequences):
            raise ValueError("forward needs non-empty sequences")
        lm = self.loaded.model
        lengths = [len(s) for s in sequences]
        T = max(lengths)
        device = self.loaded.device
        ids = torch.zeros((len(sequences), T), dtype=torch.long)
        for i, s in enumerate(sequences):
            ids[i, : len(s)] = torch.tensor(list(s), dtype=torch.long)
        ids = ids.to(device)
        mask = None
        if min(lengths) != T:
            mask = (torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]).long().to(device)
        self._captured.clear()
        decoder = lm.get_decoder() if hasattr(lm, "get_decoder") else lm.model
        self._active_thread = threading.get_ident()
        try:
            out = decoder(input_ids=ids, attention_mask=mask, use_cache=False)
        finally:
            self._active_thread = None
        last = out.last_hidden_state
        rows = torch.arange(len(sequences), device=device)
        idx = torch.tensor(lengths, device=device) - 1
        logits = lm.get_output_embeddings()(last[rows, idx])
        next_tokens = logits.float().argmax(dim=-1).tolist()
        missing = [k for k in self.layer_ids if k not in self._captured]
        if missing:
            raise RuntimeError(f"layer hooks did not fire for layer ids {missing}")
        stacked = torch.stack([self._captured[k] for k in self.layer_ids], dim=2)  # [B, T, n, H]
        self._captured.clear()
        results = []
        head = lm.get_output_embeddings()
        for i, n in enumerate(lengths):
            k = prompt_logprobs[i] if prompt_logprobs is not None else None
            plp = prompt_logprobs_of(head, last[i, :n], sequences[i], k) if k is not None else None
            results.append(
                ForwardOutput(stacked[i, :n].to("cpu", copy=True).contiguous(), int(next_tokens[i]), plp)
            )
        return results
