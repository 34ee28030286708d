"""``rlfoundry report <run_dir>``: a run at a glance, from the ``metrics.jsonl`` the tracker wrote.

Writes ``report.png`` (one panel per quantity: score, validation accuracy, KL, entropy, response
length, throughput, the loss for SFT runs; for MoE runs the experts' load, the share of tokens the
trainer re-routes and the log-prob mismatch with and without routing replay) and ``report.html``
(the picture plus a table of first and final values). Panels whose metrics the run never logged are
left out.
"""

from __future__ import annotations

import argparse
import base64
import fnmatch
import html
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from rlfoundry.utils.tracking import METRICS_FILE, read_metrics_jsonl

__all__ = ["Panel", "PANELS", "load_records", "write_report", "main"]


@dataclass(frozen=True)
class Panel:
    """One plot: metrics matching ``patterns`` (fnmatch; the first pattern with any match wins when
    ``first_match_only``, e.g. accuracy rather than reward when the scorer reports both)."""

    title: str
    patterns: tuple[str, ...]
    first_match_only: bool = False


PANELS: tuple[Panel, ...] = (
    Panel("Score (critic/score/mean)", ("critic/score/mean",)),
    Panel("Validation accuracy", ("val-core/*/acc/mean@*", "val-core/*/reward/mean@*"), first_match_only=True),
    Panel("KL", ("actor/ppo_kl", "actor/reward_kl_penalty", "actor/kl_loss")),
    Panel("Entropy", ("actor/entropy",)),
    Panel("Response length", ("response_length/mean", "response_length/max")),
    Panel("Throughput (tokens/s per worker)", ("perf/throughput",)),
    Panel("Loss", ("train/loss", "val/loss")),
    # MoE runs (docs/moe.md): how evenly the experts are used, how many tokens the trainer's router would send
    # elsewhere than the rollout's, and what replaying the rollout's experts does to the log-prob mismatch
    Panel("MoE expert load (max share x N; 1 = balanced)", ("moe/layer*/load_max",)),
    Panel("Tokens re-routed by the trainer", ("actor/router_replay/changed_token_frac",)),
    Panel("|Δ log p| rollout vs trainer, replay on / off", ("mismatch/router_replay/on/mean",
                                                            "mismatch/router_replay/off/mean")),
)


class ReportError(RuntimeError):
    """A run directory that cannot be reported on; the message says why and what to do."""


def load_records(run_dir: str | Path) -> list[dict]:
    """The run's per-step records, or a ``ReportError`` saying what is missing."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ReportError(f"run directory {str(run_dir)!r} does not exist")
    path = run_dir / METRICS_FILE
    if not path.is_file():
        raise ReportError(
            f"no {METRICS_FILE} in {str(run_dir)!r}. Point `rlfoundry report` at the run directory "
            f"(trainer.default_local_dir); runs write {METRICS_FILE} there unless the file logger was turned off."
        )
    records = read_metrics_jsonl(path)
    if not records:
        raise ReportError(f"{path} has no records yet: the run has not finished a step")
    return records


def _series(records: Sequence[dict], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) where ``key`` holds a finite number (validation is logged only every test_freq
    steps; a NaN step is a gap, and an all-NaN metric then counts as missing)."""
    points = [(r["step"], float(r[key])) for r in records
              if isinstance(r.get(key), (int, float)) and not isinstance(r.get(key), bool) and math.isfinite(r[key])]
    return [s for s, _ in points], [v for _, v in points]


def _panel_keys(panel: Panel, keys: Sequence[str]) -> list[str]:
    found: list[str] = []
    for pattern in panel.patterns:
        matched = [k for k in keys if fnmatch.fnmatchcase(k, pattern)]
        if matched and panel.first_match_only:
            return matched
        found += [k for k in matched if k not in found]
    return found


def _all_keys(records: Sequence[dict]) -> list[str]:
    return list(dict.fromkeys(k for r in records for k in r if k != "step"))


def _plot(records: Sequence[dict], panels: list[tuple[Panel, list[str]]], title: str, out: Path) -> None:
    # The object API (no pyplot) draws without touching the global backend: safe in servers and tests.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    ncols = min(3, len(panels))
    nrows = math.ceil(len(panels) / ncols)
    fig = Figure(figsize=(5 * ncols, 3.4 * nrows), layout="constrained")
    FigureCanvasAgg(fig)
    fig.suptitle(title)
    for i, (panel, keys) in enumerate(panels):
        ax = fig.add_subplot(nrows, ncols, i + 1)
        for key in keys:
            steps, values = _series(records, key)
            sparse = len(steps) < len(records) / 2  # validation points: show markers
            ax.plot(steps, values, marker="o" if sparse else None, markersize=3, label=key)
        ax.set_title(panel.title, fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    fig.savefig(out, dpi=100)


def _table_rows(records: Sequence[dict], keys: Sequence[str]) -> str:
    rows = []
    for key in keys:
        steps, values = _series(records, key)
        if values:
            rows.append(f"<tr><td>{html.escape(key)}</td><td>{values[0]:.4g}</td>"
                        f"<td>{values[-1]:.4g}</td><td>{steps[-1]}</td></tr>")
    return "\n".join(rows)


def _write_html(records: Sequence[dict], png: Path, headline: list[str], title: str, out: Path) -> None:
    """A single self-contained page: the PNG is inlined, so the file can be mailed or attached."""
    image = base64.b64encode(png.read_bytes()).decode()
    others = [k for k in _all_keys(records) if k not in headline]
    head = "<tr><th>metric</th><th>first</th><th>final</th><th>final step</th></tr>"
    out.write_text(
        f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
        "<style>body{font-family:sans-serif;margin:2em}td,th{padding:2px 10px;text-align:right}"
        "td:first-child{text-align:left}table{border-collapse:collapse}tr:nth-child(even){background:#f3f3f3}"
        f"</style></head><body><h1>{html.escape(title)}</h1>"
        f"<img alt='metrics over steps' style='max-width:100%' src='data:image/png;base64,{image}'>"
        f"<h2>Headline metrics</h2><table>{head}{_table_rows(records, headline)}</table>"
        f"<details><summary>All other metrics ({len(others)})</summary>"
        f"<table>{head}{_table_rows(records, others)}</table></details></body></html>",
        encoding="utf-8",
    )


def write_report(run_dir: str | Path, out_dir: str | Path | None = None) -> dict[str, Path]:
    """Write ``report.png`` and ``report.html`` for ``run_dir`` (into ``out_dir``, default the run
    directory); returns their paths. Raises ``ReportError`` when there is nothing to plot."""
    records = load_records(run_dir)
    keys = _all_keys(records)
    panels = [(p, k) for p in PANELS if (k := _panel_keys(p, keys)) and any(_series(records, x)[0] for x in k)]
    if not panels:
        wanted = ", ".join(pat for p in PANELS for pat in p.patterns)
        raise ReportError(f"{Path(run_dir) / METRICS_FILE} has none of the plotted metrics ({wanted}); "
                          f"it has: {', '.join(keys[:20]) or 'nothing but steps'}")
    out = Path(out_dir) if out_dir is not None else Path(run_dir)
    out.mkdir(parents=True, exist_ok=True)
    title = f"{Path(run_dir).resolve().name}: {len(records)} steps (last {records[-1]['step']})"
    png, page = out / "report.png", out / "report.html"
    _plot(records, panels, title, png)
    _write_html(records, png, [k for _, ks in panels for k in ks], title, page)
    return {"png": png, "html": page}


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rlfoundry report", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", help="run directory holding metrics.jsonl (trainer.default_local_dir)")
    parser.add_argument("--out", default=None, help="where to write report.png/html (default: run_dir)")
    args = parser.parse_args(argv)
    try:
        paths = write_report(args.run_dir, args.out)
    except ReportError as e:
        # SystemExit, not a return code: the CLI dispatcher may ignore main()'s return value.
        print(f"rlfoundry report: {e}", file=sys.stderr)
        raise SystemExit(1) from None
    print(f"wrote {paths['png']}\nwrote {paths['html']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
