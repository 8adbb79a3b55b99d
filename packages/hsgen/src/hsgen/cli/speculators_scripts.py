"""speculators' data scripts as hsgen commands that keep their arguments.

A speculators example script calls ``python scripts/prepare_data.py``, ``scripts/launch_vllm.py``
and ``scripts/data_generation_offline.py``; replacing each with ``hsgen prepare-data``,
``hsgen launch-vllm`` and ``hsgen generate-offline-data`` keeps the script's arguments:

- ``prepare-data`` renders ``--data`` with ``--model``'s tokenizer and chat template into the
  ``datasets`` directory speculators writes (``input_ids``, ``loss_mask``, ``seq_len``), which
  ``spectrain train --data-path`` and ``generate-offline-data --preprocessed-data`` read.
- ``launch-vllm`` is ``hsgen vllm-command --run`` with speculators' layer ids (``--target-layer-ids``
  plus the last layer) and its shared directory (``--hidden-states-path``, default /tmp/hidden_states).
- ``generate-offline-data`` is ``hsgen generate`` of the prepared dataset into a store at
  ``--output`` (default ``<preprocessed-data>/hidden_states``), which ``spectrain train
  --hidden-states-path`` trains from.

A flag whose meaning exists here is translated; one whose meaning does not is refused with one
line naming the flag and what to use instead (:data:`REFUSED`).
"""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path

import click

log = logging.getLogger("hsgen.cli.speculators_scripts")

NAMED_DATASETS = {
    "sharegpt": ("Aeala/ShareGPT_Vicuna_unfiltered", "train"),
    "ultrachat": ("HuggingFaceH4/ultrachat_200k", "train_sft"),
}
"""speculators' dataset names whose records hsgen reads as they are (hub id, split)."""
UNMAPPED_DATASETS = ("gsm8k", "magpie", "nemotron", "sharegpt4v_coco")

REFUSED = {
    "prepare-data": {
        "--render-endpoint": "renders with --model's tokenizer and chat template here; to render with a server's "
        "template use hsgen render --server URL -o FILE.jsonl, then spectrain train --data-path FILE.jsonl",
        "--token-freq-path": "no token-frequency file: spectrain train counts token frequencies from the store "
        "(--vocab-scan-samples)",
        "--skip-token-freq": "no token-frequency file: spectrain train counts token frequencies from the store",
        "--no-skip-token-freq": "no token-frequency file: spectrain train counts token frequencies from the store",
        "--seed": "rows are taken in input order (the first --max-samples); shuffle the input file to draw "
        "another subset",
    },
    "launch-vllm": {},
    "generate-offline-data": {},
}
"""Per command: a speculators flag with no meaning here, and the line that says what to use instead."""

_CTX = {"help_option_names": ["-h", "--help"], "ignore_unknown_options": True, "allow_extra_args": True}


class _Parser(argparse.ArgumentParser):
    """argparse as speculators' scripts use it, its errors as one click usage line."""

    def error(self, message: str):
        raise click.UsageError(message)


def _refuse(command: str, args: list[str]) -> None:
    for tok in args:
        name = tok.split("=", 1)[0]
        if name in REFUSED[command]:
            raise click.UsageError(f"{name}: {REFUSED[command][name]}")


def _parse(parser: argparse.ArgumentParser, command: str, args: list[str], *, known: bool = False):
    _refuse(command, args)
    if known:
        return parser.parse_known_args(args)
    return parser.parse_args(args)


def _prepare_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="hsgen prepare-data", add_help=False)
    p.add_argument("--model", required=True)
    p.add_argument("--data", action="append", required=True)
    p.add_argument("--output", default="./output")
    p.add_argument("--seq-length", type=int, default=8192)
    p.add_argument("--max-samples", type=int)
    p.add_argument("--minimum-valid-tokens", type=int)
    p.add_argument("--num-preprocessing-workers", type=int)
    p.add_argument("--overwrite", action="store_true")
    p.add_argument("--allow-empty-output", action="store_true")
    p.add_argument("--trust-remote-code", action="store_true")
    p.add_argument("--chat-template")
    return p


def dataset_input(name: str, max_samples: int | None):
    """What hsgen reads for a ``--data`` value: speculators' dataset name as its hub dataset, else as is."""
    from hsgen.inputs.hf_datasets import DatasetSpec, as_input

    if name in NAMED_DATASETS:
        hub_id, split = NAMED_DATASETS[name]
        return DatasetSpec(hub_id, split=split, max_samples=max_samples, streaming=False)
    if name in UNMAPPED_DATASETS and not Path(name).exists():
        raise click.UsageError(f"--data {name}: speculators reshapes this dataset's records; hsgen reads "
                               "'messages' or 'conversations' records: pass a file of them")  # fmt: skip
    return as_input(name, max_samples=max_samples)


@click.command("prepare-data", context_settings=_CTX, add_help_option=False)
@click.pass_context
def prepare_data(ctx: click.Context) -> None:
    """speculators' prepare_data.py: --model M --data D --output DIR --max-samples N --seq-length L.

    Renders every --data input (a file, a hub dataset, or speculators' names sharegpt and
    ultrachat) with M's tokenizer and chat template, each prompt cut to L tokens, the first N in
    all, into DIR as a datasets directory (input_ids, loss_mask, seq_len), what spectrain train
    --data-path and hsgen generate-offline-data --preprocessed-data read. A DIR that already holds
    a dataset is kept unless --overwrite. Other flags: --minimum-valid-tokens, --allow-empty-output,
    --chat-template FILE; --render-endpoint, --token-freq-path and --seed are refused.
    """
    if any(a in ("-h", "--help") for a in ctx.args):
        click.echo(ctx.get_help())
        return
    a = _parse(_prepare_parser(), "prepare-data", ctx.args)
    output = Path(a.output)
    if output.is_dir() and any(output.glob("*.arrow")):
        if not a.overwrite:
            click.echo(
                f"{output}: holds a prepared dataset already, kept (--overwrite prepares it anew)", err=True
            )
            return
        strays = [p.name for p in output.iterdir() if p.suffix not in (".arrow", ".json", ".pt")]
        if strays:
            raise click.UsageError(f"--overwrite: {output} holds other files ({', '.join(strays[:3])}); "
                                   "remove them or choose another --output")  # fmt: skip
    try:
        rows, few = _render_rows(a)
    except ValueError as e:  # the input's, the renderer's or the datasets library's error, in one line
        raise click.ClickException(str(e)) from None
    if not rows["seq_len"] and not a.allow_empty_output:
        raise click.ClickException(f"--data {' '.join(a.data)}: no sample left to write "
                                   f"({few} under --minimum-valid-tokens); --allow-empty-output writes it anyway")  # fmt: skip
    _save_dataset(rows, output)
    click.echo(json.dumps({"output": str(output), "samples": len(rows["seq_len"]),
                           "tokens": sum(rows["seq_len"]), "dropped_minimum_valid_tokens": few}))  # fmt: skip


def _render_rows(a: argparse.Namespace) -> tuple[dict[str, list], int]:
    """The prepared rows of every ``--data`` input (the first ``--max-samples`` in all) and how many
    ``--minimum-valid-tokens`` dropped."""
    from hsgen.cli.render_options import make_renderer
    from hsgen.inputs.render import render_stream
    from hsgen.protocol.prompt import RenderedPrompt

    inputs = [dataset_input(d, a.max_samples) for d in a.data]
    renderer = make_renderer(a.model, a.chat_template, None, a.seq_length, "truncate")
    rows: dict[str, list] = {"input_ids": [], "loss_mask": [], "seq_len": []}
    few = 0
    for rec in render_stream(inputs, renderer):
        if a.max_samples is not None and len(rows["seq_len"]) >= a.max_samples:
            break
        if not isinstance(rec, RenderedPrompt):
            continue
        if a.minimum_valid_tokens and sum(rec.loss_mask) < a.minimum_valid_tokens:
            few += 1
            continue
        rows["input_ids"].append(list(rec.token_ids))
        rows["loss_mask"].append(list(rec.loss_mask))
        rows["seq_len"].append(len(rec.token_ids))
    return rows, few


def _save_dataset(rows: dict[str, list], output: Path) -> None:
    import shutil
    import tempfile

    from hsgen.inputs.hf_datasets import _datasets

    datasets = _datasets()

    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{output.name}.", dir=output.parent))
    try:
        ids = datasets.Sequence(datasets.Value("int64"))
        features = datasets.Features({"input_ids": ids, "loss_mask": ids, "seq_len": datasets.Value("int64")})
        datasets.Dataset.from_dict(rows, features=features).save_to_disk(str(tmp))
        output.mkdir(exist_ok=True)
        for old in output.glob("*.arrow"):
            old.unlink()
        for p in tmp.iterdir():
            p.replace(output / p.name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _launch_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="hsgen launch-vllm", add_help=False)
    p.add_argument("model")
    p.add_argument("--hidden-states-backend", default="file")
    p.add_argument("--hidden-states-path", default="/tmp/hidden_states")  # noqa: S108
    p.add_argument("--target-layer-ids", type=int, nargs="+")
    p.add_argument("--include-last-layer", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--dry-run", action="store_true")
    p.add_argument("--trust-remote-code", action="store_true")
    return p


def launch_layer_ids(model: str, given: list[int] | None, include_last: bool) -> list[int]:
    """The layers launch_vllm.py extracts: ``given`` plus the last layer (``include_last``), else
    speculators' default ``2, n//2, n-3, n``."""
    from hsgen.vllm.command import default_layer_ids, model_layers

    try:
        n = model_layers(model)
    except Exception as e:  # noqa: BLE001 (a hub or file error: one line)
        raise click.UsageError(f"{model}: cannot read its config.json ({e})") from None
    if not given:
        return default_layer_ids(n)
    return sorted({*given, *([n] if include_last else [])})


@click.command("launch-vllm", context_settings=_CTX, add_help_option=False)
@click.pass_context
def launch_vllm(ctx: click.Context) -> None:
    """speculators' launch_vllm.py: MODEL [--target-layer-ids I ...] [--hidden-states-path DIR] -- VLLM_ARGS.

    Runs vllm serve extracting the target layers plus the last one (default 2, n//2, n-3 and n)
    into DIR [default /tmp/hidden_states] through vLLM's file connector, VLLM_ARGS passed as they
    are; --dry-run prints the line instead. The line is hsgen vllm-command's.
    """
    if any(a in ("-h", "--help") for a in ctx.args):
        click.echo(ctx.get_help())
        return
    a, vllm_args = _parse(_launch_parser(), "launch-vllm", ctx.args, known=True)
    if a.hidden_states_backend != "file":
        raise click.UsageError(f"--hidden-states-backend {a.hidden_states_backend}: hsgen reads vLLM's file "
                               "connector only (file)")  # fmt: skip
    vllm_args = [x for x in vllm_args if x != "--"]
    ids = launch_layer_ids(a.model, a.target_layer_ids, a.include_last_layer)
    from hsgen.cli.vllm_command import vllm_command

    argv = [a.model, "--layer-ids", ",".join(map(str, ids)), "--shared-dir", a.hidden_states_path,
            *([] if a.dry_run else ["--run"]), "--", *vllm_args]  # fmt: skip
    vllm_command.main(argv, prog_name="hsgen launch-vllm", standalone_mode=False)


def _offline_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="hsgen generate-offline-data", add_help=False)
    p.add_argument("--model")
    p.add_argument("--endpoint", default="http://localhost:8000/v1")
    p.add_argument("--preprocessed-data", default="./output")
    p.add_argument("--max-samples", type=int)
    p.add_argument("--output")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--validate-outputs", action="store_true")
    p.add_argument("--request-timeout", type=float)
    p.add_argument("--max-retries", type=int)
    p.add_argument("--fail-on-error", action="store_true")
    p.add_argument("--max-consecutive-errors", type=int)
    p.add_argument("--world-size", type=int)
    p.add_argument("--rank", type=int)
    p.add_argument("--layer-ids")
    p.add_argument("--shared-dir")
    return p


def _served_model(endpoint: str) -> str | None:
    import urllib.request

    from hsgen.protocol.extraction import models_url, served_model_ids

    try:
        with urllib.request.urlopen(models_url(endpoint), timeout=30) as r:  # noqa: S310 (the user's endpoint)
            return served_model_ids(r.read())[0]
    except Exception:  # noqa: BLE001 (hsgen generate names an unreachable server itself)
        return None


def offline_tokens(a: argparse.Namespace) -> list[str]:
    """``hsgen generate``'s arguments for data_generation_offline.py's ``a``."""
    output = a.output or str(Path(a.preprocessed_data) / "hidden_states")
    layer_ids = a.layer_ids
    if not layer_ids:
        from hsgen.store.store import HEADER_FILE

        if not (Path(output) / HEADER_FILE).exists():
            model = a.model or _served_model(a.endpoint)
            if model is None:
                raise click.UsageError(f"--endpoint {a.endpoint}: no model listed at /v1/models; pass --model or "
                                       "--layer-ids")  # fmt: skip
            layer_ids = ",".join(map(str, launch_layer_ids(model, None, True)))
    out = [
        a.preprocessed_data,
        "--endpoint",
        a.endpoint,
        "--store",
        output,
        "--concurrency",
        str(a.concurrency),
    ]
    for flag, value in (("--model", a.model), ("--max-samples", a.max_samples), ("--timeout", a.request_timeout),
                        ("--retries", a.max_retries), ("--world-size", a.world_size), ("--rank", a.rank),
                        ("--layer-ids", layer_ids), ("--shared-dir", a.shared_dir),
                        ("--max-consecutive-failures", 1 if a.fail_on_error else a.max_consecutive_errors)):  # fmt: skip
        if value is not None:
            out += [flag, str(value)]
    return out


@click.command("generate-offline-data", context_settings=_CTX, add_help_option=False)
@click.pass_context
def generate_offline_data(ctx: click.Context) -> None:
    """speculators' data_generation_offline.py: --preprocessed-data DIR --endpoint URL --output OUT
    --concurrency C --validate-outputs.

    hsgen generate of the prepared dataset DIR into a store at OUT [default DIR/hidden_states],
    which spectrain train --hidden-states-path OUT trains from. --validate-outputs is always on
    (every file's shape, token count and values are checked); --request-timeout, --max-retries,
    --fail-on-error, --max-consecutive-errors, --world-size and --rank keep their meaning. The
    layer ids are launch-vllm's default for the served model unless --layer-ids gives the ones
    launch-vllm was started with; --shared-dir as hsgen generate's.
    """
    if any(a in ("-h", "--help") for a in ctx.args):
        click.echo(ctx.get_help())
        return
    a = _parse(_offline_parser(), "generate-offline-data", ctx.args)
    from hsgen.cli.generate import generate

    generate.main(offline_tokens(a), prog_name="hsgen generate-offline-data")
