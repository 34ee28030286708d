"""Tracking back ends: the JSON-lines record, resume semantics, TensorBoard events, console, wandb, mlflow."""

from __future__ import annotations

import json
import math
import sys

import numpy as np
import pytest
import torch

from rlfoundry.utils.tracking import Tracking, read_metrics_jsonl


def _lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_file_backend_one_record_per_step(tmp_path):
    t = Tracking("p", "e", default_backend=[], run_dir=tmp_path, config={"lr": 0.1})
    t.log({"critic/score/mean": torch.tensor(0.5), "actor/lr": np.float32(0.25), "flag": True}, step=1)
    # flushed each step: readable before finish()
    assert _lines(tmp_path / "metrics.jsonl") == [{"step": 1, "critic/score/mean": 0.5, "actor/lr": 0.25, "flag": 1}]
    t.log({"val-core/s/reward/mean@1": 0.75}, step=1)  # validation after training metrics: same record
    t.log({"critic/score/mean": 0.6}, step=2)
    t.finish()
    records = _lines(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2]
    assert records[0] == {"step": 1, "critic/score/mean": 0.5, "actor/lr": 0.25, "flag": 1,
                          "val-core/s/reward/mean@1": 0.75}
    assert json.loads((tmp_path / "run_config.json").read_text()) == {"lr": 0.1}


def test_non_finite_and_non_scalar_values(tmp_path):
    t = Tracking("p", "e", default_backend="file", run_dir=tmp_path)
    with pytest.warns(UserWarning, match="not a scalar"):
        t.log({"a": float("nan"), "b": float("inf"), "c": torch.ones(3), "d": "text"}, step=0)
    t.finish()
    raw = (tmp_path / "metrics.jsonl").read_text()
    assert "NaN" not in raw and "Infinity" not in raw  # strict JSON
    assert _lines(tmp_path / "metrics.jsonl") == [{"step": 0, "a": "nan", "b": "inf", "d": "text"}]
    (record,) = read_metrics_jsonl(tmp_path / "metrics.jsonl")
    assert math.isnan(record["a"]) and record["b"] == math.inf and "c" not in record


def test_resume_drops_steps_after_the_checkpoint(tmp_path):
    first = Tracking("p", "e", default_backend=[], run_dir=tmp_path)
    for step in range(0, 6):  # val at 0, train 1..5; the checkpoint was at step 3, then a crash
        first.log({"x": float(step)}, step=step)
    first.finish()
    resumed = Tracking("p", "e", default_backend=[], run_dir=tmp_path, resume_step=3)
    resumed.log({"val": 1.0}, step=3)  # val_before_train on resume logs at the checkpoint step
    for step in range(4, 7):
        resumed.log({"x": 10.0 * step}, step=step)
    resumed.finish()
    records = _lines(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [0, 1, 2, 3, 4, 5, 6]
    assert records[3] == {"step": 3, "x": 3.0, "val": 1.0}
    assert [r["x"] for r in records[4:]] == [40.0, 50.0, 60.0]


def test_fresh_run_in_used_dir_keeps_old_record_aside(tmp_path):
    Tracking("p", "e", default_backend=[], run_dir=tmp_path).log({"x": 1.0}, step=1)
    t = Tracking("p", "e", default_backend=[], run_dir=tmp_path)
    t.log({"x": 2.0}, step=1)
    t.finish()
    assert _lines(tmp_path / "metrics.jsonl") == [{"step": 1, "x": 2.0}]
    assert _lines(tmp_path / "metrics.jsonl.bak") == [{"step": 1, "x": 1.0}]


def test_file_is_always_on_unless_disabled(tmp_path):
    t = Tracking("p", "e", default_backend="console", run_dir=tmp_path)
    assert t.backend_names == ["console", "file"]
    t.finish()
    t = Tracking("p", "e", default_backend="console", run_dir=tmp_path / "x", always_file=False)
    assert t.metrics_path is None
    t.finish()


def test_tensorboard_event_file_has_the_scalars(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    t = Tracking("p", "e", default_backend=["tensorboard"], run_dir=tmp_path, config={"a": 1})
    t.log({"critic/score/mean": 0.25, "note": "skip me"}, step=1)
    t.log({"critic/score/mean": 0.5}, step=2)
    t.finish()
    (event_file,) = (tmp_path / "tensorboard").glob("events.out.tfevents.*")
    acc = EventAccumulator(str(event_file.parent))
    acc.Reload()
    events = acc.Scalars("critic/score/mean")
    assert [(e.step, e.value) for e in events] == [(1, 0.25), (2, 0.5)]
    assert "note" not in acc.Tags()["scalars"]


def test_console_line_and_progress(tmp_path, capsys):
    t = Tracking("p", "exp", default_backend="console", run_dir=tmp_path, total_training_steps=4)
    t.log({"critic/score/mean": 0.5, "val-core/rlfoundry/arithmetic/acc/mean@1": 0.8,
           "actor/entropy": 1.25, "perf/throughput": 1234.5, "junk/x": 3}, step=1)
    out = capsys.readouterr()
    assert "step 1/4 | score 0.5 | val 0.8 | ent 1.25 | tok/s 1234" in out.out
    assert "junk" not in out.out and "eta" in out.out
    t.set_total_steps(8)
    assert t.logger["console"].bar.total == 8 and t.logger["console"].bar.n == 1
    t.finish()


# ───────────────────── validation generations (trainer.log_val_generations) ─────────────────────

_SAMPLES = [("1+2=", "3", 1.0), ("5-4=", "2", 0.0)]


def test_generations_go_to_the_file_and_a_resume_drops_the_later_steps(tmp_path):
    t = Tracking("p", "e", default_backend=[], run_dir=tmp_path)
    t.log_generations(_SAMPLES, step=0)
    t.log_generations(_SAMPLES[:1], step=2)
    t.finish()
    lines = _lines(tmp_path / "val_generations.jsonl")
    assert lines == [{"step": 0, "input": "1+2=", "output": "3", "score": 1.0},
                     {"step": 0, "input": "5-4=", "output": "2", "score": 0.0},
                     {"step": 2, "input": "1+2=", "output": "3", "score": 1.0}]
    # resumed from the checkpoint of step 1: step 2's samples were written after it, and go
    Tracking("p", "e", default_backend=[], run_dir=tmp_path, resume_step=1).finish()
    assert [r["step"] for r in _lines(tmp_path / "val_generations.jsonl")] == [0, 0]
    Tracking("p", "e", default_backend=[], run_dir=tmp_path).finish()  # a fresh run sets the old file aside
    assert not (tmp_path / "val_generations.jsonl").exists()
    assert len(_lines(tmp_path / "val_generations.jsonl.bak")) == 2


def test_generations_go_to_tensorboard_as_verls_text(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    t = Tracking("p", "e", default_backend=["tensorboard"], run_dir=tmp_path)
    t.log_generations(_SAMPLES, step=3)
    t.finish()
    acc = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"tensors": 0})
    acc.Reload()
    (event,) = [e for e in acc.Tensors("val/generations/text_summary")]
    text = event.tensor_proto.string_val[0].decode()
    assert event.step == 3 and "**Generation Results - Step 3**" in text
    assert "### Sample 2" in text and "**Input:** 5-4=" in text and "**Output:** 2" in text and "**Score:** 0.0" in text


def test_generations_are_printed_on_the_console(tmp_path, capsys):
    t = Tracking("p", "e", default_backend="console", run_dir=tmp_path, always_file=False)
    t.log_generations(_SAMPLES, step=1)
    t.finish()
    out = capsys.readouterr().out
    assert "step 1 | validation generations (2):" in out
    assert "[1] score 1 | '1+2=' -> '3'" in out and "[2] score 0 | '5-4=' -> '2'" in out


def test_unknown_backend_names_the_closest(tmp_path):
    with pytest.raises(ValueError, match="did you mean 'tensorboard'"):
        Tracking("p", "e", default_backend=["console", "tensorbord"], run_dir=tmp_path)
    with pytest.raises(ValueError, match="swanlab"):
        Tracking("p", "e", default_backend="swanlab", run_dir=tmp_path)


def test_wandb_missing_says_how_to_install(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # makes `import wandb` raise ImportError
    with pytest.raises(ImportError, match="pip install wandb"):
        Tracking("p", "e", default_backend="wandb", run_dir=tmp_path)


@pytest.mark.slow
def test_wandb_offline(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    t = Tracking("p", "e", default_backend="wandb", run_dir=tmp_path)
    t.log({"critic/score/mean": 0.5}, step=1)
    t.log_generations(_SAMPLES, step=1)
    t.log_generations(_SAMPLES, step=2)
    table = t.logger["wandb"]
    assert table.generation_rows == [[1, "1+2=", "3", 1.0, "5-4=", "2", 0.0], [2, "1+2=", "3", 1.0, "5-4=", "2", 0.0]]
    t.finish()
    assert list((tmp_path / "wandb").glob("offline-run-*")), "offline run directory not written"
    assert _lines(tmp_path / "metrics.jsonl") == [{"step": 1, "critic/score/mean": 0.5}]


def test_mlflow_missing_says_how_to_install(tmp_path, monkeypatch):
    from rlfoundry.utils.tracking import missing_packages

    monkeypatch.setitem(sys.modules, "mlflow", None)  # makes `import mlflow` raise ImportError
    with pytest.raises(ImportError, match="pip install mlflow-skinny"):
        Tracking("p", "e", default_backend="mlflow", run_dir=tmp_path)
    if __import__("importlib").util.find_spec("mlflow") is None:
        assert "pip install mlflow-skinny" in missing_packages(["console", "mlflow"])[0]
    assert missing_packages(["console", "file"]) == []


def test_mlflow_local_store_has_the_metrics_params_and_generations(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLFLOW_RUN_ID", raising=False)
    t = Tracking("proj", "exp", default_backend=["mlflow"], config={"actor": {"lr": 1e-6, "betas": [0.9, 0.99]}},
                 run_dir=tmp_path, always_file=False)
    t.log({"actor/pg_loss": 0.5, "val-core/gsm8k/acc/mean@1": 0.25, "note": "text"}, step=1)
    t.log({"actor/pg_loss": 0.25}, step=2)
    t.log_generations(_SAMPLES, step=2)
    t.finish()
    client = MlflowClient(tracking_uri=(tmp_path / "mlruns").resolve().as_uri())
    run_id = (tmp_path / "mlflow_run_id.txt").read_text()
    run = client.get_run(run_id)
    assert client.get_experiment(run.info.experiment_id).name == "proj" and run.info.run_name == "exp"
    assert run.data.params == {"actor/lr": "1e-06", "actor/betas": "[0.9, 0.99]"}
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "actor/pg_loss")] == [(1, 0.5), (2, 0.25)]
    assert run.data.metrics["val-core/gsm8k/acc/mean_at_1"] == 0.25  # verl's renaming of '@'
    artifact = client.download_artifacts(run_id, "val_step2.json", str(tmp_path / "dl"))
    assert json.loads(open(artifact).read()) == [{"input": i, "output": o, "score": s} for i, o, s in _SAMPLES]
    resumed = Tracking("proj", "exp", default_backend=["mlflow"], run_dir=tmp_path, resume_step=2, always_file=False)
    resumed.log({"actor/pg_loss": 0.125}, step=3)
    resumed.finish()
    assert len(client.get_metric_history(run_id, "actor/pg_loss")) == 3  # the same run continued
