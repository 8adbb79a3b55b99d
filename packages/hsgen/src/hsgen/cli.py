"""The ``hsgen`` command. Subcommands are imported only when invoked, so ``hsgen status``
starts fast and never pulls in the server's dependencies."""

from __future__ import annotations

import importlib

import click

COMMANDS: dict[str, tuple[str, str]] = {
    "status": (
        "hsgen.store.cli:status",
        "Summarize a store: unique samples, tokens, bytes, shards, writers.",
    ),
    "verify": (
        "hsgen.store.cli:verify",
        "Check every sample's checksum and shape; non-zero exit on failure.",
    ),
    "gc": (
        "hsgen.store.cli:gc",
        "Reclaim space: temp files, deleted shards, duplicate copies; --repair, --shared-dir.",
    ),
    "stats": (
        "hsgen.store.inspect_cli:stats",
        "Token-length histogram, loss-mask coverage, samples per writer and shard.",
    ),
    "show": (
        "hsgen.store.inspect_cli:show",
        "One sample token by token: decoded text, loss mask, per-layer norms.",
    ),
    "serve": (
        "hsgen.serve.cli:serve",
        "Run the reference hidden-state server (vLLM's protocol, transformers).",
    ),
    "wait": ("hsgen.wait_cli:wait", "Wait until servers answer GET /health (scripts, tutorials)."),
    "render": (
        "hsgen.render_cli:render",
        "Render conversations to token ids + loss masks (JSONL on stdout).",
    ),
    "generate": (
        "hsgen.generate_cli:generate",
        "Fetch hidden states for prompts from vLLM servers into a store.",
    ),
    "vllm-command": (
        "hsgen.vllm_command:vllm_command",
        "Print (or --run) the exact vllm serve line that extracts hidden states of a model.",
    ),
    "import-speculators": (
        "hsgen.speculators_import_cli:import_speculators",
        "Import a hidden-state cache speculators wrote (hs_<row>.safetensors + its dataset) into a store.",
    ),
    "prepare-data": (
        "hsgen.speculators_scripts:prepare_data",
        "speculators' scripts/prepare_data.py, same arguments: a prepared dataset directory.",
    ),
    "launch-vllm": (
        "hsgen.speculators_scripts:launch_vllm",
        "speculators' scripts/launch_vllm.py, same arguments: vllm serve extracting hidden states.",
    ),
    "generate-offline-data": (
        "hsgen.speculators_scripts:generate_offline_data",
        "speculators' scripts/data_generation_offline.py, same arguments: the states into a store.",
    ),
}


LOG_LEVELS = ["DEBUG", "INFO", "WARNING", "ERROR"]


def json_object_option(text: str | None, param_hint: str) -> dict:
    """A JSON-object option value (e.g. ``--template-kwargs``); ``{}`` when not given."""
    import json

    if not text:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise click.BadParameter(f"not JSON: {e}", param_hint=param_hint) from None
    if not isinstance(value, dict):
        raise click.BadParameter("must be a JSON object", param_hint=param_hint)
    return value


def _set_log_level(ctx: click.Context, param: click.Parameter, value: str | None) -> None:
    if value is not None:
        from hsgen.log_format import setup_logging

        setup_logging(value)


def _set_progress(ctx: click.Context, param: click.Parameter, value: bool | None) -> bool | None:
    from hsgen.progress import configure

    configure(value)
    return value


def with_common_options(cmd: click.Command) -> click.Command:
    """Give ``cmd`` the options every command has: ``--log-level`` and ``--progress/--no-progress``
    (added when missing; an existing ``--progress`` also sets :func:`hsgen.progress.configure`)."""
    names = {p.name: p for p in cmd.params}
    if "log_level" not in names:
        cmd.params.append(click.Option(
            ["--log-level"], type=click.Choice(LOG_LEVELS, case_sensitive=False), default=None, expose_value=False,
            callback=_set_log_level, help="Logging level on stderr [default: the command's, usually INFO].",
        ))  # fmt: skip
    if "progress" not in names:
        cmd.params.append(click.Option(
            ["--progress/--no-progress"], default=None, expose_value=False, callback=_set_progress,
            help="Progress: a bar (--progress), none (--no-progress) [default: a bar on a terminal, "
            "periodic log lines otherwise].",
        ))  # fmt: skip
    elif names["progress"].callback is None:
        names["progress"].callback = _set_progress
    return cmd


class LazyGroup(click.Group):
    """A click group whose commands are ``module:attr`` strings resolved on first use."""

    def __init__(self, *args, lazy_commands: dict[str, tuple[str, str]], **kwargs):
        super().__init__(*args, **kwargs)
        self.lazy_commands = lazy_commands

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*super().list_commands(ctx), *self.lazy_commands})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name in self.lazy_commands:
            target = self.lazy_commands[cmd_name][0]
            module_name, attr = target.split(":")
            return with_common_options(getattr(importlib.import_module(module_name), attr))
        return super().get_command(ctx, cmd_name)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        rows = [(name, self.lazy_commands[name][1]) for name in sorted(self.lazy_commands)]
        with formatter.section("Commands"):
            formatter.write_dl(rows)


class SectionedCommand(click.Command):
    """A click command whose ``--help`` lists its options in named sections.

    ``sections`` maps a title to the parameter names it holds, in display order; options in no
    section are listed last under "Other options".
    """

    def __init__(self, *args, sections: dict[str, tuple[str, ...]], **kwargs):
        super().__init__(*args, **kwargs)
        self.sections = sections

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        help_option = self.get_help_option(ctx)
        rows = {p.name: p.get_help_record(ctx) for p in self.get_params(ctx) if p is not help_option}
        rows = {k: v for k, v in rows.items() if v is not None}
        placed: set[str] = set()
        for title, names in self.sections.items():
            section = [rows[n] for n in names if n in rows]
            placed.update(n for n in names if n in rows)
            if section:
                with formatter.section(title):
                    formatter.write_dl(section)
        rest = [v for k, v in rows.items() if k not in placed]
        if help_option is not None:
            rest.append(help_option.get_help_record(ctx))
        with formatter.section("Other options" if len(rest) > 1 else "Help"):
            formatter.write_dl([r for r in rest if r is not None])


@click.group(
    cls=LazyGroup,
    lazy_commands=COMMANDS,
    context_settings={"help_option_names": ["-h", "--help"], "show_default": True},
)
@click.version_option(package_name="hsgen")
def main() -> None:
    """hsgen: hidden states from vLLM servers, landed in zarr stores for draft training."""


if __name__ == "__main__":
    main()
