"""The ``hsgen`` command. Subcommands are imported only when invoked, so ``hsgen status``
starts fast and never pulls in the server's dependencies."""

from __future__ import annotations

import click

from hsgen.cli.toolkit import LOG_LEVELS, LazyGroup, SectionedCommand, json_object_option, with_common_options

COMMANDS: dict[str, tuple[str, str]] = {
    "status": (
        "hsgen.cli.store:status",
        "Summarize a store: unique samples, tokens, bytes, shards, writers.",
    ),
    "verify": (
        "hsgen.cli.store:verify",
        "Check every sample's checksum and shape; non-zero exit on failure.",
    ),
    "gc": (
        "hsgen.cli.store:gc",
        "Reclaim space: temp files, deleted shards, duplicate copies; --repair, --shared-dir.",
    ),
    "stats": (
        "hsgen.cli.inspect:stats",
        "Token-length histogram, loss-mask coverage, samples per writer and shard.",
    ),
    "show": (
        "hsgen.cli.inspect:show",
        "One sample token by token: decoded text, loss mask, per-layer norms.",
    ),
    "serve": (
        "hsgen.cli.serve:serve",
        "Run the reference hidden-state server (vLLM's protocol, transformers).",
    ),
    "wait": ("hsgen.cli.wait:wait", "Wait until servers answer GET /health (scripts, tutorials)."),
    "render": (
        "hsgen.cli.render:render",
        "Render conversations to token ids + loss masks (JSONL on stdout).",
    ),
    "generate": (
        "hsgen.cli.generate:generate",
        "Fetch hidden states for prompts from vLLM servers into a store.",
    ),
    "vllm-command": (
        "hsgen.cli.vllm_command:vllm_command",
        "Print (or --run) the exact vllm serve line that extracts hidden states of a model.",
    ),
    "import-speculators": (
        "hsgen.cli.import_speculators:import_speculators",
        "Import a hidden-state cache speculators wrote (hs_<row>.safetensors + its dataset) into a store.",
    ),
    "prepare-data": (
        "hsgen.cli.speculators_scripts:prepare_data",
        "speculators' scripts/prepare_data.py, same arguments: a prepared dataset directory.",
    ),
    "launch-vllm": (
        "hsgen.cli.speculators_scripts:launch_vllm",
        "speculators' scripts/launch_vllm.py, same arguments: vllm serve extracting hidden states.",
    ),
    "generate-offline-data": (
        "hsgen.cli.speculators_scripts:generate_offline_data",
        "speculators' scripts/data_generation_offline.py, same arguments: the states into a store.",
    ),
}


@click.group(
    cls=LazyGroup,
    lazy_commands=COMMANDS,
    context_settings={"help_option_names": ["-h", "--help"], "show_default": True},
)
@click.version_option(package_name="hsgen")
def main() -> None:
    """hsgen: hidden states from vLLM servers, landed in zarr stores for draft training."""


__all__ = [
    "COMMANDS",
    "LOG_LEVELS",
    "LazyGroup",
    "SectionedCommand",
    "json_object_option",
    "main",
    "with_common_options",
]
