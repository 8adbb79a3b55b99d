"""The command toolkit both packages' CLIs share: lazily loaded subcommands, options in sections,
the options every command has, and JSON-object option values."""

from __future__ import annotations

import importlib
import traceback
from collections.abc import Callable
from typing import Any

import click

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


def exit_code_of(command: Callable[..., Any], *args: Any) -> int:
    """Run a click command's body and return the exit status click would give it (0, ``sys.exit``'s
    code, a ``ClickException``'s after printing its line, 1 after printing the traceback of anything
    else, 130 for ``KeyboardInterrupt``)."""
    try:
        command(*args)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except click.exceptions.Exit as e:
        return e.exit_code
    except click.ClickException as e:
        e.show()
        return e.exit_code
    except KeyboardInterrupt:
        return 130
    except BaseException:
        traceback.print_exc()
        return 1
    return 0


__all__ = [
    "LOG_LEVELS",
    "LazyGroup",
    "SectionedCommand",
    "exit_code_of",
    "json_object_option",
    "with_common_options",
]
