"""``spectrain export CHECKPOINT OUT_DIR`` (a click command, loaded lazily by ``spectrain.cli``)."""

from __future__ import annotations

import json

import click

from spectrain.cli.train import _resolve_verifier, _setup_logging


@click.command("export", context_settings={"help_option_names": ["-h", "--help"]})
@click.argument("checkpoint", type=click.Path(exists=True, file_okay=False))
@click.argument("out_dir", type=click.Path(file_okay=False))
@click.option(
    "--verifier",
    help="Verifier directory or hub id (default: the one trained with).",
)
@click.option("--verifier-name", help="speculators_config.verifier.name_or_path (e.g. Qwen/Qwen3-8B).")
@click.option(
    "--include-embeddings",
    is_flag=True,
    default=False,
    help="Also write the verifier's embed_tokens.weight (speculators' Eagle3 from_pretrained needs it).",
)
@click.option("--allow-unservable", is_flag=True, help="Write a draft vLLM cannot serve as trained (a gated or "
              "rnn DSpark head) for spectrain eval and speculators.")  # fmt: skip
def export(checkpoint: str, out_dir: str, verifier: str | None, verifier_name: str | None,
           include_embeddings: bool, allow_unservable: bool) -> None:  # fmt: skip
    """Re-export CHECKPOINT (a spectrain checkpoint directory) to OUT_DIR for vLLM."""
    _setup_logging()
    from spectrain.export.write import ExportError, export_draft
    from spectrain.train.checkpoint import load_checkpoint_model

    if verifier:
        data = {"verifier": verifier}
        _resolve_verifier(data, None)
        verifier, verifier_name = data["verifier"], verifier_name or data.get("verifier_name")

    try:
        model, resolved = load_checkpoint_model(checkpoint, verifier)
    except ValueError as e:
        raise click.ClickException(str(e)) from None
    name = verifier_name or resolved["train"].get("verifier_name") or model.verifier.info.name_or_path
    try:
        out = export_draft(model, out_dir, verifier_name=name, architectures=model.verifier.info.architectures,
                           include_embeddings=include_embeddings, for_vllm=not allow_unservable)  # fmt: skip
    except ExportError as e:
        raise click.ClickException(str(e)) from None
    from spectrain.export.read import read_export_config
    from spectrain.export.write import speculative_config_for

    spec = speculative_config_for(out, read_export_config(out))
    click.echo(json.dumps({"exported": str(out), "verifier": name, "speculative_config": spec}))
