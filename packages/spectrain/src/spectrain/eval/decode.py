"""Speculative decoding with greedy verification: the measured acceptance length of a draft.

The verifier is a Hugging Face causal LM run with transformers (any device, float64 on CPU by
default so that batched verification and token-by-token greedy decoding agree bit for bit in
practice). One *step* is one verifier forward: the draft proposes up to ``K`` tokens after the
verifier's last (bonus) token, the verifier scores the bonus token and all proposals at once,
the longest prefix of proposals equal to the verifier's own argmax is accepted, and the
verifier's argmax after that prefix becomes the next bonus token. The acceptance length of a
step is ``accepted proposals + 1`` (the bonus token), so ``tau >= 1`` always; this is the
definition of the DFlash and EAGLE papers. The first token, from the prefill, is not a step.

Every speculative output is compared with the verifier's own greedy decoding of the same
prompt: greedy verification must not change the text, and :func:`evaluate` reports (and the
CLI fails on) any difference.
"""

from __future__ import annotations

import inspect
import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

import torch

from spectrain.export.read import DraftLoadError as DraftLoadError
from spectrain.export.read import draft_config_from_export as draft_config_from_export

log = logging.getLogger(__name__)

COUNTINGS = ("spectrain", "vllm")
"""How :func:`speculative_generate` counts a step (see there)."""

DTYPES = {
    "float64": torch.float64,
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}


@runtime_checkable
class Proposer(Protocol):
    """What the decoding loop needs from a draft.

    Attributes:
        layer_ids: verifier layer ids (vLLM numbering: ``k < L`` enters decoder layer ``k``,
            ``L`` is the last layer's output before the final norm) whose hidden states the
            draft reads, in the order it expects them.
        num_speculative_tokens: tokens the draft proposes per step by default (``K``).
        max_speculative_tokens: most it can propose per step (None: no limit, e.g. an
            autoregressive chain). Optional attribute; defaults to ``num_speculative_tokens``.
    """

    layer_ids: tuple[int, ...]
    num_speculative_tokens: int

    def propose(self, token_ids: Sequence[int], hidden_states: torch.Tensor, num_tokens: int) -> list[int]:
        """Propose the ``num_tokens`` tokens that follow ``token_ids``.

        Args:
            token_ids: the accepted sequence (prompt and generated tokens); its last token is
                the verifier's bonus token, whose hidden states do not exist yet.
            hidden_states: ``[len(token_ids) - 1, len(layer_ids), H]`` verifier hidden states
                of every token but the last, at ``layer_ids``.
            num_tokens: how many tokens to return (``<= max_speculative_tokens``).
        """
        ...


# --------------------------------------------------------------------------- the verifier


class Verifier:
    """A causal LM with a KV cache that returns greedy next tokens and selected hidden states.

    Not thread-safe. ``reset`` before each new prompt.
    """

    def __init__(self, model: Any, layer_ids: Sequence[int], eos_token_ids: Iterable[int] = ()):
        from hsgen.hf.causal_lm import decoder_layers

        self.model = model
        self.layer_ids = tuple(int(i) for i in layer_ids)
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        cfg = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
        self.num_hidden_layers = int(cfg.num_hidden_layers)
        self.vocab_size = int(cfg.vocab_size)
        layers = decoder_layers(model)
        bad = [k for k in self.layer_ids if not 0 <= k <= self.num_hidden_layers]
        if bad:
            raise ValueError(f"layer ids {bad} are outside 0..{self.num_hidden_layers} for this verifier")
        self._captured: dict[int, torch.Tensor] = {}
        self._handles = []
        for k in sorted(set(self.layer_ids)):
            if k < self.num_hidden_layers:
                self._handles.append(layers[k].register_forward_pre_hook(self._pre_hook(k), with_kwargs=True))
            else:
                self._handles.append(layers[k - 1].register_forward_hook(self._post_hook(k)))
        self._cache = None
        self._tokens: list[int] = []  # what the cache holds
        self.forwards = 0
        params = inspect.signature(model.forward).parameters
        self._cache_kwarg = "cache" if "cache" in params else "past_key_values"

    def _pre_hook(self, k: int):
        def hook(module, args, kwargs):
            self._captured[k] = args[0] if args else kwargs["hidden_states"]

        return hook

    def _post_hook(self, k: int):
        def hook(module, args, output):
            self._captured[k] = output[0] if isinstance(output, tuple | list) else output

        return hook

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    def close(self) -> None:
        """Remove the hooks from the model."""
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def reset(self) -> None:
        """Forget the cached context (start of a new prompt)."""
        self._cache = None
        self._tokens = []

    @property
    def cached_tokens(self) -> int:
        return len(self._tokens)

    @torch.inference_mode()
    def extend(self, token_ids: Sequence[int]) -> tuple[list[int], torch.Tensor]:
        """Append ``token_ids`` to the cached context in one forward.

        Returns:
            The argmax next token after each appended token, and the hidden states of the
            appended tokens ``[len(token_ids), len(layer_ids), H]`` (float32, on CPU).
        """
        from transformers import DynamicCache

        if not token_ids:
            raise ValueError("extend needs at least one token")
        if self._cache is None:
            self._cache = DynamicCache(config=self.model.config)
        ids = torch.tensor([list(token_ids)], dtype=torch.long, device=self.device)
        self._captured.clear()
        out = self.model(input_ids=ids, **{self._cache_kwarg: self._cache}, use_cache=True)
        self._tokens.extend(int(t) for t in token_ids)
        self.forwards += 1
        preds = out.logits[0].argmax(dim=-1).tolist()
        if self.layer_ids:
            hidden = torch.stack([self._captured[k][0] for k in self.layer_ids], dim=1).float().cpu()
        else:
            hidden = torch.zeros((len(token_ids), 0, 0))
        self._captured.clear()
        return [int(p) for p in preds], hidden

    def truncate(self, length: int) -> None:
        """Keep only the first ``length`` cached tokens.

        A cache that cannot be cut back (a sliding-window layer past its window, a linear-attention
        layer's recurrent state: Gemma, gpt-oss, Mistral, Qwen3-Next / Qwen3.5) is rebuilt from the
        kept tokens in one forward, so the context stays exactly the verifier's own."""
        extra = self.cached_tokens - length
        if extra < 0:
            raise ValueError(f"cannot truncate a {self.cached_tokens}-token cache to {length}")
        if not extra:
            return
        if self._croppable():
            self._cache.crop(-extra)
            del self._tokens[length:]
            return
        kept = self._tokens[:length]
        self.reset()
        if kept:
            self.extend(kept)
            self.forwards -= 1  # a rebuild, not a verification step

    def _croppable(self) -> bool:
        layers = getattr(self._cache, "layers", None)
        if layers is None:
            return True
        return all(type(layer).__name__ == "DynamicLayer" for layer in layers)

    def greedy(self, prompt_ids: Sequence[int], max_new_tokens: int) -> list[int]:
        """The verifier's own greedy continuation (stops after an EOS token)."""
        self.reset()
        preds, _ = self.extend(prompt_ids)
        out = [preds[-1]]
        while len(out) < max_new_tokens and out[-1] not in self.eos_token_ids:
            preds, _ = self.extend([out[-1]])
            out.append(preds[-1])
        return out


# --------------------------------------------------------------------------- one prompt


@dataclass
class SpeculativeOutput:
    """One prompt's speculative decoding.

    Attributes:
        tokens: generated tokens (the prefill's token first).
        accepted: per step, draft tokens accepted (the step emitted ``accepted + 1`` tokens).
            When an accepted proposal is an EOS token, the output ends there: the step emitted
            ``accepted`` tokens and counts only the proposals up to the EOS as proposed.
        proposed: per step, draft tokens proposed (and seen, see above).
        emitted: per step, tokens added to the output (``counting="vllm"``: ``accepted + 1``,
            what vLLM counts, even where the output was cut).
    """

    tokens: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    proposed: list[int] = field(default_factory=list)
    emitted: list[int] = field(default_factory=list)


def speculative_generate(
    verifier: Verifier,
    proposer: Proposer,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    num_speculative_tokens: int,
    counting: str = "spectrain",
) -> SpeculativeOutput:
    """Generate up to ``max_new_tokens`` tokens with draft proposals and greedy verification.

    ``counting``: ``"spectrain"`` proposes no more than the output has room for and counts only
    proposals up to an EOS; ``"vllm"`` counts as vLLM's spec-decode counters do (always ``K``
    proposals, every accepted one counted even past ``max_new_tokens`` or an EOS, the output cut
    afterwards), so that :mod:`spectrain.eval.served` compares like with like.
    """
    if counting not in COUNTINGS:
        raise ValueError(f"counting {counting!r}: choose one of {COUNTINGS}")
    as_vllm = counting == "vllm"
    if max_new_tokens < 1:
        raise ValueError("max_new_tokens must be >= 1")
    if not prompt_ids:
        raise ValueError("the prompt is empty")
    eos = verifier.eos_token_ids
    verifier.reset()
    preds, hidden = verifier.extend(prompt_ids)
    context_hidden = hidden
    out = SpeculativeOutput(tokens=[preds[-1]])
    sequence = [*prompt_ids, preds[-1]]
    while len(out.tokens) < max_new_tokens and out.tokens[-1] not in eos:
        budget = (
            num_speculative_tokens
            if as_vllm
            else min(num_speculative_tokens, max_new_tokens - len(out.tokens) - 1)
        )
        proposals: list[int] = []
        if budget > 0:
            proposals = [int(t) for t in proposer.propose(sequence, context_hidden, budget)]
            if len(proposals) != budget:
                raise RuntimeError(f"the draft proposed {len(proposals)} tokens, {budget} were asked for")
            bad = [t for t in proposals if not 0 <= t < verifier.vocab_size]
            if bad:
                raise RuntimeError(f"the draft proposed token ids {bad} outside the vocabulary")
        preds, hidden = verifier.extend([sequence[-1], *proposals])
        accepted = 0
        while accepted < len(proposals) and proposals[accepted] == preds[accepted]:
            accepted += 1
        new = [*proposals[:accepted], preds[accepted]]
        verifier.truncate(len(sequence) + accepted)
        context_hidden = torch.cat([context_hidden, hidden[: accepted + 1]], dim=0)
        proposed, counted = len(proposals), len(new)
        for i, t in enumerate(new):
            if t in eos:  # the output ends here: later tokens of the step are never seen
                new = new[: i + 1]
                if not as_vllm:
                    accepted = min(accepted, len(new))
                    proposed = min(proposed, len(new))
                break
        if as_vllm:
            new = new[: max_new_tokens - len(out.tokens)]
        out.tokens.extend(new)
        sequence.extend(new)
        out.accepted.append(accepted)
        out.proposed.append(proposed)
        out.emitted.append(counted if as_vllm else len(new))
    return out


# --------------------------------------------------------------------------- many prompts


@dataclass(frozen=True)
class EvalPrompt:
    """A tokenized prompt. ``source`` names where it came from (``file:line``) for errors."""

    prompt_id: str
    token_ids: tuple[int, ...]
    source: str = ""


@dataclass
class EvalReport:
    """Aggregate figures of an evaluation (``to_dict`` is the CLI's ``--json`` object).

    Attributes:
        tau: mean acceptance length: tokens emitted per verification step, bonus included.
        acceptance_rate: per draft position ``i`` (1-based, list index ``i - 1``), the fraction
            of steps that proposed at least ``i`` tokens in which the first ``i`` were accepted.
        conditional_acceptance: per position, P(token ``i`` accepted | tokens ``< i`` accepted).
        accepted_histogram: index ``a`` counts the steps that accepted exactly ``a`` proposals.
        exact_match: every speculative output equalled the verifier's greedy output.
    """

    num_prompts: int = 0
    steps: int = 0
    new_tokens: int = 0
    tau: float = 0.0
    num_speculative_tokens: int = 0
    acceptance_rate: list[float] = field(default_factory=list)
    conditional_acceptance: list[float] = field(default_factory=list)
    accepted_histogram: list[int] = field(default_factory=list)
    exact_match: bool = True
    mismatches: list[dict[str, Any]] = field(default_factory=list)
    speculative_seconds: float = 0.0
    greedy_seconds: float = 0.0
    greedy_forwards: int = 0
    per_prompt: list[dict[str, Any]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def max_tokens(proposer: Proposer) -> int | None:
    """Most tokens ``proposer`` can draft per step (None: unlimited)."""
    return getattr(proposer, "max_speculative_tokens", proposer.num_speculative_tokens)


def summarize(outputs: Sequence[SpeculativeOutput], num_speculative_tokens: int) -> EvalReport:
    """Fold per-prompt step records into tau, per-position acceptance and the histogram."""
    K = num_speculative_tokens
    steps = sum(len(o.accepted) for o in outputs)
    emitted = sum(sum(o.emitted) for o in outputs)
    hist = [0] * (K + 1)
    offered = [0] * (K + 1)  # offered[i]: steps that proposed at least i tokens
    reached = [0] * (K + 1)  # reached[i]: ... and accepted the first i
    eligible = [0] * (K + 1)  # eligible[i]: ... and accepted the first i - 1
    for o in outputs:
        for a, p in zip(o.accepted, o.proposed, strict=True):
            hist[a] += 1
            for i in range(1, p + 1):
                offered[i] += 1
                eligible[i] += a >= i - 1
                reached[i] += a >= i
    rate = [reached[i] / offered[i] if offered[i] else 0.0 for i in range(1, K + 1)]
    cond = [reached[i] / eligible[i] if eligible[i] else 0.0 for i in range(1, K + 1)]
    return EvalReport(
        num_prompts=len(outputs),
        steps=steps,
        new_tokens=emitted,
        tau=emitted / steps if steps else 0.0,
        num_speculative_tokens=K,
        acceptance_rate=rate,
        conditional_acceptance=cond,
        accepted_histogram=hist,
    )


def evaluate(
    verifier: Verifier,
    proposer: Proposer,
    prompts: Sequence[EvalPrompt],
    *,
    max_new_tokens: int = 64,
    num_speculative_tokens: int | None = None,
    check_greedy: bool = True,
    progress: bool = False,
    counting: str = "spectrain",
    keep_tokens: bool = False,
) -> EvalReport:
    """Run speculative decoding on every prompt and compare each output with greedy decoding.

    Args:
        num_speculative_tokens: ``K``; defaults to ``proposer.num_speculative_tokens``.
        check_greedy: also decode greedily without the draft and compare (``exact_match``).
        counting: ``"spectrain"`` or ``"vllm"`` (see :func:`speculative_generate`).
        keep_tokens: put each output's token ids in ``per_prompt[i]["tokens"]``.
    """
    K = int(num_speculative_tokens or proposer.num_speculative_tokens)
    if K < 1:
        raise ValueError("num_speculative_tokens must be >= 1")
    limit = max_tokens(proposer)
    if limit is not None and limit < K:
        raise ValueError(f"num_speculative_tokens {K} exceeds the draft's limit of {limit}")
    from hsgen.progress import progress_bar

    if hasattr(proposer, "step_tokens"):
        proposer.step_tokens = K
    outputs: list[SpeculativeOutput] = []
    per_prompt: list[dict[str, Any]] = []
    mismatches: list[dict[str, Any]] = []
    spec_s = greedy_s = 0.0
    greedy_forwards = 0
    for p in progress_bar(prompts, desc="eval", unit="prompt", disable=not progress):
        t0 = time.perf_counter()
        o = speculative_generate(verifier, proposer, p.token_ids, max_new_tokens, K, counting)
        spec_s += time.perf_counter() - t0
        outputs.append(o)
        row: dict[str, Any] = {
            "id": p.prompt_id,
            "new_tokens": sum(o.emitted),
            "steps": len(o.accepted),
            "tau": sum(o.emitted) / len(o.accepted) if o.accepted else None,
        }
        if keep_tokens:
            row["tokens"] = list(o.tokens)
        if check_greedy:
            t0 = time.perf_counter()
            before = verifier.forwards
            ref = verifier.greedy(p.token_ids, max_new_tokens)
            greedy_forwards += verifier.forwards - before
            greedy_s += time.perf_counter() - t0
            row["exact"] = ref == o.tokens
            if ref != o.tokens:
                at = next(
                    (i for i, (a, b) in enumerate(zip(ref, o.tokens, strict=False)) if a != b),
                    min(len(ref), len(o.tokens)),
                )
                mismatches.append(
                    {
                        "id": p.prompt_id,
                        "source": p.source,
                        "first_difference": at,
                        "greedy_len": len(ref),
                        "spec_len": len(o.tokens),
                    }
                )
                log.error("prompt %s: speculative output differs from greedy at token %d", p.prompt_id, at)
        per_prompt.append(row)
    report = summarize(outputs, K)
    report.exact_match = check_greedy and not mismatches
    report.mismatches = mismatches
    report.speculative_seconds = spec_s
    report.greedy_seconds = greedy_s
    report.greedy_forwards = greedy_forwards
    report.per_prompt = per_prompt
    return report


# --------------------------------------------------------------------------- prompts


def load_prompts(
    path: str | Path | Any,
    tokenizer: Any,
    *,
    num_prompts: int | None = None,
    chat_template: str | None = None,
    template_kwargs: dict[str, Any] | None = None,
) -> list[EvalPrompt]:
    """Read evaluation prompts (any format ``hsgen.inputs.formats`` reads) and tokenize them.

    - ``messages``: trailing assistant turns are dropped and the chat template is applied
      with the generation prompt (the model answers the last user turn); ``chat_template`` (a
      file) and ``template_kwargs`` render as ``hsgen generate --chat-template/--template-kwargs``.
    - ``input_ids`` (+ optional ``loss_mask``): the tokens before the first ``loss_mask == 1``
      (all of them without a mask), so a training-format file with held-out rows works.
    - ``prompt``/``text``: the raw text, tokenized without a template.
    """
    from hsgen.inputs.formats import InputError, read_inputs

    template = Path(chat_template).read_text() if chat_template else None
    prompts: list[EvalPrompt] = []
    for sample in read_inputs([path]):
        if num_prompts is not None and len(prompts) >= num_prompts:
            break
        if sample.kind == "messages":
            messages = [dict(m) for m in sample.messages or ()]
            while messages and messages[-1].get("role") == "assistant":
                messages.pop()
            if not messages:
                raise InputError(sample.source, "conversation has no turn before the assistant's answer")
            enc = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True,
                                                chat_template=template, **(template_kwargs or {}))  # fmt: skip
            ids = enc["input_ids"] if hasattr(enc, "keys") else enc
        elif sample.kind == "tokens":
            ids = list(sample.input_ids or ())
            if sample.loss_mask is not None and 1 in sample.loss_mask:
                ids = ids[: list(sample.loss_mask).index(1)]
        else:
            ids = tokenizer.encode(sample.prompt or "", add_special_tokens=False)
        ids = [int(t) for t in ids]
        if not ids:
            raise InputError(sample.source, "the prompt is empty after tokenization")
        prompts.append(EvalPrompt(sample.sample_id, tuple(ids), sample.source))
    if not prompts:
        raise InputError(str(path), "no prompts")
    return prompts


# --------------------------------------------------------------------------- loading


def load_verifier(path: str | Path, layer_ids: Sequence[int], *, dtype: str = "float64", device: str = "cpu"):
    """Load a local HF causal LM as a :class:`Verifier`; returns ``(verifier, tokenizer)``."""
    from transformers import AutoTokenizer

    from hsgen.hf.causal_lm import load_causal_lm

    path = Path(path)
    if not (path / "config.json").is_file():
        raise FileNotFoundError(
            f"--verifier {path}: not a local Hugging Face model directory (no config.json)"
        )
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r}: choose one of {sorted(DTYPES)}")
    tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True)
    model = load_causal_lm(path, DTYPES[dtype])
    model.to(device).eval()
    eos: set[int] = set()
    for source in (tokenizer.eos_token_id, getattr(model.generation_config, "eos_token_id", None)):
        if isinstance(source, int):
            eos.add(source)
        elif isinstance(source, list | tuple):
            eos.update(int(s) for s in source)
    return Verifier(model, layer_ids, eos), tokenizer


# --------------------------------------------------------------------------- exported drafts


class DraftProposer:
    """Adapts a spectrain :class:`~spectrain.models.DraftModel` to :class:`Proposer`."""

    def __init__(self, model: Any, num_speculative_tokens: int, source: str = ""):
        self.model = model
        self.layer_ids = tuple(int(i) for i in model.cfg.aux_layer_ids)
        self.num_speculative_tokens = int(num_speculative_tokens)
        self.algorithm = model.cfg.algorithm
        # a block drafter proposes at most its block's predicting slots; a chain can run on (vLLM's
        # num_speculative_tokens overrides the config's speculative_tokens for Eagle3)
        self.max_speculative_tokens: int | None = getattr(model, "max_proposals", None)
        self.step_tokens: int | None = None
        """The step's K (set by :func:`evaluate`): a DSpark block is sized for it, as vLLM sizes it
        for ``num_speculative_tokens``, even where fewer proposals are looked at."""
        self._sized_blocks = "step_tokens" in inspect.signature(model.propose).parameters
        self.source = source

    def propose(self, token_ids: Sequence[int], hidden_states: torch.Tensor, num_tokens: int) -> list[int]:
        from spectrain.models import DraftContext

        context = DraftContext(hidden_states, list(token_ids))
        if self._sized_blocks:
            return self.model.propose(context, num_tokens, step_tokens=self.step_tokens)
        return self.model.propose(context, num_tokens)


def load_exported_draft(
    draft_dir: str | Path,
    verifier_path: str | Path,
    *,
    device: str = "cpu",
    block_attention: str | None = None,
) -> DraftProposer:
    """Load an exported draft directory (``spectrain export``'s, or speculators' ``save_pretrained``)
    for proposing.

    The weights are computed in float32. The verifier's embeddings and LM head (shared with the
    draft) come from ``verifier_path``. ``block_attention`` overrides a DFlash draft's
    ``sliding_window_non_causal`` (None: as vLLM serves the config); see
    :func:`spectrain.export.read.draft_config_from_export`.
    """
    from spectrain.export.read import build_exported_draft
    from spectrain.models.verifier import VerifierHeads

    heads = VerifierHeads.load(verifier_path, dtype=torch.float32)
    model, k = build_exported_draft(draft_dir, heads, block_attention=block_attention)
    model.to(device).eval()
    heads.to(device)
    cfg = model.cfg
    log.info("draft: %s (%s, K=%d, layers %s) from %s", cfg.algorithm, type(model).__name__, k, cfg.aux_layer_ids,
             draft_dir)  # fmt: skip
    return DraftProposer(model, k, str(draft_dir))
