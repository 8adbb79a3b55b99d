"""``hsgen stats STORE`` and ``hsgen show STORE ID`` (see :mod:`hsgen.store.inspect`)."""

from __future__ import annotations

import json

import click

from hsgen.cli.store import _human, _json_opt, _open, _store_arg


def _bar(count: int, total: int, width: int = 40) -> str:
    return "#" * round(width * count / total) if total else ""


@click.command("stats", context_settings={"show_default": True})
@_store_arg
@_json_opt
@click.option(
    "--shards", "max_shards", type=click.IntRange(min=0), default=20, help="Shards listed in the text output."
)
def stats(store: str, as_json: bool, max_shards: int) -> None:
    """Token-length histogram, loss-mask coverage and samples per writer and shard of STORE.

    Reads the manifests and each shard's loss_mask (no hidden state). A sample id stored twice
    counts once.
    """
    from hsgen.store.inspect import store_details

    d = store_details(_open(store))
    if as_json:
        click.echo(json.dumps(d))
        return
    n = d["samples"]
    ln = d["length"]
    click.echo(f"store          {d['path']}")
    click.echo(f"samples        {n}")
    click.echo(f"tokens         {d['tokens']}  (min {ln['min']}, mean {ln['mean']:.1f}, p50 {ln['p50']}, "
               f"p90 {ln['p90']}, p99 {ln['p99']}, max {ln['max']})")  # fmt: skip
    click.echo(f"loss mask      {d['trained_tokens']} trained tokens = {d['loss_mask_coverage']:.1%} of all; "
               f"{d['samples_without_loss']} samples without any")  # fmt: skip
    click.echo("")
    click.echo("tokens per sample")
    for b in d["length_histogram"]:
        click.echo(f"{b['min']:>7}-{b['max']:<7} {b['samples']:>8}  {b['samples'] / max(n, 1):>6.1%}  "
                   f"{_bar(b['samples'], n)}")  # fmt: skip
    click.echo("")
    click.echo(f"{'writer':<40} {'shards':>6} {'samples':>8} {'tokens':>10} {'trained':>7} {'bytes':>10}")
    for name, w in d["writers"].items():
        cov = w["trained_tokens"] / w["tokens"] if w["tokens"] else 0.0
        click.echo(f"{name:<40} {w['shards']:>6} {w['samples']:>8} {w['tokens']:>10} {cov:>7.1%} "
                   f"{_human(w['bytes']):>10}")  # fmt: skip
    click.echo("")
    click.echo(f"{'shard':<40} {'samples':>15} {'tokens':>10} {'trained':>7} {'bytes':>10}")
    for name, s in list(d["shards"].items())[:max_shards]:
        cov = s["trained_tokens"] / s["tokens"] if s["tokens"] else 0.0
        click.echo(f"{name:<40} {s['samples']:>15} {s['tokens']:>10} {cov:>7.1%} {_human(s['bytes']):>10}")
    if len(d["shards"]) > max_shards:
        click.echo(f"... {len(d['shards']) - max_shards} more shards (--shards N, or --json)")


@click.command("show", context_settings={"show_default": True})
@_store_arg
@click.argument("sample_id")
@_json_opt
@click.option(
    "--tokenizer",
    help="Tokenizer directory or hub id to decode with [default: the store header's verifier, when it "
    "is a local directory or a cached hub model].",
)
@click.option("--revision", help="Branch, tag or commit of a hub --tokenizer [default: main].")
@click.option(
    "--max-tokens", type=click.IntRange(min=1), default=None, help="Token rows printed [default: all]."
)
@click.option("--verify/--no-verify", default=True, help="Check the sample's checksum.")
def show(store: str, sample_id: str, as_json: bool, tokenizer: str | None, revision: str | None,
         max_tokens: int | None, verify: bool) -> None:  # fmt: skip
    """One sample of STORE token by token: id, decoded text, loss mask, per-layer hidden-state norms.

    Trained tokens (loss mask 1) are marked '*'. The norms are the L2 norms of the token's stored
    hidden state in each layer, useful to spot zeros, NaNs or a layer mix-up.
    """
    from hsgen.hf.hub import HubError
    from hsgen.store.errors import StoreError
    from hsgen.store.inspect import load_tokenizer, show_sample

    st = _open(store)
    try:
        tok, note = load_tokenizer(st, tokenizer, revision)
    except HubError as e:
        raise click.BadParameter(str(e), param_hint="--tokenizer") from None
    try:
        d = show_sample(st, sample_id, tok, verify=verify)
    except KeyError as e:
        raise click.ClickException(str(e.args[0])) from None
    except StoreError as e:
        raise click.ClickException(str(e)) from None
    d["tokenizer"] = note
    if as_json:
        click.echo(json.dumps(d))
        return
    click.echo(f"sample    {d['sample_id']}  ({d['length']} tokens, {d['trained_tokens']} trained)")
    click.echo(f"shard     {d['shard']} rows {d['offset']}..{d['offset'] + d['length'] - 1}")
    click.echo(f"checksum  {d['checksum']}" + (" verified" if d["verified"] else ""))
    click.echo(f"decoded   {note}")
    click.echo("layer norms  " + "  ".join(
        f"{lid}: mean {v['mean']:.2f} [{v['min']:.2f}, {v['max']:.2f}]" for lid, v in d["layers"].items()))  # fmt: skip
    click.echo("")
    head = " ".join(f"{'L' + str(i) + ' norm':>9}" for i in d["layer_ids"])
    click.echo(f"{'pos':>5} {'token':>7} m  {'text':<24} {head}")
    rows = d["tokens"] if max_tokens is None else d["tokens"][:max_tokens]
    for t in rows:
        text = json.dumps(t.get("text", ""), ensure_ascii=False)[1:-1][:24]
        norms = " ".join(f"{x:>9.3f}" for x in t["norms"])
        click.echo(f"{t['i']:>5} {t['id']:>7} {'*' if t['mask'] else ' '}  {text:<24} {norms}")
    if len(rows) < len(d["tokens"]):
        click.echo(f"... {len(d['tokens']) - len(rows)} more tokens (--max-tokens N, or --json)")
