"""``hsgen status|verify|gc STORE``: inspect, check and clean a store."""

from __future__ import annotations

import json
import logging
import sys

import click

from .errors import StoreError
from .manifest import summarize
from .store import HiddenStateStore

_store_arg = click.argument("store", type=click.Path(exists=True, file_okay=False))
_json_opt = click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of text.")


def _open(path: str, *, replay: bool = True) -> HiddenStateStore:
    try:
        return HiddenStateStore.open(path, replay=replay)
    except StoreError as e:
        raise click.ClickException(str(e)) from e


def _summary(path: str, exact: bool) -> dict:
    st = _open(path, replay=exact)
    if exact:
        return {**st.stats(), "exact": True}
    s = summarize(st.path / "manifests")
    return {
        "path": str(st.path),
        "samples": s["samples"],
        "tokens": s["tokens"],
        "bytes": s["bytes"],
        "bytes_per_token": s["bytes"] / s["tokens"] if s["tokens"] else 0.0,
        "shards": s["shards"],
        "writers": len(s["writer_ids"]),
        "writer_ids": s["writer_ids"],
        "deleted_shards": s["deleted_shards"],
        "manifest_problems": s["manifest_problems"],
        "codec": st.header.codec,
        "header": st.header.to_dict(),
        "exact": False,
    }


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


@click.command()
@_store_arg
@_json_opt
@click.option(
    "--exact",
    is_flag=True,
    help="Replay every manifest record to count duplicate sample ids once (slower on big stores).",
)
def status(store: str, as_json: bool, exact: bool) -> None:
    """Summarize STORE from its manifests: samples, tokens, bytes, bytes/token, shards, writers.

    Reads only the manifests' commit and delete lines (no shard is opened), so it stays fast on
    stores of millions of samples. A sample id stored twice counts twice unless --exact.
    """
    s = _summary(store, exact)
    if as_json:
        click.echo(json.dumps(s))
        return
    h = s["header"]
    click.echo(f"store        {s['path']}")
    click.echo(
        f"verifier     {h['verifier']}  layers {h['layer_ids']}  hidden {h['hidden_size']}  {h['dtype']}"
    )
    click.echo(f"codec        {s['codec']}")
    click.echo(f"samples      {s['samples']}")
    click.echo(f"tokens       {s['tokens']}")
    click.echo(f"bytes        {s['bytes']} ({_human(s['bytes'])}), {s['bytes_per_token']:.1f} bytes/token")
    click.echo(f"shards       {s['shards']} live, {s['deleted_shards']} deleted")
    click.echo(f"writers      {s['writers']}")
    if s.get("duplicates"):
        click.echo(f"duplicates   {s['duplicates']} (a later copy of a sample id is ignored)")
    if s["manifest_problems"]:
        click.echo(f"problems     {s['manifest_problems']} invalid manifest lines (run hsgen verify)")


@click.command()
@_store_arg
@_json_opt
@click.option(
    "--progress/--no-progress", default=None, help="Show a progress bar on stderr (default: if a TTY)."
)
def verify(store: str, as_json: bool, progress: bool | None) -> None:
    """Check every sample's checksum and every shard's shapes in STORE.

    Lists each failure and exits with status 1 if there is any, 0 when the store is healthy.
    """
    s = _open(store)
    problems = s.verify(progress=progress is not False)  # bar or log lines: see hsgen.progress
    if as_json:
        click.echo(json.dumps({"ok": not problems, "samples": len(s), "problems": problems}))
    else:
        for p in problems:
            click.echo(f"FAIL {p}")
        click.echo(f"{len(s)} samples checked, {len(problems)} problems" + ("" if problems else ": OK"))
    if problems:
        sys.exit(1)


@click.command()
@_store_arg
@_json_opt
@click.option("--dry-run", is_flag=True, help="Only report what would be removed.")
def gc(store: str, as_json: bool, dry_run: bool) -> None:
    """Remove orphaned temp files, uncommitted shards of dead writers and deleted shards from STORE."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s", stream=sys.stderr)
    out = _open(store).gc(dry_run=dry_run)
    if as_json:
        click.echo(json.dumps(out))
        return
    verb = "would remove" if dry_run else "removed"
    click.echo(
        f"{verb}: {out['removed_temp']} temp, {out['removed_uncommitted']} uncommitted, "
        f"{out['removed_deleted']} deleted shards; {_human(out['bytes_freed'])} freed"
        + (f"; {out['live_writers']} live writers left alone" if out["live_writers"] else "")
    )
