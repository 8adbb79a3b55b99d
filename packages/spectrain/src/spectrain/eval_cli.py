"""``spectrain eval``: measured acceptance length of an exported draft against its verifier."""

from __future__ import annotations

import json
import logging
import sys
from typing import Any

import click

from spectrain.eval import DTYPES


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
    return "\n".join(lines)


@click.command("eval", context_settings={"help_option_names": ["-h", "--help"], "show_default": True})
@click.option(
    "--draft",
    "draft_dir",
    required=True,
    type=click.Path(file_okay=False),
    help="Exported draft directory (config.json + model.safetensors).",
)
@click.option(
    "--verifier",
    required=True,
    type=click.Path(file_okay=False),
    help="Local HF directory of the verifier model.",
)
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
@click.option(
    "--num-prompts",
    default=None,
    type=click.IntRange(min=1),
    help="Use only the first N prompts [default: all].",
)
@click.option(
    "--num-speculative-tokens",
    "-k",
    default=None,
    type=click.IntRange(min=1),
    help="Draft tokens per step [default: the draft's speculative_tokens; DFlash at most block_size - 1, an Eagle3 chain any length].",
)
@click.option(
    "--dtype",
    default="float64",
    type=click.Choice(sorted(DTYPES)),
    help="Verifier dtype (float64 keeps batched verification and greedy decoding bit-identical in practice).",
)
@click.option("--device", default="cpu", help="Torch device for verifier and draft: cpu, cuda, cuda:1, ...")
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
@click.option("--progress/--no-progress", default=True, help="Progress bar on stderr.")
@click.option("--log-level", default="WARNING", type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"]))
def eval_command(draft_dir, verifier, prompts_path, max_new_tokens, num_prompts, num_speculative_tokens, dtype,
                 device, block_attention, torch_threads, as_json, progress, log_level) -> None:  # fmt: skip
    """Speculative decoding with greedy verification: tau, per-position acceptance, exactness.

    The verifier runs with transformers; the draft is loaded from the exported (vLLM) format.
    Every output is checked against the verifier's own greedy decoding: the exit status is 1
    when any differs.
    """
    import torch

    from hsgen.inputs import InputError
    from spectrain.eval import (
        DraftLoadError,
        evaluate,
        load_exported_draft,
        load_prompts,
        load_verifier,
        max_tokens,
    )

    logging.basicConfig(
        level=log_level, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if torch_threads:
        torch.set_num_threads(torch_threads)
    try:
        proposer = load_exported_draft(draft_dir, verifier, device=device,
                                       block_attention=None if block_attention == "auto" else block_attention)  # fmt: skip
        ver, tokenizer = load_verifier(verifier, proposer.layer_ids, dtype=dtype, device=device)
        prompts = load_prompts(prompts_path, tokenizer, num_prompts=num_prompts)
        limit = max_tokens(proposer)
        if num_speculative_tokens and limit is not None and num_speculative_tokens > limit:
            raise click.BadParameter(
                f"{num_speculative_tokens} exceeds the draft's limit of {limit} (block_size - 1)",
                param_hint="--num-speculative-tokens",
            )
    except (DraftLoadError, InputError, FileNotFoundError, ValueError) as e:
        raise click.ClickException(str(e)) from None
    report = evaluate(
        ver,
        proposer,
        prompts,
        max_new_tokens=max_new_tokens,
        num_speculative_tokens=num_speculative_tokens,
        progress=progress,
    )
    result = {
        "draft": str(draft_dir),
        "algorithm": proposer.algorithm,
        "verifier": str(verifier),
        "layer_ids": list(proposer.layer_ids),
        "block_attention": getattr(proposer.model.cfg, "block_attention", None),
        "max_new_tokens": max_new_tokens,
        "verifier_dtype": dtype,
        **report.to_dict(),
    }
    table = format_report(result)
    if as_json:
        click.echo(table, err=True)
        click.echo(json.dumps(result))
    else:
        click.echo(table)
    if not report.exact_match:
        click.echo("error: speculative decoding changed the output (see MISMATCH lines)", err=True)
        sys.exit(1)
