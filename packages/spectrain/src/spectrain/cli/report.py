"""``spectrain report``: charts and an HTML page of a training run (see :mod:`spectrain.eval.report`)."""

from __future__ import annotations

import json

import click


@click.command("report", context_settings={"help_option_names": ["-h", "--help"], "show_default": True})
@click.argument("save_path", type=click.Path(exists=True, file_okay=False))
@click.option(
    "-o",
    "--out",
    "out_dir",
    type=click.Path(file_okay=False),
    help="Output directory [default: SAVE_PATH/report].",
)
@click.option(
    "--eval",
    "eval_paths",
    multiple=True,
    type=click.Path(exists=True, dir_okay=False),
    help="A 'spectrain eval --json' output to chart, repeatable [default: SAVE_PATH/eval*.json].",
)
def report(save_path: str, out_dir: str | None, eval_paths: tuple[str, ...]) -> None:
    """Chart SAVE_PATH's metrics.jsonl: loss and LR, acceptance per position, tau, tokens/s.

    Writes PNGs and a self-contained index.html (charts embedded) and prints one JSON line
    naming them. With an eval JSON, also the eval's histogram of accepted drafts per step.
    """
    from spectrain.eval.report import ReportError, write_report

    try:
        out = write_report(save_path, out_dir, list(eval_paths) or None)
    except ReportError as e:
        raise click.ClickException(str(e)) from None
    click.echo(json.dumps(out))
