"""rlfoundry report: a PNG and an HTML page from a synthetic metrics.jsonl."""

from __future__ import annotations

import json

import pytest

from rlfoundry.trainer.report import ReportError, main, write_report


def _write_run(run_dir, records) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))


def _ppo_records(steps: int = 10) -> list[dict]:
    records = [{"step": 0, "val-core/rlfoundry/arithmetic/reward/mean@1": 0.4}]
    for s in range(1, steps + 1):
        r = {"step": s, "critic/score/mean": 0.4 + 0.05 * s, "actor/entropy": 1.0 / s,
             "actor/ppo_kl": 0.001 * s, "response_length/mean": 8.0, "perf/throughput": "nan"}
        if s % 5 == 0:
            r["val-core/rlfoundry/arithmetic/reward/mean@1"] = 0.4 + 0.1 * s
        records.append(r)
    return records


def test_report_writes_png_and_html(tmp_path, capsys):
    _write_run(tmp_path / "run", _ppo_records())
    assert main([str(tmp_path / "run")]) == 0
    png, page = tmp_path / "run" / "report.png", tmp_path / "run" / "report.html"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    text = page.read_text()
    assert "data:image/png;base64," in text
    # the final-value table: score ends at 0.4 + 0.05 * 10 = 0.9; validation at 0.4 + 0.1 * 10 = 1.4
    assert "<td>critic/score/mean</td><td>0.45</td><td>0.9</td><td>10</td>" in text
    assert "<td>val-core/rlfoundry/arithmetic/reward/mean@1</td><td>0.4</td><td>1.4</td><td>10</td>" in text
    assert "report.png" in capsys.readouterr().out


def test_missing_metrics_are_skipped(tmp_path):
    # an SFT run: only losses. All-NaN throughput must not produce an empty panel either.
    _write_run(tmp_path, [{"step": s, "train/loss": 2.0 / s, "perf/throughput": "nan"} for s in range(1, 4)])
    paths = write_report(tmp_path, out_dir=tmp_path / "out")
    assert paths["png"].stat().st_size > 0
    text = paths["html"].read_text()
    assert "train/loss" in text and "Throughput" not in text


def test_no_metrics_is_a_clear_error(tmp_path, capsys):
    with pytest.raises(ReportError, match="no metrics.jsonl"):
        write_report(tmp_path)
    with pytest.raises(SystemExit) as exc:
        main([str(tmp_path / "missing")])
    assert exc.value.code == 1 and "does not exist" in capsys.readouterr().err
    (tmp_path / "metrics.jsonl").write_text("")
    with pytest.raises(ReportError, match="no records"):
        write_report(tmp_path)
    _write_run(tmp_path, [{"step": 1, "something/else": 1.0}])
    with pytest.raises(ReportError, match="none of the plotted metrics"):
        write_report(tmp_path)


def test_an_moe_run_gets_the_router_and_replay_panels(tmp_path):
    """An MoE run with routing replay (docs/moe.md): the experts' load, the re-routed share and the mismatch with
    and without the replay are plotted and tabled; a dense run's report has none of them."""
    records = _ppo_records(4)
    for r in records[1:]:
        r.update({"moe/layer0/load_max": 1.5, "moe/layer1/load_max": 1.25, "moe/layer0/load_cv": 0.3,
                  "actor/router_replay/changed_token_frac": 0.05,
                  "mismatch/router_replay/on/mean": 0.001, "mismatch/router_replay/off/mean": 0.004})
    _write_run(tmp_path / "moe", records)
    headline = write_report(tmp_path / "moe")["html"].read_text().split("All other metrics")[0]
    for key in ("moe/layer0/load_max", "moe/layer1/load_max", "actor/router_replay/changed_token_frac",
                "mismatch/router_replay/on/mean", "mismatch/router_replay/off/mean"):
        assert f"<td>{key}</td>" in headline, key
    assert "moe/layer0/load_cv" not in headline  # one load panel: the busiest expert's share, per layer
    _write_run(tmp_path / "dense", _ppo_records(4))
    assert "moe/" not in write_report(tmp_path / "dense")["html"].read_text()
