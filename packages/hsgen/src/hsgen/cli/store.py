"""``hsgen status|verify|gc STORE``: inspect, check and clean a store."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import click

from hsgen.store.backend import is_remote
from hsgen.store.errors import StoreError
from hsgen.store.manifest import summarize
from hsgen.store.store import HiddenStateStore


def _location(ctx, param, value: str) -> str:
    """A store directory that exists, or an ``s3://bucket/prefix`` URL."""
    if is_remote(value):
        return value
    return click.Path(exists=True, file_okay=False).convert(value, param, ctx)


_store_arg = click.argument("store", callback=_location)
_json_opt = click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of text.")


def _open(path: str, *, replay: bool = True) -> HiddenStateStore:
    try:
        return HiddenStateStore.open(path, replay=replay)
    except StoreError as e:
        raise click.ClickException(str(e)) from e


def _summary(path: str, exact: bool) -> dict:
    st = _open(path, replay=exact or is_remote(path))
    if exact or is_remote(path):  # an object store's segments are read whole either way
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
    "--fast",
    is_flag=True,
    help="Read only the manifests' commit and delete lines (much faster on huge stores); a sample id "
    "stored twice then counts twice, and samples lost to a bad manifest line still count.",
)
@click.option("--exact", is_flag=True, hidden=True, help="The default; kept for old scripts.")
def status(store: str, as_json: bool, fast: bool, exact: bool) -> None:
    """Summarize STORE from its manifests: samples, tokens, bytes, bytes/token, shards, writers.

    Replays every manifest record (no shard is opened): each sample id counts once, exactly the
    samples `hsgen verify` checks and readers see. --fast reads only commit and delete lines.
    """
    s = _summary(store, exact=not fast)
    if as_json:
        click.echo(json.dumps(s))
        return
    h = s["header"]
    click.echo(f"store        {s['path']}")
    click.echo(
        f"verifier     {h['verifier']}  layers {h['layer_ids']}  hidden {h['hidden_size']}  {h['dtype']}"
    )
    click.echo(f"codec        {s['codec']}")
    click.echo(f"samples      {s['samples']}" + ("" if s["exact"] else " (copies, --fast)"))
    click.echo(f"tokens       {s['tokens']}")
    click.echo(f"bytes        {s['bytes']} ({_human(s['bytes'])}), {s['bytes_per_token']:.1f} bytes/token")
    click.echo(f"shards       {s['shards']} live, {s['deleted_shards']} deleted")
    click.echo(f"writers      {s['writers']}")
    if s.get("duplicates"):
        click.echo(f"duplicates   {s['duplicates']} later copies of stored ids (hsgen gc removes them)")
    if s["manifest_problems"]:
        click.echo(
            f"problems     {s['manifest_problems']} invalid manifest lines (hsgen verify lists them; "
            "hsgen gc --repair recovers the samples they hide)"
        )


@click.command()
@_store_arg
@_json_opt
@click.option(
    "--progress/--no-progress", default=None, help="Show a progress bar on stderr (default: if a TTY)."
)
def verify(store: str, as_json: bool, progress: bool | None) -> None:
    """Check every sample's checksum, values and every shard's shapes in STORE.

    Lists each failure (naming every sample it affects) and exits with status 1 if there is any,
    0 when the store is healthy.
    """
    from hsgen.store.verify import verify_report

    s = _open(store)
    report = verify_report(s, progress=progress is not False)  # bar or log lines: see hsgen.progress
    problems, affected = report.problems, report.samples_affected
    if as_json:
        click.echo(
            json.dumps(
                {"ok": not problems, "samples": len(s), "problems": problems, "samples_affected": affected}
            )
        )
    else:
        for p in problems:
            click.echo(f"FAIL {p}")
        click.echo(
            f"{len(s)} samples checked, {len(problems)} problems"
            + (f", {len(affected)} samples affected" if problems else ": OK")
        )
    if problems:
        sys.exit(1)


@click.command()
@_store_arg
@_json_opt
@click.option("--dry-run", is_flag=True, help="Only report what would be removed.")
@click.option(
    "--repair",
    is_flag=True,
    help="First rebuild manifests with bad lines (of writers no longer running) from the shards' own "
    "sample tables, keeping every sample whose checksum matches.",
)
@click.option(
    "--shared-dir",
    "shared_dirs",
    multiple=True,
    type=click.Path(file_okay=False),
    help="The servers' shared directory: also remove the files there left by killed 'hsgen generate' "
    "runs on this store, or, given a training run's --save-path as STORE, by killed online runs "
    "(found by their request-id prefix; other clients' files are never touched). Repeatable.",
)
def gc(store: str, as_json: bool, dry_run: bool, repair: bool, shared_dirs: tuple[str, ...]) -> None:
    """Reclaim space in STORE: orphaned temp files, uncommitted shards of dead writers, deleted shards,
    and later copies of sample ids stored twice."""
    from hsgen.log_format import setup_logging
    from hsgen.store.leases import LEASE_DIR, sweep_dead_leases
    from hsgen.store.store import HEADER_FILE

    setup_logging(logging.INFO, "%(levelname)s %(message)s")
    path = Path(store)
    if not is_remote(store) and not (path / HEADER_FILE).exists() and (path / LEASE_DIR).is_dir():
        out = {"removed_temp": 0, "removed_uncommitted": 0, "removed_deleted": 0, "bytes_freed": 0}
        out |= {"live_writers": 0, "dry_run": dry_run}  # killed before its first sample: leases only
    else:
        try:
            out = _open(store).gc(dry_run=dry_run, repair=repair)
        except (StoreError, OSError) as e:
            raise click.ClickException(str(e)) from None
    if shared_dirs and not is_remote(store):
        out.update(sweep_dead_leases(path, list(shared_dirs), dry_run=dry_run))
    if as_json:
        click.echo(json.dumps(out))
        return
    verb = "would remove" if dry_run else "removed"
    parts = [
        f"{out['removed_temp']} temp",
        f"{out['removed_uncommitted']} uncommitted",
        f"{out['removed_deleted']} deleted shards",
        f"{out.get('duplicates_removed', 0)} duplicate copies",
    ]
    if shared_dirs:
        parts.append(f"{out['orphans_removed']} server files of dead clients")
    line = f"{verb}: " + ", ".join(parts) + f"; {_human(out['bytes_freed'])} freed"
    if repair:
        line += (
            f"; repaired {out['repaired_manifests']} manifests ({out['recovered_samples']} samples recovered, "
            f"{out['dropped_samples']} corrupt dropped)"
        )
    if out["live_writers"]:
        line += f"; {out['live_writers']} live writers left alone"
    if out.get("kept_damaged"):
        line += f"; {out['kept_damaged']} shards of damaged manifests kept (use --repair)"
    click.echo(line)
