"""``hsgen wait URL``: block until a server (vLLM or ``hsgen serve``) answers ``GET /health``."""

from __future__ import annotations

import time
import urllib.error
import urllib.request

import click


def wait_healthy(url: str, timeout_s: float, interval_s: float = 0.25) -> float:
    """Seconds until ``url``/health returned 200; raises ``TimeoutError`` after ``timeout_s``."""
    base = url.rstrip("/").removesuffix("/v1")
    t0 = time.monotonic()
    while True:
        try:
            with urllib.request.urlopen(base + "/health", timeout=max(0.5, interval_s)) as r:
                if r.status == 200:
                    return time.monotonic() - t0
        except (urllib.error.URLError, OSError):
            pass
        if time.monotonic() - t0 > timeout_s:
            raise TimeoutError(f"{base}/health: no answer within {timeout_s:g} s")
        time.sleep(interval_s)


@click.command("wait")
@click.argument("urls", nargs=-1, required=True)
@click.option("--timeout", type=click.FloatRange(min=0), default=600.0, help="Seconds to wait at most.")
def wait(urls: tuple[str, ...], timeout: float) -> None:
    """Wait until every server URL answers GET /health (e.g. after starting one in the background).

    Exit status 0 once all are healthy, 1 after --timeout seconds.
    """
    for url in urls:
        try:
            took = wait_healthy(url, timeout)
        except TimeoutError as e:
            raise click.ClickException(str(e)) from None
        click.echo(f"{url}: healthy after {took:.1f} s", err=True)
