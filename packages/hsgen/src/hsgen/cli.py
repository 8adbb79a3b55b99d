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
    "serve": (
        "hsgen.serve.cli:serve",
        "Run the reference hidden-state server (vLLM's protocol, transformers).",
    ),
    "render": (
        "hsgen.generate_cli:render",
        "Render conversations to token ids + loss masks (JSONL on stdout).",
    ),
    "generate": (
        "hsgen.generate_cli:generate",
        "Fetch hidden states for prompts from vLLM servers into a store.",
    ),
}


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
            return getattr(importlib.import_module(module_name), attr)
        return super().get_command(ctx, cmd_name)

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        rows = [(name, self.lazy_commands[name][1]) for name in sorted(self.lazy_commands)]
        with formatter.section("Commands"):
            formatter.write_dl(rows)


@click.group(cls=LazyGroup, lazy_commands=COMMANDS, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="hsgen")
def main() -> None:
    """hsgen: hidden states from vLLM servers, landed in zarr stores for draft training."""


if __name__ == "__main__":
    main()
