"""``spectrain eval``: measured acceptance length of an exported draft against its verifier."""

from __future__ import annotations

import json
import logging
import sys
from typing import Any

import click

DTYPES = ("bfloat16", "float16", "float32", "float64")
"""``spectrain.eval.decode.DTYPES``' names, spelled here so ``--help`` does not import torch (a test keeps them equal)."""


def format_report(report: dict[str, Any]) -> str:
    """The human-readable table of an evaluation (``report`` is the ``--json`` object)."""
    lines = [
        f"draft        {report['draft']} ({report['algorithm']}, K={report['num_speculative_tokens']}, "
        f"layers {','.join(str(i) for i in report['layer_ids'])})",
        f"verifier     {report['verifier']}",
        f"prompts      {report['num_prompts']}   new tokens {report['new_tokens']}   verifier steps {report['steps']}",
        f"tau          {report['tau']:.3f}  (tokens per verifier step, bonus token included)",
    ]
    exact = sum(1 for r in report["per_prompt"] if r.get("exact"))
    lines.append(
        f"exact match  {'yes' if report['exact_match'] else 'NO'} ({exact}/{report['num_prompts']} equal greedy)"
    )
    lines.append("")
    lines.append("position  accepted  given previous")
    for i, (a, c) in enumerate(
        zip(report["acceptance_rate"], report["conditional_acceptance"], strict=True), 1
    ):
        lines.append(f"{i:>8}  {a:>8.3f}  {c:>14.3f}")
    lines.append("")
    lines.append("accepted drafts per step")
    total = max(1, report["steps"])
    for n, count in enumerate(report["accepted_histogram"]):
        bar = "#" * round(40 * count / total)
        lines.append(f"{n:>8}  {count:>7}  {count / total:>6.1%}  {bar}")
    for m in report["mismatches"]:
        lines.append(
            f"MISMATCH {m['id']} ({m['source']}): first difference at generated token {m['first_difference']}"
        )
    served = report.get("served")
    if served:
        rates = " ".join(f"{r:.3f}" for r in served["acceptance_rate"])
        lines += [
            "",
            f"served       {served['endpoint']} ({served['model']})",
            f"served tau   {served['tau']:.3f}  (vLLM's counters: {served['accepted']} accepted in {served['drafts']} "
            f"drafts; here {report['tau']:.3f}, counted as vLLM counts; difference {report['tau_difference']:+.3f})",
            f"served rate  {rates}  (per position)",
            f"served exact {'yes' if served['exact_match'] else 'NO'}",
        ]
        for m in served["mismatches"]:
            lines.append(
                f"SERVED MISMATCH {m['id']} ({m['source']}): first difference at token {m['first_difference']}"
            )
    return "\n".join(lines)


def _layer_ids(text: str | None, draft_layers) -> list[int]:
    if not text:
        return list(draft_layers)
    from hsgen.protocol.extraction import parse_layer_ids

    try:
        ids = parse_layer_ids(text)
    except ValueError as e:
        raise click.BadParameter(str(e), param_hint="--layer-ids") from None
    if len(ids) != len(draft_layers):
        raise click.BadParameter(
            f"{ids}: the draft reads {len(draft_layers)} layers ({list(draft_layers)})",
            param_hint="--layer-ids",
        )
    return ids


def follow_latest(path: str) -> str:
    """A training ``--save-path`` (holding ``latest``) -> its newest checkpoint; anything else as is."""
    from pathlib import Path

    latest = Path(path) / "latest"
    if latest.is_file() and not (Path(path) / "config.json").is_file():
        return str(Path(path) / latest.read_text().strip())
    return path


@click.command("eval", context_settings={"help_option_names": ["-h", "--help"], "show_default": True})
@click.option(
    "--draft",
    "draft_dir",
    required=True,
    type=click.Path(file_okay=False),
    help="Exported draft directory (config.json + model.safetensors), or a training --save-path "
    "(its 'latest' checkpoint is used).",
)
@click.option(
    "--verifier",
    required=True,
    help="The verifier: a local HF directory or a Hugging Face model id (resolved in the HF cache first).",
)
@click.option("--revision", default=None, help="Branch, tag or commit of a hub --verifier [default: main].")
@click.option(
    "--prompts",
    "prompts_path",
    required=True,
    help="Prompts: JSONL/JSON/Parquet (messages, input_ids or prompt); '-' for stdin.",
)
@click.option(
    "--max-new-tokens",
    default=64,
    type=click.IntRange(min=1),
    help="Tokens generated per prompt (fewer at EOS).",
)
@click.option("--split", default="train", help="Split of a dataset --prompts (hub id or datasets directory).")
@click.option(
    "--chat-template",
    type=click.Path(exists=True, dir_okay=False),
    help="Chat template file overriding the verifier's (render as hsgen generate did).",
)
@click.option(
    "--template-kwargs",
    help="Extra chat-template variables as JSON, e.g. '{\"enable_thinking\": false}' (as hsgen generate).",
)
@click.option(
    "--layer-ids",
    help="Verifier layer ids feeding the draft [default: the draft config's; the same count is required].",
)
@click.option(
    "--num-prompts",
    "--max-samples",
    "num_prompts",
    default=None,
    type=click.IntRange(min=1),
    help="Use only the first N prompts [default: all].",
)
@click.option(
    "--num-speculative-tokens",
    "-k",
    default=None,
    type=click.IntRange(min=1),
    help="Draft tokens per step [default: the draft's speculative_tokens; a block draft at most its block's proposals (DFlash block_size - 1, anchor-first DSpark block_size), an Eagle3 chain any length].",
)
@click.option(
    "--dtype",
    default="auto",
    type=click.Choice(["auto", *sorted(DTYPES)]),
    help="Verifier dtype; auto = float64 on CPU (batched verification and greedy decoding stay "
    "bit-identical in practice), float32 on a GPU.",
)
@click.option(
    "--device",
    default="auto",
    help="Torch device for verifier and draft: auto (cuda if available), cpu, cuda:1, ...",
)
@click.option(
    "--block-attention",
    type=click.Choice(["auto", "bidirectional", "causal"]),
    default="auto",
    help="DFlash: attention inside the block; auto follows config.json's sliding_window_non_causal as vLLM "
    "serves it (false = causal).",
)
@click.option(
    "--torch-threads",
    default=0,
    type=click.IntRange(min=0),
    help="torch.set_num_threads (0 = torch's default).",
)
@click.option(
    "--json", "as_json", is_flag=True, help="Print one JSON object on stdout (the table goes to stderr)."
)
@click.option(
    "--progress/--no-progress",
    default=None,
    help="Progress on stderr: a bar on a terminal, periodic log lines otherwise [default: auto].",
)
@click.option(
    "--endpoint",
    help="Also measure the draft where it is served: a vLLM server running it with --speculative-config "
    "(nothing else may use it meanwhile). Reports vLLM's own acceptance (its spec-decode counters on /metrics) "
    "beside ours, both counted as vLLM counts, and checks every served output against greedy decoding.",
)
@click.option("--api-key", envvar="VLLM_API_KEY", help="Bearer key of --endpoint [env: VLLM_API_KEY].")
@click.option(
    "--ignore-eos",
    is_flag=True,
    default=False,
    help="Generate --max-new-tokens tokens per prompt even past an EOS (vLLM's ignore_eos; fixed-length outputs).",
)
@click.option("--log-level", default="WARNING", type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"]))
def eval_command(draft_dir, verifier, revision, prompts_path, max_new_tokens, split, chat_template, template_kwargs,
                 layer_ids, num_prompts, num_speculative_tokens, dtype, device, block_attention, torch_threads,
                 as_json, progress, endpoint, api_key, ignore_eos, log_level) -> None:  # fmt: skip
    """Speculative decoding with greedy verification: tau, per-position acceptance, exactness.

    The verifier runs with transformers; the draft is loaded from the exported (vLLM) format.
    Every output is checked against the verifier's own greedy decoding: the exit status is 1
    when any differs.
    """
    from hsgen import progress as hsgen_progress

    hsgen_progress.configure(progress)  # before transformers is imported: its bars follow
    from hsgen.log_format import setup_logging

    setup_logging(log_level)
    say = _phase_logger(progress)
    say("importing torch and transformers")
    import torch

    from hsgen.inputs.formats import InputError
    from spectrain.eval.decode import (
        DraftLoadError,
        evaluate,
        load_exported_draft,
        load_prompts,
        load_verifier,
        max_tokens,
    )

    if torch_threads:
        torch.set_num_threads(torch_threads)
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if dtype == "auto":
        dtype = "float64" if device == "cpu" else "float32"
    draft_dir = follow_latest(draft_dir)
    verifier_arg = verifier
    try:
        from hsgen.hf.hub import HubError, resolve

        verifier = str(resolve(verifier, revision=revision, need="full"))
    except HubError as e:
        raise click.BadParameter(str(e), param_hint="--verifier") from None
    try:
        say(f"loading the draft {draft_dir}")
        proposer = load_exported_draft(draft_dir, verifier, device=device,
                                       block_attention=None if block_attention == "auto" else block_attention)  # fmt: skip
        layers = _layer_ids(layer_ids, proposer.layer_ids)
        say(f"loading the verifier {verifier} ({dtype} on {device})")
        ver, tokenizer = load_verifier(verifier, layers, dtype=dtype, device=device)
        if ignore_eos:
            ver.eos_token_ids = frozenset()
        from hsgen.cli.toolkit import json_object_option
        from hsgen.inputs.hf_datasets import as_input

        prompts = load_prompts(as_input(prompts_path, split=split), tokenizer, num_prompts=num_prompts,
                               chat_template=chat_template, template_kwargs=json_object_option(template_kwargs, "--template-kwargs"))  # fmt: skip
        limit = max_tokens(proposer)
        if num_speculative_tokens and limit is not None and num_speculative_tokens > limit:
            raise click.BadParameter(
                f"{num_speculative_tokens} exceeds the draft's limit of {limit} (the proposals of one block)",
                param_hint="--num-speculative-tokens",
            )
    except (DraftLoadError, InputError, FileNotFoundError, ValueError) as e:
        raise click.ClickException(str(e)) from None
    say(f"{len(prompts)} prompts, up to {max_new_tokens} new tokens each: speculative decoding, "
        "then greedy decoding to check each output")  # fmt: skip
    report = evaluate(
        ver,
        proposer,
        prompts,
        max_new_tokens=max_new_tokens,
        num_speculative_tokens=num_speculative_tokens,
        progress=progress is not False,
        counting="vllm" if endpoint else "spectrain",
        keep_tokens=bool(endpoint),
    )
    served = (
        _measure_endpoint(endpoint, api_key, prompts, max_new_tokens, report, progress, ignore_eos)
        if endpoint
        else None
    )
    result = {
        "draft": str(draft_dir),
        "algorithm": proposer.algorithm,
        "verifier": str(verifier_arg),
        "layer_ids": list(layers),
        "block_attention": getattr(proposer.model.cfg, "block_attention", None),
        "max_new_tokens": max_new_tokens,
        "ignore_eos": ignore_eos,
        "verifier_dtype": dtype,
        **report.to_dict(),
    }
    if served is not None:
        for row in result["per_prompt"]:
            row.pop("tokens", None)
        result["counting"] = "vllm"
        result["served"] = served.to_dict()
        result["tau_difference"] = served.tau - report.tau
    table = format_report(result)
    if as_json:
        click.echo(table, err=True)
        click.echo(json.dumps(result))
    else:
        click.echo(table)
    if not report.exact_match:
        click.echo("error: speculative decoding changed the output (see MISMATCH lines)", err=True)
        sys.exit(1)
    if served is not None and not served.exact_match:
        click.echo(f"error: {endpoint} served outputs that differ from greedy decoding (see SERVED MISMATCH lines)",
                   err=True)  # fmt: skip
        sys.exit(1)


def _phase_logger(progress: bool | None):
    """``say(message)``: one stderr line per phase of the run (through ``hsgen.progress``, whose
    lines show at any ``--log-level``), unless ``--no-progress``."""
    log = logging.getLogger("hsgen.progress")
    if progress is False:
        return lambda message: None
    log.setLevel(logging.INFO)  # the progress lines are the run's progress, not debugging output
    return lambda message: log.info("eval: %s", message)


def _measure_endpoint(endpoint, api_key, prompts, max_new_tokens, report, progress, ignore_eos):
    from spectrain.eval.served import EndpointError, evaluate_endpoint

    reference = [row["tokens"] for row in report.per_prompt]
    try:
        return evaluate_endpoint(endpoint, prompts, max_new_tokens, reference=reference, api_key=api_key,
                                 progress=progress is not False, ignore_eos=ignore_eos)  # fmt: skip
    except EndpointError as e:
        raise click.ClickException(f"--endpoint: {e}") from None
