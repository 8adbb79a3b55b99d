"""``spectrain report SAVE_PATH``: a training run's metrics as PNG charts and one HTML page.

Reads ``<save_path>/metrics.jsonl`` (written by :class:`spectrain.metrics.MetricsLog`) and,
when given or found, the JSON of ``spectrain eval --json``. Writes into ``<save_path>/report/``
(or ``out_dir``):

- ``loss_lr.png``: training loss (and validation loss) with the learning rate on a second axis;
- ``acceptance.png``: per draft position, the share of correct greedy tokens over steps
  (validation records, or training records when a run had no validation);
- ``tau.png``: expected acceptance length over steps, training and validation;
- ``throughput.png``: tokens/s and the share of step time spent waiting for data;
- ``eval_acceptance.png``: the eval's histogram of accepted drafts per verifier step and its
  per-position acceptance (only with an eval JSON);
- ``index.html``: every chart embedded as a data URI (the page is one self-contained file) plus
  a summary table.

matplotlib draws the charts off screen (the Agg canvas, no display needed).
"""

from __future__ import annotations

import base64
import html
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

FIGSIZE = (8.0, 4.5)
DPI = 100
"""Every chart is ``FIGSIZE * DPI`` = 800 x 450 pixels."""

MATPLOTLIB_HINT = "spectrain report needs matplotlib: pip install matplotlib"


class ReportError(ValueError):
    """The run directory or an eval file cannot be read."""


@dataclass
class RunMetrics:
    """The records of one ``metrics.jsonl``, split by kind and ordered by step.

    A resumed run logs again the steps after its checkpoint; for a ``(split, step)`` seen
    twice the later record wins, as it is the one the surviving weights went through.
    """

    train: list[dict[str, Any]] = field(default_factory=list)
    validation: list[dict[str, Any]] = field(default_factory=list)
    bad_lines: int = 0


def read_metrics(path: str | Path) -> RunMetrics:
    """Parse a ``metrics.jsonl``; malformed lines (a kill mid-write) are counted and skipped."""
    path = Path(path)
    if not path.is_file():
        raise ReportError(f"{path}: not found (is this a spectrain --save-path?)")
    by_key: dict[tuple[str, int], dict[str, Any]] = {}
    bad = 0
    with path.open(encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                key = (str(rec.get("split", "train")), int(rec["step"]))
            except (json.JSONDecodeError, KeyError, TypeError, ValueError):
                bad += 1
                continue
            by_key[key] = rec
    out = RunMetrics(bad_lines=bad)
    for (split, _), rec in sorted(by_key.items(), key=lambda kv: kv[0][1]):
        (out.validation if split == "validation" else out.train).append(rec)
    return out


def _series(records: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    xs, ys = [], []
    for r in records:
        v = r.get(key)
        if isinstance(v, int | float) and not isinstance(v, bool):
            xs.append(int(r["step"]))
            ys.append(float(v))
    return xs, ys


def _figure():
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise ReportError(MATPLOTLIB_HINT) from None
    fig = Figure(figsize=FIGSIZE, dpi=DPI, layout="constrained")
    return fig


def _save(fig, path: Path) -> Path:
    fig.savefig(path, dpi=DPI, format="png")
    return path


def plot_loss_lr(m: RunMetrics, path: Path) -> Path:
    fig = _figure()
    ax = fig.add_subplot()
    ax.plot(*_series(m.train, "loss"), label="train loss", color="tab:blue")
    vx, vy = _series(m.validation, "loss")
    if vx:
        ax.plot(vx, vy, "o-", label="validation loss", color="tab:orange")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss")
    ax.grid(alpha=0.3)
    lr = ax.twinx()
    lr.plot(*_series(m.train, "lr"), label="learning rate", color="tab:gray", linestyle="--")
    lr.set_ylabel("learning rate")
    handles = ax.get_legend_handles_labels()[0] + lr.get_legend_handles_labels()[0]
    ax.legend(handles=handles, loc="upper right")
    ax.set_title("Loss and learning rate")
    return _save(fig, path)


def plot_acceptance(m: RunMetrics, path: Path) -> Path:
    records, split = (
        (m.validation, "validation") if any("acc" in r for r in m.validation) else (m.train, "train")
    )
    fig = _figure()
    ax = fig.add_subplot()
    width = max((len(r.get("acc") or []) for r in records), default=0)
    for i in range(width):
        xs = [int(r["step"]) for r in records if len(r.get("acc") or []) > i]
        ys = [float(r["acc"][i]) for r in records if len(r.get("acc") or []) > i]
        ax.plot(xs, ys, "o-" if split == "validation" else "-", label=f"position {i + 1}", markersize=3)
    ax.set_ylim(0, 1)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("draft token = verifier's greedy token")
    ax.set_title(f"Acceptance per draft position ({split})")
    ax.grid(alpha=0.3)
    if width:
        ax.legend(loc="best", ncol=2 if width > 6 else 1, fontsize="small")
    return _save(fig, path)


def plot_tau(m: RunMetrics, path: Path) -> Path:
    fig = _figure()
    ax = fig.add_subplot()
    ax.plot(*_series(m.train, "tau"), label="train", color="tab:blue")
    vx, vy = _series(m.validation, "tau")
    if vx:
        ax.plot(vx, vy, "o-", label="validation", color="tab:orange")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("tau (tokens per verifier step)")
    ax.set_title("Expected acceptance length")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    return _save(fig, path)


def plot_throughput(m: RunMetrics, path: Path) -> Path:
    fig = _figure()
    top, bottom = fig.subplots(2, 1, sharex=True)
    top.plot(*_series(m.train, "tokens_per_s"), color="tab:green")
    top.set_ylabel("tokens/s")
    top.set_title("Throughput and data wait")
    top.grid(alpha=0.3)
    bottom.plot(*_series(m.train, "data_wait_fraction"), color="tab:red")
    bottom.set_ylim(0, 1)
    bottom.set_ylabel("data-wait fraction")
    bottom.set_xlabel("optimizer step")
    bottom.grid(alpha=0.3)
    return _save(fig, path)


def plot_eval(report: dict[str, Any], path: Path) -> Path:
    hist = [int(x) for x in report.get("accepted_histogram") or []]
    rate = [float(x) for x in report.get("acceptance_rate") or []]
    if not hist:
        raise ReportError("eval JSON has no accepted_histogram (use the output of spectrain eval --json)")
    fig = _figure()
    left, right = fig.subplots(1, 2)
    total = max(1, sum(hist))
    left.bar(range(len(hist)), [h / total for h in hist], color="tab:blue")
    left.set_xlabel("accepted drafts in a verifier step")
    left.set_ylabel("share of steps")
    left.set_xticks(range(len(hist)))
    left.set_title(f"tau {float(report.get('tau', 0.0)):.3f} over {report.get('steps', total)} steps")
    right.bar(range(1, len(rate) + 1), rate, color="tab:orange")
    right.set_ylim(0, 1)
    right.set_xticks(range(1, len(rate) + 1))
    right.set_xlabel("draft position")
    right.set_ylabel("accepted")
    right.set_title("Acceptance per position")
    return _save(fig, path)


def find_eval_reports(save_path: Path) -> list[Path]:
    """``eval*.json`` files in ``save_path`` (where the docs suggest saving ``spectrain eval --json``)."""
    return sorted(p for p in save_path.glob("eval*.json") if p.is_file())


def _read_eval(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text(encoding="utf-8").strip()
        # `spectrain eval --json > f` leaves one object on the last line
        data = json.loads(text.splitlines()[-1]) if text else None
    except (OSError, json.JSONDecodeError) as e:
        raise ReportError(f"{path}: not a spectrain eval --json output ({e})") from None
    if not isinstance(data, dict) or "accepted_histogram" not in data:
        raise ReportError(f"{path}: not a spectrain eval --json output (no accepted_histogram)")
    return data


def _latest_config(save_path: Path) -> dict[str, Any]:
    latest = save_path / "latest"
    if not latest.is_file():
        return {}
    cfg = save_path / latest.read_text().strip() / "trainer" / "train_config.json"
    try:
        return json.loads(cfg.read_text())
    except (OSError, json.JSONDecodeError):
        return {}


def _summary_rows(
    m: RunMetrics, cfg: dict[str, Any], evals: list[tuple[Path, dict[str, Any]]]
) -> list[tuple[str, str]]:
    rows: list[tuple[str, str]] = []
    train = cfg.get("train") or {}
    if train:
        rows.append(("algorithm", str(train.get("speculator_type", ""))))
        rows.append(("verifier", str(train.get("verifier_name") or train.get("verifier", ""))))
        rows.append(("data", "online" if train.get("online") else str(train.get("store", ""))))
    if m.train:
        last = m.train[-1]
        rows.append(("last step", f"{last['step']} (epoch {last.get('epoch', '?')})"))
        if "loss" in last:
            rows.append(("last training loss", f"{float(last['loss']):.4f}"))
        rate = [float(r["tokens_per_s"]) for r in m.train if "tokens_per_s" in r]
        if rate:
            rows.append(("median tokens/s", f"{sorted(rate)[len(rate) // 2]:.0f}"))
    taus = [(float(r["tau"]), int(r["step"])) for r in m.validation if "tau" in r]
    if taus:
        best = max(taus)
        rows.append(("validation tau", f"last {taus[-1][0]:.3f}, best {best[0]:.3f} at step {best[1]}"))
    for path, ev in evals:
        rows.append((f"eval {path.name}", f"tau {float(ev.get('tau', 0)):.3f} on {ev.get('num_prompts', '?')} prompts, "
                     f"exact match {'yes' if ev.get('exact_match') else 'NO'}"))  # fmt: skip
    if m.bad_lines:
        rows.append(("unreadable metrics lines", str(m.bad_lines)))
    return rows


def _html(title: str, rows: list[tuple[str, str]], charts: list[tuple[str, Path]]) -> str:
    parts = [
        "<!doctype html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>{html.escape(title)}</title>",
        "<style>body{font-family:system-ui,sans-serif;max-width:860px;margin:2em auto;color:#222}"
        "table{border-collapse:collapse}td{padding:2px 12px 2px 0;vertical-align:top}"
        "td:first-child{color:#666}figure{margin:1.5em 0}img{max-width:100%}</style>",
        "</head><body>",
        f"<h1>{html.escape(title)}</h1>",
        "<table>",
        *(f"<tr><td>{html.escape(k)}</td><td>{html.escape(v)}</td></tr>" for k, v in rows),
        "</table>",
    ]
    for caption, png in charts:
        data = base64.b64encode(png.read_bytes()).decode("ascii")
        parts.append(
            f'<figure><img src="data:image/png;base64,{data}" alt="{html.escape(caption)}" '
            f'data-file="{html.escape(png.name)}">'
            f'<figcaption>{html.escape(caption)} (<a href="{html.escape(png.name)}">{html.escape(png.name)}</a>)'
            "</figcaption></figure>"
        )
    parts.append("</body></html>")
    return "\n".join(parts) + "\n"


def write_report(
    save_path: str | Path, out_dir: str | Path | None = None, eval_paths: list[str | Path] | None = None
) -> dict[str, Any]:
    """Render the charts and the page; returns ``{"html": path, "png": [paths], "records": n}``.

    Args:
        save_path: a ``spectrain train --save-path`` directory (holds ``metrics.jsonl``).
        out_dir: where to write (default ``<save_path>/report``).
        eval_paths: ``spectrain eval --json`` outputs; default: ``<save_path>/eval*.json``.

    Raises:
        ReportError: no metrics, unreadable eval file, or matplotlib missing (with the hint).
    """
    save_path = Path(save_path)
    metrics = read_metrics(save_path / "metrics.jsonl")
    if not metrics.train and not metrics.validation:
        raise ReportError(
            f"{save_path / 'metrics.jsonl'}: no records yet (one is written every --log-every steps)"
        )
    out = Path(out_dir) if out_dir is not None else save_path / "report"
    out.mkdir(parents=True, exist_ok=True)
    paths = [Path(p) for p in eval_paths] if eval_paths else find_eval_reports(save_path)
    evals = [(p, _read_eval(p)) for p in paths]
    charts = [
        ("Loss and learning rate", plot_loss_lr(metrics, out / "loss_lr.png")),
        ("Acceptance per draft position", plot_acceptance(metrics, out / "acceptance.png")),
        ("Expected acceptance length (tau)", plot_tau(metrics, out / "tau.png")),
        ("Tokens/s and data-wait fraction", plot_throughput(metrics, out / "throughput.png")),
    ]
    for i, (p, ev) in enumerate(evals):
        name = "eval_acceptance.png" if len(evals) == 1 else f"eval_acceptance_{i}.png"
        charts.append((f"Eval {p.name}: accepted drafts per step", plot_eval(ev, out / name)))
    rows = _summary_rows(metrics, _latest_config(save_path), evals)
    page = out / "index.html"
    page.write_text(_html(f"spectrain run {save_path.resolve().name}", rows, charts), encoding="utf-8")
    return {
        "html": str(page),
        "png": [str(p) for _, p in charts],
        "records": len(metrics.train) + len(metrics.validation),
        "evals": [str(p) for p in paths],
    }
