"""``spectrain report SAVE_PATH``: a training run's metrics as PNG charts and one HTML page.

Reads ``<save_path>/metrics.jsonl`` (written by :class:`spectrain.train.metrics.MetricsLog`) and,
when given or found, the JSON of ``spectrain eval --json``. Writes into ``<save_path>/report/``
(or ``out_dir``):

- ``loss_lr.png``: training loss (and validation loss) with the learning rate on a second axis;
- ``position_accuracy.png``: per draft position, the share of draft tokens equal to the
  verifier's greedy token, teacher-forced (validation records, or training records when a run
  had no validation): training accuracy, not the acceptance a served draft reaches;
- ``tau.png``: the acceptance length that accuracy implies, training and validation, with each
  eval's measured tau beside it as a level line;
- ``throughput.png``: tokens/s and the share of step time spent waiting for data;
- ``eval_acceptance.png``: the eval's measured acceptance: histogram of accepted drafts per
  verifier step and acceptance per position (only with an eval JSON);
- ``index.html``: every chart embedded as a data URI (the page is one self-contained file), a
  summary table and the run's hyperparameters (from the latest checkpoint's config).

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


def _style(n: int, validation: bool = False) -> str:
    """Line style of a series of ``n`` points: markers where lines alone would not show them."""
    return "o-" if validation or n <= 20 else "-"


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
    tx, ty = _series(m.train, "loss")
    ax.plot(tx, ty, _style(len(tx)), label="train loss", color="tab:blue", markersize=3)
    vx, vy = _series(m.validation, "loss")
    if vx:
        ax.plot(vx, vy, "o-", label="validation loss", color="tab:orange")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss")
    ax.grid(alpha=0.3)
    lr = ax.twinx()
    lx, ly = _series(m.train, "lr")
    lr.plot(lx, ly, "o--" if len(lx) <= 20 else "--", label="learning rate", color="tab:gray", markersize=3)
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
        ax.plot(xs, ys, _style(len(xs), split == "validation"), label=f"position {i + 1}", markersize=3)
    ax.set_ylim(0, 1)
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("draft token = verifier's greedy token")
    ax.set_title(
        f"Training accuracy per draft position\n({split}, teacher-forced; not measured acceptance)",
        fontsize="medium",
    )
    ax.grid(alpha=0.3)
    if width:
        ax.legend(loc="best", ncol=2 if width > 6 else 1, fontsize="small")
    return _save(fig, path)


def plot_tau(m: RunMetrics, path: Path, evals: list[tuple[Path, dict[str, Any]]] = ()) -> Path:
    fig = _figure()
    ax = fig.add_subplot()
    tx, ty = _series(m.train, "tau")
    ax.plot(tx, ty, _style(len(tx)), label="train (from accuracy)", color="tab:blue", markersize=3)
    vx, vy = _series(m.validation, "tau")
    if vx:
        ax.plot(vx, vy, "o-", label="validation (from accuracy)", color="tab:orange")
    for i, (p, ev) in enumerate(evals):
        if isinstance(ev.get("tau"), int | float):
            ax.axhline(float(ev["tau"]), color=f"C{(i + 2) % 10}", linestyle=":",
                       label=f"eval {p.stem}: measured tau {float(ev['tau']):.3f}")  # fmt: skip
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("tau (tokens per verifier step)")
    ax.set_title("Acceptance length: implied by training accuracy vs measured by spectrain eval")
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right")
    return _save(fig, path)


def plot_throughput(m: RunMetrics, path: Path) -> Path:
    fig = _figure()
    top, bottom = fig.subplots(2, 1, sharex=True)
    px, py = _series(m.train, "tokens_per_s")
    top.plot(px, py, _style(len(px)), color="tab:green", markersize=3)
    top.set_ylabel("tokens/s")
    top.set_title("Throughput and data wait")
    top.grid(alpha=0.3)
    wx, wy = _series(m.train, "data_wait_fraction")
    bottom.plot(wx, wy, _style(len(wx)), color="tab:red", markersize=3)
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
    right.set_title("Measured acceptance per position")
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
        if train.get("run_name"):
            rows.append(("run", str(train["run_name"])))
        rows.append(("algorithm", str(train.get("speculator_type", ""))))
        rows.append(("verifier", str(train.get("verifier_name") or train.get("verifier", ""))))
        rows.append(("data", "online" if train.get("online") else str(train.get("store", ""))))
    if m.train:
        last = m.train[-1]
        epochs = train.get("epochs")
        epoch = last.get("epoch")
        where = (
            f"epoch {int(epoch) + 1}" + (f" of {epochs}" if epochs else "") if isinstance(epoch, int) else "?"
        )
        rows.append(("last step", f"{last['step']} ({where})"))
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


HYPERPARAMETERS = ("speculator_type", "epochs", "max_steps", "lr", "optimizer", "muon_lr", "schedule",
                   "warmup_steps", "warmup_ratio", "min_lr_ratio", "weight_decay", "betas", "max_grad_norm",
                   "total_seq_len", "grad_accum", "seed", "val_fraction", "precision", "distributed")  # fmt: skip
"""The training fields the page lists (every draft option follows them)."""


def hyperparameter_rows(cfg: dict[str, Any]) -> list[tuple[str, str]]:
    """The run's hyperparameters: the fields above, then the resolved draft config."""
    train, draft = cfg.get("train") or {}, cfg.get("draft") or {}
    rows = [(k, json.dumps(train[k])) for k in HYPERPARAMETERS if train.get(k) is not None]
    rows += [
        (f"draft.{k}", json.dumps(v)) for k, v in sorted(draft.items()) if v is not None and k != "algorithm"
    ]
    return rows


def _html(title: str, rows: list[tuple[str, str]], charts: list[tuple[str, Path]],
          hyper: list[tuple[str, str]] = ()) -> str:  # fmt: skip
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
    if hyper:
        parts += ["<h2>Hyperparameters</h2>", "<table>",
                  *(f"<tr><td>{html.escape(k)}</td><td>{html.escape(v)}</td></tr>" for k, v in hyper), "</table>"]  # fmt: skip
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
        (
            "Training accuracy per draft position (teacher-forced)",
            plot_acceptance(metrics, out / "position_accuracy.png"),
        ),
        (
            "Acceptance length: implied by training accuracy, measured by eval",
            plot_tau(metrics, out / "tau.png", evals),
        ),
        ("Tokens/s and data-wait fraction", plot_throughput(metrics, out / "throughput.png")),
    ]
    for i, (p, ev) in enumerate(evals):
        name = "eval_acceptance.png" if len(evals) == 1 else f"eval_acceptance_{i}.png"
        charts.append((f"Eval {p.name}: measured acceptance", plot_eval(ev, out / name)))
    cfg = _latest_config(save_path)
    rows = _summary_rows(metrics, cfg, evals)
    page = out / "index.html"
    title = (cfg.get("train") or {}).get("run_name") or save_path.resolve().name
    page.write_text(_html(f"spectrain run {title}", rows, charts, hyperparameter_rows(cfg)),
                    encoding="utf-8")  # fmt: skip
    return {
        "html": str(page),
        "png": [str(p) for _, p in charts],
        "records": len(metrics.train) + len(metrics.validation),
        "evals": [str(p) for p in paths],
    }
