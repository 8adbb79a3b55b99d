"""The ``spectrain`` command. Subcommands are imported only when invoked."""

from __future__ import annotations

import click

from hsgen.cli.toolkit import LazyGroup

COMMANDS: dict[str, tuple[str, str]] = {
    "train": (
        "spectrain.cli.train:train",
        "Train a DFlash or Eagle3 draft from a store (or --online from vLLM).",
    ),
    "export": ("spectrain.cli.export:export", "Export a training checkpoint as a directory vLLM serves."),
    "eval": ("spectrain.cli.eval:eval_command", "Measure acceptance length with real speculative decoding."),
    "report": (
        "spectrain.cli.report:report",
        "Chart a run's metrics (and an eval) as PNGs and one HTML page.",
    ),
}


@click.group(
    cls=LazyGroup,
    lazy_commands=COMMANDS,
    context_settings={"help_option_names": ["-h", "--help"], "show_default": True},
)
@click.version_option(package_name="spectrain")
@click.option(
    "--plugin",
    "plugins",
    multiple=True,
    envvar="SPECTRAIN_PLUGINS",
    metavar="MODULE",
    help="Import MODULE first: a draft algorithm of your own that registers itself "
    "(docs/adding-an-algorithm.md). Repeatable; env SPECTRAIN_PLUGINS takes several, space-separated.",
)
def main(plugins: tuple[str, ...]) -> None:
    """spectrain: train speculative-decoding drafts from a target model's hidden states."""
    if plugins:
        from spectrain.models.plugins import PluginError, load_plugins

        try:
            load_plugins(plugins)
        except PluginError as e:
            raise click.UsageError(str(e)) from None
