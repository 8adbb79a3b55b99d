"""speculators' ``train`` vocabulary on ``spectrain train``.

Every flag of speculators 0.9.0's ``speculators train`` (its argparse parser, generated from
``speculators.train.config.schema``) is an entry of :data:`FLAGS`: either it is translated into
spectrain's own flags before click parses the command line, with the same meaning, or it is
refused with one line that names spectrain's equivalent or says why there is none. A
speculators-shaped ``--config`` YAML (a ``train:`` block, or its groups ``trainer:``,
``optimizer:``, ...) is read the same way, its values first and the command line's flags over
them. ``docs/train.md`` holds :func:`markdown_table`; a test walks speculators' own parser.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import click

from hsgen.cli.toolkit import SectionedCommand

log = logging.getLogger(__name__)


@dataclass
class Translation:
    """What a command line became: spectrain tokens plus what several flags contribute together."""

    tokens: list[str] = field(default_factory=list)
    client_options: dict[str, Any] = field(default_factory=dict)
    offline: bool = False
    notes: list[str] = field(default_factory=list)
    given: list[str] = field(default_factory=list)
    """speculators-only spellings the command line used (for the defaults note)."""
    context: dict[str, str] = field(default_factory=dict)
    """Values of spectrain flags given anywhere on the line (``--speculator-type``, ``--num-workers``)."""

    @property
    def algorithm(self) -> str:
        return self.context.get("--speculator-type", "dflash")


Apply = Callable[[Translation, list[str]], None]


@dataclass(frozen=True)
class Flag:
    """One speculators flag: its default there, what it is here, and how it is translated."""

    theirs: str
    """speculators' default, as its schema resolves it."""
    ours: str
    """spectrain's equivalent and its default (or why there is none)."""
    apply: Apply | None = None
    """Adds spectrain tokens for the flag's values; None: the flag is refused with ``ours``."""
    nargs: int | str = 1
    """0: a switch; 1: one value; '+': values up to the next option (argparse ``nargs='+'``)."""

    @property
    def accepted(self) -> bool:
        return self.apply is not None


def _emit(*tokens: str) -> Apply:
    def apply(t: Translation, values: list[str]) -> None:
        t.tokens.extend(tokens)

    return apply


def _to(flag: str, mapping: dict[str, str] | None = None, *, join: bool = False) -> Apply:
    """The value(s) passed on to ``flag`` (through ``mapping`` when given; refused outside it)."""

    def apply(t: Translation, values: list[str]) -> None:
        value = " ".join(values) if join else values[0]
        if mapping is not None:
            if value not in mapping:
                raise click.UsageError(f"{value!r}: spectrain accepts {', '.join(map(repr, mapping))} here")
            value = mapping[value]
        t.tokens.extend([flag, value])

    return apply


def _same(name: str, theirs: str, ours: str, nargs: int | str = 1) -> tuple[str, Flag]:
    """A flag spectrain spells and means the same way (its values passed on as they are)."""
    return name, Flag(theirs, ours, _emit(name) if nargs == 0 else _to(name, join=nargs == "+"), nargs)


def _client(key: str, kind: type) -> Apply:
    def apply(t: Translation, values: list[str]) -> None:
        t.client_options[key] = kind(values[0])

    return apply


def _only(value: str, why: str, then: Apply | None = None) -> Apply:
    """Accepts exactly ``value`` (spectrain's behaviour), refuses anything else with ``why``."""

    def apply(t: Translation, values: list[str]) -> None:
        if values[0] != value:
            raise click.UsageError(why)
        if then is not None:
            then(t, values)

    return apply


def _note(text: str) -> Apply:
    def apply(t: Translation, values: list[str]) -> None:
        t.notes.append(text)

    return apply


def _draft_arch(t: Translation, values: list[str]) -> None:
    arch = {"eagle3": "llama", "dflash": "qwen3", "dspark": "qwen3"}.get(t.algorithm)
    if values[0] != arch:
        raise click.UsageError(f"--draft-arch {values[0]}: spectrain's {t.algorithm} draft layers are "
                               f"{arch or 'fixed by the algorithm'}; leave --draft-arch out")  # fmt: skip


def _on_missing(t: Translation, values: list[str]) -> None:
    if values[0] not in ("generate", "skip", "warn", "raise"):
        raise click.UsageError(f"--on-missing {values[0]}: generate, skip, warn or raise")
    if values[0] == "generate":
        t.tokens.append("--online")
    else:  # a store holds only complete samples; a speculators cache's missing rows follow the policy
        t.tokens.extend(["--on-missing", values[0]])
        t.offline = True


def _train_ratio(t: Translation, values: list[str]) -> None:
    ratio = float(values[0])
    if not 0.0 < ratio <= 1.0:
        raise click.UsageError(f"--train-data-ratio {values[0]}: must be in (0, 1]")
    t.tokens.extend(["--val-fraction", repr(round(1.0 - ratio, 12))])


def _prefetch_factor(t: Translation, values: list[str]) -> None:
    workers = max(1, int(t.context.get("--num-workers", "0") or 0))
    t.tokens.extend(["--prefetch", str(int(values[0]) * workers)])


_DSPARK_TERMS = ("ce", "kl_div", "tv")


def _loss_fn(t: Translation, values: list[str]) -> None:
    if t.algorithm == "dspark":  # its loss mix: a term or a JSON object of term weights
        spec = values[0]
        try:
            mix = {spec: 1.0} if spec in _DSPARK_TERMS else json.loads(spec)
        except json.JSONDecodeError:
            mix = None
        if not isinstance(mix, dict) or not mix or not set(mix) <= set(_DSPARK_TERMS):
            raise click.UsageError(f"--loss-fn {spec}: spectrain's dspark mixes {', '.join(_DSPARK_TERMS)} "
                                   "(a name or a JSON object such as '{\"ce\": 0.1, \"tv\": 1.8}'); no other loss")  # fmt: skip
        # speculators' terms compare with the verifier's distribution: its meaning, not our hard default
        t.tokens.extend(["--draft-option", "loss_mix=" + json.dumps(mix), "--target-mode", "soft"])
        return
    modes = {"ce": "hard", "kl_div": "soft"}
    if values[0] not in modes:
        raise click.UsageError(f"--loss-fn {values[0]}: spectrain trains with ce (--target-mode hard) or kl_div "
                               "(--target-mode soft); no other loss or mixture")  # fmt: skip
    t.tokens.extend(["--target-mode", modes[values[0]]])


def _other_algorithm(name: str) -> Flag:
    return Flag("(its default)", f"refused: an option of speculators' {name}, an algorithm spectrain does not "
                "implement (dflash, dspark, eagle3; a plugin can add one: docs/adding-an-algorithm.md)")  # fmt: skip


def _dspark(flag: str, key: str, value: Any = None) -> Apply:
    """``--draft-option key=VALUE`` under ``--speculator-type dspark`` (``value``: a switch's), refused otherwise."""

    def apply(t: Translation, values: list[str]) -> None:
        if t.algorithm != "dspark":
            raise click.UsageError(f"{flag}: an option of dspark; give --speculator-type dspark")
        t.tokens.extend(["--draft-option", f"{key}={json.dumps(value) if value is not None else values[0]}"])

    return apply


def _sample_from_anchor(flag: str, on: bool) -> Apply:
    def apply(t: Translation, values: list[str]) -> None:
        if t.algorithm == "dspark":
            t.tokens.extend(["--draft-option", f"sample_from_anchor={json.dumps(on)}"])
        elif on:
            raise click.UsageError(f"{flag}: spectrain's DFlash never predicts the anchor (it is given); "
                                   "--speculator-type dspark drafts anchor-first")  # fmt: skip

    return apply


DSPARK_ONLY = ("--markov-rank", "--markov-head-type", "--confidence-head-alpha", "--enable-confidence-head",
               "--no-enable-confidence-head", "--confidence-head-with-markov", "--no-confidence-head-with-markov",
               "--sample-from-anchor")  # fmt: skip
"""Flags accepted only with ``--speculator-type dspark``."""


_NO_MOONCAKE = ("refused: no Mooncake transfer; spectrain reads the files of vLLM's ExampleHiddenStatesConnector "
                "(--shared-dir) or a store (--store)")  # fmt: skip
_CACHE = (
    "a hidden_states/ cache beside it is trained from (imported into hidden_states.store on the first run, "
    "reused after)"
)

FLAGS: dict[str, Flag] = dict([
    # -- general
    ("--config", Flag("none", "`--config FILE`: a spectrain TrainConfig file, or a speculators run.yaml "
                      "(its `train:` block translated flag by flag, the command line's flags over it)",
                      _to("--config"), 1)),
    ("--dump-config", Flag("off", "`--dump-config`: print the resolved TrainConfig as JSON (a spectrain "
                           "`--config` file) and exit", _emit("--dump-config"), 0)),
    _same("--speculator-type", "eagle3", "`--speculator-type`, default dflash, eagle3 on a line with "
          "--verifier-name-or-path (dflash, dspark, eagle3 and plugins)"),
    ("--dry-run", Flag("off (build, save an initial checkpoint, exit)", "`--dry-run`: print the resolved plan "
                       "(steps, tokens, FLOPs, peak memory) and exit; writes nothing", _emit("--dry-run"), 0)),
    _same("--seed", "42", "`--seed`, default 0"),
    ("--deterministic-cuda", Flag("off", "refused: no deterministic-CUDA mode; --seed fixes the plans, anchors "
                                  "and init, and CPU runs are bit-identical across a resume", None, 0)),
    # -- verifier
    ("--verifier-name-or-path", Flag("required", "alias of `--verifier` (hub id or directory; only the heads' "
                                     "shards are fetched)", _to("--verifier"))),
    ("--trust-remote-code", Flag("off", "accepted, nothing to allow: spectrain reads config.json, tokenizer "
                                 "files and safetensors and never runs a repository's code",
                                 _note("--trust-remote-code: nothing to allow (no repository code runs)"), 0)),
    # -- draft
    _same("--from-pretrained", "none", "`--from-pretrained DIR`: an exported draft (ours or speculators')"),
    ("--draft-config", Flag("none", "refused: the draft's decoder follows the verifier's shape; set "
                            "--num-layers, or any algorithm option with --draft-option KEY=VALUE")),
    _same("--num-layers", "5 for dflash, 1 otherwise", "`--num-layers`, default 5 for dflash and dspark, 1 for "
          "eagle3"),
    ("--draft-arch", Flag("llama for eagle3, qwen3 otherwise", "accepted when it names the algorithm's own "
                          "layers (eagle3: llama, dflash and dspark: qwen3), refused otherwise", _draft_arch)),
    ("--draft-hidden-act", Flag("silu", "accepted as `silu` (spectrain's draft MLPs are SwiGLU), refused "
                                "otherwise", _only("silu", "--draft-hidden-act: spectrain's drafts use silu "
                                                   "(SwiGLU) only; leave the flag out"))),
    ("--draft-mrope-full-head-hack", Flag("on", "refused: spectrain's drafts use plain RoPE with the "
                                          "verifier's rope_theta; no MRoPE rescaling to switch", None, 0)),
    ("--no-draft-mrope-full-head-hack", Flag("on", "refused: spectrain's drafts use plain RoPE with the "
                                             "verifier's rope_theta; no MRoPE rescaling to switch", None, 0)),
    _same("--target-layer-ids", "[2, n//2, n-3]", "`--target-layer-ids \"2 18 33\"` (unquoted values too), "
          "default every stored layer but the last", "+"),
    ("--token-freq-path", Flag("<data-path>/token_freq.pt", "refused: spectrain counts token frequencies from "
                               "the store itself (--vocab-scan-samples, default 10000) to build the draft "
                               "vocabulary")),
    _same("--draft-vocab-size", "full vocabulary (without a token_freq file)", "`--draft-vocab-size`, default "
          "32000 for eagle3 (clamped to the verifier's), the full vocabulary for dflash"),
    ("--d2t-path", Flag("<data-path>/d2t-<size>.npy", "refused: spectrain builds d2t/t2d from the store's token "
                        "counts (--draft-vocab-size sets the size) and writes them into every checkpoint")),
    ("--t2d-path", Flag("<data-path>/t2d-<size>.npy", "refused: spectrain builds d2t/t2d from the store's token "
                        "counts (--draft-vocab-size sets the size) and writes them into every checkpoint")),
    _same("--mask-token-id", "from the tokenizer", "`--mask-token-id`, default vocab_size - 1"),
    ("--norm-before-residual", Flag("on", "`--draft-option norm_before_residual=true` (eagle3), default on",
                                    _emit("--draft-option", "norm_before_residual=true"), 0)),
    ("--no-norm-before-residual", Flag("on", "`--draft-option norm_before_residual=false` (eagle3)",
                                       _emit("--draft-option", "norm_before_residual=false"), 0)),
    ("--embed-requires-grad", Flag("off", "refused: the draft shares the verifier's embeddings, frozen", None,
                                   0)),
    ("--no-embed-requires-grad", Flag("off", "accepted: the embeddings are frozen (always)", _emit(), 0)),
    _same("--norm-before-fc", "on for eagle3", "`--norm-before-fc`, default off", 0),
    _same("--no-norm-before-fc", "on for eagle3", "`--no-norm-before-fc` (the default)", 0),
    ("--fc-norm", Flag("off", "refused: no per-layer norm before fc; --norm-before-fc normalises the "
                       "concatenated states", None, 0)),
    _same("--norm-output", "on for eagle3", "`--norm-output`, default off", 0),
    _same("--no-norm-output", "on for eagle3", "`--no-norm-output` (the default)", 0),
    _same("--sliding-window", "2048 (every draft layer)", "`--sliding-window N` (every draft layer), default "
          "none: full attention"),
    ("--full-attention-indices", Flag("[]", "refused: --sliding-window applies to every draft layer; leave it "
                                      "out for full attention in all of them", None, "+")),
    ("--sliding-window-non-causal", Flag("off (dflash2: on)", "`--block-attention bidirectional` (the default)",
                                         _emit("--block-attention", "bidirectional"), 0)),
    ("--no-sliding-window-non-causal", Flag("off", "`--block-attention causal`",
                                            _emit("--block-attention", "causal"), 0)),
    ("--draft-attn-impl", Flag("simple_flex_attention", "`--draft-option attention_backend=flex|sdpa`, default "
                               "auto (flex on CUDA); eager refused: use sdpa",
                               _to("--draft-option", {"simple_flex_attention": "attention_backend=flex",
                                                      "sdpa": "attention_backend=sdpa"}))),
    # -- data
    ("--data-path", Flag("./output", "alias of `--prompts`: its prepared dataset (input_ids, loss_mask) is read "
                         "as pre-tokenized prompts; " + _CACHE, _to("--prompts"))),
    ("--hidden-states-backend", Flag("file", "accepted as `file` (vLLM's ExampleHiddenStatesConnector files, "
                                     "read from --shared-dir); fp8 and mooncake refused",
                                     _only("file", "--hidden-states-backend: spectrain reads vLLM's file "
                                           "connector (file) only; fp8 and mooncake transfers are not offered"))),
    _same("--total-seq-len", "8192", "`--total-seq-len`, default 8192"),
    ("--train-data-ratio", Flag("0.9", "`--val-fraction 1-RATIO`, default 0.01 (split by a hash of the sample "
                                "id, not by row order)", _train_ratio)),
    ("--hidden-states-dtype", Flag("bfloat16", "`--precision bf16|fp32`, default auto (bf16 on CUDA)",
                                   _to("--precision", {"bfloat16": "bf16", "float32": "fp32"}))),
    _same("--num-workers", "12", "`--num-workers`, default 0 (a prefetch thread)"),
    ("--prefetch-factor", Flag("4 per worker", "`--prefetch N x --num-workers` (samples read ahead in all), "
                               "default 8", _prefetch_factor)),
    _same("--max-anchors", "512", "`--max-anchors`, default 512"),
    # -- generation
    ("--vllm-endpoint", Flag("http://localhost:8000/v1", "alias of `--endpoint` (repeatable); an endpoint makes "
                             "the run --online", _to("--endpoint"))),
    ("--on-missing", Flag("generate", "generate: `--online` (what is stored or cached is read, the rest "
                          "generated); skip / warn / raise: an offline run; a cache's rows without a file are "
                          "dropped, dropped with a warning, or stop the run before its first step",
                          _on_missing)),
    ("--on-generate", Flag("delete", "`--delete-consumed`: generated samples deleted once trained on; default "
                           "kept (scratch) until the run ends",
                           _only("delete", "--on-generate: delete is its only value", _emit("--delete-consumed")))),
    ("--request-timeout", Flag("120 s", "`--online-option client_options={\"request_timeout_s\": S}`, default "
                               "600 s", _client("request_timeout_s", float))),
    ("--max-retries", Flag("3", "`--online-option client_options={\"max_retries\": N}`, default 3",
                           _client("max_retries", int))),
    ("--generation-validation-retries", Flag("2", "`client_options={\"max_retries\": N}`: a corrupt, short or "
                                             "non-finite file is retried like any transient failure (default 3)",
                                             _client("max_retries", int))),
    ("--max-consecutive-generation-failures", Flag("20", "`client_options={\"breaker_threshold\": N}` per "
                                                   "endpoint (default 5); a run with no answer for "
                                                   "max_down_s (600 s) fails",
                                                   _client("breaker_threshold", int))),
    # -- loss
    ("--loss-implementation", Flag("fused", "accepted as `fused`: spectrain's loss is always chunked over the "
                                   "vocabulary; eager refused (a test-only reference here)",
                                   _only("fused", "--loss-implementation: spectrain's loss is always the chunked "
                                         "(fused) one; eager exists only as the tests' reference"))),
    ("--loss-fn", Flag("ce for dflash, kl_div otherwise", "`--target-mode hard` (ce) / `soft` (kl_div), default "
                       "hard; dspark: `--draft-option loss_mix=...` (ce, kl_div, tv or a JSON mix of them, default "
                       "kl_div) with `--target-mode soft` (its terms compare with the verifier's distribution; "
                       "without the flag our dspark trains hard); other losses refused", _loss_fn)),
    _same("--ttt-steps", "3", "`--ttt-steps`, default 3"),
    _same("--ttt-step-loss-decay", "1.0", "`--ttt-step-loss-decay`, default 0.8"),
    # -- optimizer
    _same("--optimizer", "muon", "`--optimizer`, default auto (the algorithm's measured choice: muon for "
          "dflash, adamw for eagle3)"),
    _same("--lr", "1e-3", "`--lr`, default 6e-4"),
    _same("--weight-decay", "0.01", "`--weight-decay`, default 0"),
    _same("--muon-lr", "--lr", "`--muon-lr`, default --lr"),
    _same("--muon-momentum", "0.95", "`--muon-momentum`, default 0.95"),
    _same("--muon-weight-decay", "0.1", "`--muon-weight-decay`, default 0.1"),
    _same("--muon-ns-steps", "5", "`--muon-ns-steps`, default 5"),
    ("--muon-adjust-lr-fn", Flag("match_rms_adamw", "`--muon-adjust-lr`, default match_rms_adamw",
                                 _to("--muon-adjust-lr"))),
    # -- scheduler
    ("--scheduler-type", Flag("linear", "`--schedule linear|cosine|constant` (none = constant), default cosine",
                              _to("--schedule", {"linear": "linear", "cosine": "cosine", "none": "constant"}))),
    ("--scheduler-warmup-steps", Flag("scheduler-dependent", "`--warmup-steps`, default --warmup-ratio of all "
                                      "steps", _to("--warmup-steps"))),
    ("--scheduler-warmup-ratio", Flag("none", "`--warmup-ratio`, default 0.04", _to("--warmup-ratio"))),
    ("--scheduler-total-steps", Flag("inferred", "refused: the schedule spans --max-steps (or all epochs); "
                                     "--stop-after-steps N stops early on an unchanged schedule")),
    ("--scheduler-num-cosine-cycles", Flag("0.5", "accepted as 0.5 (spectrain's cosine is one half cycle to "
                                           "--min-lr-ratio), refused otherwise",
                                           _only("0.5", "--scheduler-num-cosine-cycles: spectrain's cosine is "
                                                 "half a cycle (0.5) only")),
     ),
    # -- trainer
    _same("--epochs", "20", "`--epochs`, default 1"),
    ("--checkpoint-freq", Flag("1.0 (epochs)", "`--save-every-epochs F`: every F epochs as the equivalent step "
                               "interval (logged at start, shown by --dry-run); default --save-every 1000 steps, "
                               "and one at the end", _to("--save-every-epochs"))),
    ("--save-best", Flag("off", "`--save-best`: each validation whose tau (not loss) beats every earlier one is "
                         "checkpointed and named in <save-path>/best, never pruned", _emit("--save-best"), 0)),
    ("--no-resume-from-checkpoint", Flag("off (resume)", "`--resume none`: start fresh (default auto: resume "
                                         "<save-path>/latest)", _emit("--resume", "none"), 0)),
    ("--log-freq", Flag("1", "`--log-every`, default 10", _to("--log-every"))),
    _same("--save-path", "./output/checkpoints", "`--save-path`, default ./output/checkpoints"),
    ("--fsdp-shard", Flag("off", "`--distributed fsdp`, default ddp", _emit("--distributed", "fsdp"), 0)),
    ("--gradient-checkpointing", Flag("off", "refused: no activation checkpointing; --max-anchors and "
                                      "--total-seq-len bound a step's activations (see --dry-run)", None, 0)),
    _same("--max-steps", "none", "`--max-steps`, default none (all epochs)"),
    # -- logging
    ("--logger", Flag("none", "alias of `--report-to` (tensorboard, wandb, trackio; mlflow refused)",
                      _to("--report-to"))),
    ("--log-dir", Flag("./logs", "refused: metrics.jsonl, tensorboard/ and the report are written under "
                       "--save-path")),
    _same("--run-name", "auto-generated", "`--run-name`: the trackers' run name and the report's title "
          "({time}, {rank}, ... filled in), default --save-path's last directory"),
    # -- dflash
    _same("--block-size", "16 for dflash, 8 otherwise", "`--block-size`, default 16 for dflash, 8 for dspark"),
    ("--sample-from-anchor", Flag("off for dflash, on for dspark", "dspark: `--draft-option sample_from_anchor=true` "
                                  "(the default); refused for dflash (its anchor is given)",
                                  _sample_from_anchor("--sample-from-anchor", True), 0)),
    ("--no-sample-from-anchor", Flag("off for dflash, on for dspark", "dspark: `--draft-option "
                                     "sample_from_anchor=false` (DFlash's fill-in block); dflash: accepted (its "
                                     "anchor is given)", _sample_from_anchor("--no-sample-from-anchor", False), 0)),
    ("--dflash-decay-gamma", Flag("4.0", "`--loss-gamma` (with --loss-weighting exp-decay), default 7/5/4 for "
                                  "B = 16/10/8", _to("--loss-gamma"))),
    ("--per-position-loss-weight", Flag("dpace for dflash", "`--loss-weighting dpace|exp-decay`, default dpace",
                                        _to("--loss-weighting", {"dpace": "dpace",
                                                                 "fixed-exp-decay": "exp-decay"}))),
    _same("--dpace-alpha", "0.5", "`--dpace-alpha`, default 0.5"),
    # -- the hidden-state backends
    _same("--hidden-states-path", "<data-path>/hidden_states", "`--hidden-states-path DIR`: the cache is "
          "imported into DIR.store (or --store) on the first run and reused after, a changed file refused; online, "
          "also the servers' --shared-dir"),
    *((f"--mooncake-{name}", Flag("(its default)", _NO_MOONCAKE))
      for name in ("master", "metadata-server", "protocol", "device", "global-segment-gib", "local-buffer-gib")),
])  # fmt: skip

for _alg, _names in {
    "dflash2": ("conv-kernel-size", "conv-group-size", "selector-rank", "selector-top-k", "selector-loss-alpha"),
    "xpress": ("xpress-rank", "xpress-mlp-ratio", "num-jacobi-passes", "consistency-weight", "consistency-passes",
               "base-anchor-weight"),
    "peagle": ("num-depths", "down-sample-ratio", "down-sample-ratio-min"),
    "mtp": ("num-speculative-steps", "step-weight-beta"),
}.items():  # fmt: skip
    for _name in _names:
        FLAGS[f"--{_name}"] = _other_algorithm(_alg)
FLAGS.update({
    "--markov-rank": Flag("256", "dspark: `--draft-option markov_rank=N`, default 256",
                          _dspark("--markov-rank", "markov_rank")),
    "--markov-head-type": Flag("vanilla", "dspark: `--draft-option markov_head_type=vanilla|gated|rnn`, default "
                               "vanilla (the only one vLLM 0.32 serves)",
                               _dspark("--markov-head-type", "markov_head_type")),
    "--confidence-head-alpha": Flag("1.0", "dspark: `--draft-option confidence_head_alpha=A`, default 1.0",
                                    _dspark("--confidence-head-alpha", "confidence_head_alpha")),
    **{f"--{neg}{name}": Flag("on", f"dspark: `--draft-option {key}={'false' if neg else 'true'}`, default on",
                              _dspark(f"--{neg}{name}", key, not neg), 0)
       for name, key in (("enable-confidence-head", "enable_confidence_head"),
                         ("confidence-head-with-markov", "confidence_head_with_markov"))
       for neg in ("", "no-")},
})  # fmt: skip
for _name in ("ce-from-data", "base-anchor-full-weight"):
    FLAGS[f"--{_name}"] = Flag("off", _other_algorithm("xpress").ours, None, 0)

DEFAULTS_THAT_DIFFER = ("--speculator-type", "--epochs", "--lr", "--seed", "--optimizer", "--weight-decay",
                        "--train-data-ratio", "--num-workers", "--ttt-step-loss-decay", "--sliding-window",
                        "--on-generate", "--scheduler-type", "--log-freq", "--checkpoint-freq")  # fmt: skip
"""Flags whose default differs here; named in one log line when a speculators-only spelling is used."""


def _group_flags(data: dict[str, Any]) -> dict[str, Any]:
    stage = data.get("train") if isinstance(data.get("train"), dict) else data
    flat: dict[str, Any] = {}
    for key, value in stage.items():
        if isinstance(value, dict):  # a group (backend: included): its leaves are the flags
            flat.update(value)
        else:
            flat[key] = value
    return flat


SPECULATORS_GROUPS = frozenset({"verifier", "data", "generation", "loss", "scheduler", "trainer", "logging",
                                "dflash", "dflash2", "dspark", "xpress", "peagle", "mtp", "backend"})  # fmt: skip


def is_speculators_config(data: Any) -> bool:
    """A speculators run.yaml: a ``train:`` block, or any of its groups as a mapping."""
    if not isinstance(data, dict):
        return False
    if isinstance(data.get("train"), dict):
        return True
    groups = SPECULATORS_GROUPS | {"optimizer", "draft"}
    return any(k in SPECULATORS_GROUPS or (k == "optimizer" and isinstance(v, dict))
               for k, v in data.items() if k in groups)  # fmt: skip


def config_tokens(path: str) -> list[str] | None:
    """The flags a speculators-shaped ``--config`` file stands for (None: a spectrain config file)."""
    from spectrain.train.config import load_config_file

    data = load_config_file(path)
    if not is_speculators_config(data):
        return None
    out: list[str] = []
    for dest, value in _group_flags(data).items():
        name = "--" + str(dest).replace("_", "-")
        if value is None or value == "" or value == []:
            continue
        if isinstance(value, bool):
            if f"--no-{name[2:]}" in FLAGS:
                out.append(name if value else f"--no-{name[2:]}")
            elif value:
                out.append(name)
            continue
        if name not in FLAGS:
            raise click.UsageError(f"--config {path}: {dest!r} is not a speculators train option")
        values = value if isinstance(value, list) else [value]
        out.extend([name, *(v if isinstance(v, str) else json.dumps(v) for v in values)])
    return out


def _value_options(command: click.Command) -> tuple[set[str], set[str]]:
    """spectrain's own option spellings: all of them, and those that take a value."""
    names, valued = set(), set()
    for p in command.params:
        if isinstance(p, click.Option):
            spellings = [*p.opts, *p.secondary_opts]
            names.update(spellings)
            if not p.is_flag and not p.count:
                valued.update(p.opts)
    return names, valued


def translate(argv: list[str], command: click.Command) -> Translation:
    """spectrain tokens for ``argv``: speculators' flags translated or refused (``click.UsageError``)."""
    _, valued = _value_options(command)
    t = Translation()
    args = list(argv)
    for i, tok in enumerate(args[:-1]):  # the values other flags' translations depend on
        if tok in ("--speculator-type", "--num-workers"):
            t.context[tok] = args[i + 1]
    if "--config" in args[:-1]:
        i = args.index("--config")
        expanded = config_tokens(args[i + 1])
        if expanded is not None:
            args = [*expanded, *args[:i], *args[i + 2 :]]
    names = {a.partition("=")[0] for a in args}
    if "--verifier-name-or-path" in names and not names & {"--speculator-type", "--from-pretrained"}:
        t.context["--speculator-type"] = "eagle3"  # a speculators line: its default algorithm
        t.tokens += ["--speculator-type", "eagle3"]
        t.notes.append("--speculator-type: not given on a speculators line (--verifier-name-or-path): eagle3, "
                       "speculators' default")  # fmt: skip
    i = 0
    while i < len(args):
        tok = args[i]
        name, eq, inline = tok.partition("=")
        flag = FLAGS.get(name) if tok.startswith("--") else None
        if flag is None:  # spectrain's own (click checks it), or a value
            step = 2 if name in valued and not eq and i + 1 < len(args) else 1
            t.tokens.extend(args[i : i + step])
            i += step
            continue
        values: list[str] = [inline] if eq else []
        i += 1
        if flag.nargs == "+":
            while i < len(args) and not args[i].startswith("--"):
                values.append(args[i])
                i += 1
        elif flag.nargs == 1 and not eq and i < len(args):
            values.append(args[i])
            i += 1
        if flag.apply is None:
            raise click.UsageError(f"{name}: {flag.ours.removeprefix('refused: ')}")
        if flag.nargs and not values:
            raise click.UsageError(f"{name}: expects a value")
        start = len(t.tokens)
        flag.apply(t, values)
        if t.tokens[start : start + 1] != [name]:
            t.given.append(name)
    if t.client_options:
        t.tokens.extend(["--online-option", "client_options=" + json.dumps(t.client_options)])
    if t.offline:
        t.tokens = _drop_endpoints(t.tokens)
        t.notes.append("--on-missing: an offline run over --store (no sample of a store is ever missing)")
    return t


def _drop_endpoints(tokens: list[str]) -> list[str]:
    out, skip = [], False
    for tok in tokens:
        if skip:
            skip = False
            continue
        if tok in ("--endpoint", "--vllm-endpoint", "--online"):
            skip = tok != "--online"
            continue
        out.append(tok)
    return out


def defaults_note(t: Translation) -> str | None:
    """One line naming the defaults that differ from speculators' for flags left out."""
    if not t.given:
        return None
    left_out = [n for n in DEFAULTS_THAT_DIFFER if n not in t.given and n not in t.context]
    parts = [f"{n} (speculators {FLAGS[n].theirs}; here {FLAGS[n].ours.split('default ', 1)[-1]})"
             for n in left_out]  # fmt: skip
    return "speculators spellings translated; defaults that differ for flags left out: " + "; ".join(parts)


class SpeculatorsCommand(SectionedCommand):
    """A sectioned command that reads speculators' train flags too (:func:`translate`)."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        if any(a in ("-h", "--help") for a in args):
            return super().parse_args(ctx, args)
        t = translate(args, self)
        ctx.meta["speculators_notes"] = [*t.notes, *filter(None, [defaults_note(t)])]
        return super().parse_args(ctx, t.tokens)


def markdown_table() -> str:
    """docs/train.md's table: every speculators flag, its default there, and what it is here."""
    rows = ["| speculators flag | its default | spectrain |", "|---|---|---|"]
    for name, flag in FLAGS.items():
        theirs, ours = (c.replace("|", "\\|") for c in (flag.theirs, flag.ours))
        rows.append(f"| `{name}` | {theirs} | {ours} |")
    return "\n".join(rows)
