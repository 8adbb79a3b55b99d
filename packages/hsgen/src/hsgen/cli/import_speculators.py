"""``hsgen import-speculators DATA_PATH --store STORE``: speculators' hidden-state cache as a store."""

from __future__ import annotations

import json
import sys

import click


@click.command(
    "import-speculators", context_settings={"help_option_names": ["-h", "--help"], "show_default": True}
)
@click.argument("data_path", type=click.Path(exists=True, file_okay=False))
@click.option(
    "--store",
    "store_path",
    required=True,
    type=click.Path(file_okay=False),
    help="The store to add the samples to (created on the first sample; a rerun adds what is missing).",
)
@click.option(
    "--verifier",
    "--model",
    "verifier",
    required=True,
    help="The verifier the cache was generated with (local directory): its tokenizer fingerprint and "
    "layer count go into the store header.",
)
@click.option(
    "--layer-ids",
    help="The layer ids vLLM extracted, e.g. '2,18,33,36' [default: speculators' "
    "launch_vllm.py default 2, n//2, n-3 and the last layer n].",
)
@click.option(
    "--hidden-states-path",
    type=click.Path(exists=True, file_okay=False),
    help="The hs_<row>.safetensors directory [default: DATA_PATH/hidden_states].",
)
@click.option(
    "--chat-template",
    type=click.Path(exists=True, dir_okay=False),
    help="The chat template prepare-data rendered with, when not the verifier's own.",
)
@click.option("--progress/--no-progress", default=None, help="A progress bar [default: on a terminal].")
def import_speculators(
    data_path: str,
    store_path: str,
    verifier: str,
    layer_ids: str | None,
    hidden_states_path: str | None,
    chat_template: str | None,
    progress: bool | None,
) -> None:
    """Import a cache speculators' prepare-data + generate-offline-data wrote into a store.

    Prints one JSON line (imported, already stored, skipped, rows without a file); exits 1 when a
    file was skipped (each one is named on stderr), so nothing is lost unseen."""
    from hsgen.generate.speculators_import import ImportError_, import_cache
    from hsgen.protocol.extraction import parse_layer_ids

    ids = None
    if layer_ids:
        try:
            ids = parse_layer_ids(layer_ids)
        except ValueError as e:
            raise click.BadParameter(str(e), param_hint="--layer-ids") from None
    try:
        result = import_cache(data_path, store_path, verifier=verifier, layer_ids=ids,
                              hidden_states_path=hidden_states_path, chat_template=chat_template,
                              progress=progress)  # fmt: skip
    except ImportError_ as e:
        raise click.ClickException(str(e)) from None
    for line in result.skipped:
        click.echo(f"skipped {line}", err=True)
    click.echo(json.dumps({"store": store_path, **result.summary()}))
    if result.skipped:
        sys.exit(1)
